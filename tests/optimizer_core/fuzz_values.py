"""Mutations of the fuzz test that keep a model well-formed but change what it holds: values of
every element type (``typed_value``) and attribute values against the input's rank
(``attribute_value``). Whether the result is still a valid model is decided by onnxruntime
(:func:`runs_in_onnxruntime`): one it runs must be optimized with equal results, one it refuses
must be refused."""

from __future__ import annotations

import random

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from tests.optimizer_core.element_types import ELEMENT_TYPES, accepts, values

T = onnx.TensorProto

# attributes whose values an op constrains by its input's rank (or by each other)
RANK_ATTRIBUTES = frozenset(
    {"perm", "axis", "axes", "keepdims", "kernel_shape", "pads", "strides", "dilations"}
)
# ops whose second input is a list of axes (opset 13 and later)
AXES_INPUT_OPS = frozenset({"Squeeze", "Unsqueeze", "ReduceSum"})
WINDOWED = frozenset({"Conv", "MaxPool", "AveragePool"})


def add_typed_value(model: onnx.ModelProto, rng: random.Random) -> str:
    """An initializer of an element type drawn from every ONNX type, read by ``Identity`` and
    ``Concat`` where the model's opset lets them take it, as a second graph output; returns the
    type's name."""
    g = model.graph
    name = rng.choice(list(ELEMENT_TYPES))
    elem = ELEMENT_TYPES[name]
    opset = model.opset_import[0].version
    g.initializer.append(onh.from_array(values(elem, (2,), rng.randrange(100)), "typed"))
    out = "typed"
    if accepts("Identity", opset, 0, elem):
        g.node.append(oh.make_node("Identity", ["typed"], ["typed_id"], name="typed_identity"))
        out = "typed_id"
        if accepts("Concat", opset, 0, elem):
            g.node.append(
                oh.make_node("Concat", [out, "typed"], ["typed_cat"], axis=0, name="typed_concat")
            )
            out = "typed_cat"
    shape = [4] if out == "typed_cat" else [2]
    g.output.append(oh.make_tensor_value_info(out, elem, shape))
    return name


def _ranks(model: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    ranks = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        tt = vi.type.tensor_type
        if tt.HasField("shape"):
            ranks[vi.name] = len(tt.shape.dim)
    for t in g.initializer:
        ranks[t.name] = len(t.dims)
    return ranks


def _new_ints(old: list[int], rank: int, rng: random.Random) -> list[int]:
    how = rng.choice(["out_of_range", "negative_out", "duplicate", "longer", "shorter", "shuffle"])
    new = list(old) or [0]
    if how == "out_of_range":
        new[rng.randrange(len(new))] = rank + rng.randrange(2)
    elif how == "negative_out":
        new[rng.randrange(len(new))] = -rank - 1 - rng.randrange(2)
    elif how == "duplicate" and len(new) >= 2:
        i, j = rng.sample(range(len(new)), 2)
        new[i] = new[j]
    elif how == "longer":
        new.append(rng.randrange(-rank, rank + 1))
    elif how == "shorter" and len(new) >= 2:
        new.pop(rng.randrange(len(new)))
    else:
        rng.shuffle(new)
    return new


def _new_int(old: int, rank: int, rng: random.Random) -> int:
    return rng.choice([rank, rank + 1, -rank - 1, 2, -1, 0, 1, old])


def mutate_attribute_value(model: onnx.ModelProto, rng: random.Random) -> str:
    """Change one rank-constrained attribute (an int or a list of ints, or a constant ``axes``
    input) to a value drawn against its input's rank: out of range, negative out of range, an
    entry twice, one entry more or less, or reordered. Returns what was changed."""
    g = model.graph
    ranks = _ranks(model)
    inits = {t.name: t for t in g.initializer}
    readers: dict[str, int] = {}
    for n in g.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    targets: list[tuple[onnx.NodeProto, str]] = []
    for n in g.node:
        targets += [
            (n, a.name)
            for a in n.attribute
            if a.name in RANK_ATTRIBUTES
            and a.type in (onnx.AttributeProto.INT, onnx.AttributeProto.INTS)
        ]
        if n.op_type in AXES_INPUT_OPS and len(n.input) > 1 and readers.get(n.input[1]) == 1:
            if n.input[1] in inits:
                targets.append((n, "axes input"))
        if n.op_type in WINDOWED:
            present = {a.name for a in n.attribute}
            targets += [(n, name) for name in ("strides", "dilations") if name not in present]
    if not targets:  # a Transpose of the input to work on
        x = g.input[0].name
        g.node.append(oh.make_node("Transpose", [x], ["x_t"], perm=[1, 0], name="x_transpose"))
        g.output.append(oh.make_tensor_value_info("x_t", T.FLOAT, None))
        targets = [(g.node[-1], "perm")]
    node, what = rng.choice(targets)
    rank = ranks.get(node.input[0], 2) if node.input else 2
    if what == "axes input":
        t = inits[node.input[1]]
        old = [int(v) for v in onh.to_array(t).reshape(-1)]
        new = _new_ints(old, rank, rng)
        t.CopyFrom(onh.from_array(np.array(new, dtype=np.int64), t.name))
        return f"{node.op_type} axes input {old} -> {new}"
    attr = next((a for a in node.attribute if a.name == what), None)
    if attr is None:  # strides or dilations, added with a wrong length or value
        new = _new_ints([1] * max(rank - 2, 1), rank, rng)
        node.attribute.append(oh.make_attribute(what, new))
        return f"{node.op_type} {what} added as {new}"
    if attr.type == onnx.AttributeProto.INTS:
        old = list(attr.ints)
        new = _new_ints(old, rank, rng)
        del attr.ints[:]
        attr.ints.extend(new)
        return f"{node.op_type} {what} {old} -> {new}"
    old_i = int(attr.i)
    attr.i = _new_int(old_i, rank, rng)
    return f"{node.op_type} {what} {old_i} -> {attr.i}"


# flags the ONNX spec defines as 0 or 1; onnxruntime takes any other value as 1 and onnx's
# own inference as 0, so a model with another value means two things and is not valid
FLAGS = ("keepdims", "select_last_index", "noop_with_empty_axes")


def runs_in_onnxruntime(model: onnx.ModelProto) -> bool:
    """Whether ``model`` is valid as the fuzz test judges the value mutations: its flags are 0
    or 1 and onnxruntime creates a session and runs it on ones (a symbolic dim as 2)."""
    import onnxruntime as ort

    for node in model.graph.node:
        for attr in node.attribute:
            if attr.name in FLAGS and attr.type == onnx.AttributeProto.INT and attr.i not in (0, 1):
                return False
    try:
        session = ort.InferenceSession(
            model.SerializeToString(), providers=["CPUExecutionProvider"]
        )
        feeds = {}
        for inp in session.get_inputs():
            shape = [d if isinstance(d, int) else 2 for d in inp.shape]
            feeds[inp.name] = np.ones(shape, dtype=np.float32)
        session.run(None, feeds)
    except Exception:
        return False
    return True
