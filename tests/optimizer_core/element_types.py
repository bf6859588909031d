"""Small valid models for every ONNX element type, for the element-type property test and the
fuzz test.

Every element type that onnx's helpers can write (``onnx.TensorProto.DataType`` but
``UNDEFINED``) gets models that carry it as a graph input, an initializer, a ``Constant`` and a
value flowing through the ops that accept it at the model's opset, as onnx's own op schemas say:
Identity, Concat, Reshape (a chain of two), Gather (twice, for CSE), Where, Transpose pairs,
Unsqueeze / Squeeze, Expand, Slice, Shape, a no-op Cast and a Cast to float and back where both
are legal, an If whose branches read the outer scope, and a Concat of constants only (for
constant folding). A type no op accepts (the 6-bit floats of onnx 1.23) still appears as an
initializer read by no node and as a graph output.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import onnx
import onnx.defs
import onnx.helper as oh
import onnx.numpy_helper as onh

T = onnx.TensorProto

# every element type onnx can write, by name
ELEMENT_TYPES: dict[str, int] = {
    name: value for name, value in T.DataType.items() if value != T.UNDEFINED
}

# the opset of the models of types every opset has; newer types get the first opset whose
# Identity accepts them
BASE_OPSET = 17
MAX_OPSET = onnx.defs.onnx_opset_version()


def _type_str(elem: int) -> str:
    return f"tensor({onnx.helper.tensor_dtype_to_string(elem).split('.')[-1].lower()})"


def accepts(op: str, opset: int, index: int, elem: int, *, output: bool = False) -> bool:
    """Whether ``op``'s schema at ``opset`` lets input (or output) ``index`` be a tensor of
    ``elem``."""
    try:
        schema = onnx.defs.get_schema(op, opset)
    except onnx.defs.SchemaError:
        return False
    formals = schema.outputs if output else schema.inputs
    if not formals:
        return False
    formal = formals[min(index, len(formals) - 1)]
    allowed = {formal.type_str}
    for constraint in schema.type_constraints:
        if constraint.type_param_str == formal.type_str:
            allowed = set(constraint.allowed_type_strs)
    return _type_str(elem) in allowed


def opset_for(elem: int) -> int:
    """The opset of ``elem``'s models: ``BASE_OPSET``, or the first one whose Identity takes it
    (``MAX_OPSET`` when none does)."""
    for opset in range(BASE_OPSET, MAX_OPSET + 1):
        if accepts("Identity", opset, 0, elem):
            return opset
    return MAX_OPSET


def values(elem: int, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Values of ``elem`` that every type represents exactly (small integers, numeric strings)."""
    rng = np.random.default_rng(seed)
    ints = rng.integers(0, 2, size=shape)
    if elem == T.STRING:
        return np.array([str(v).encode() for v in ints.reshape(-1)], dtype=object).reshape(shape)
    if elem == T.BOOL:
        return ints.astype(bool)
    if elem == T.FLOAT8E8M0:  # powers of two only: 1 and 2
        ints = ints + 1
    return ints.astype(oh.tensor_dtype_to_np_dtype(elem))


def _tensor(elem: int, shape: tuple[int, ...], name: str, seed: int) -> onnx.TensorProto:
    return onh.from_array(values(elem, shape, seed), name)


@dataclasses.dataclass
class TypedModel:
    """A model of one element type, and the ops it holds beside its plumbing."""

    name: str
    elem: int
    model: onnx.ModelProto
    constructs: list[str]

    @property
    def type_name(self) -> str:
        return onnx.helper.tensor_dtype_to_string(self.elem).split(".")[-1]


def _i64(name: str, vals: list[int]) -> onnx.TensorProto:
    return onh.from_array(np.array(vals, dtype=np.int64), name)


def _model(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    inits: list[onnx.TensorProto],
    opset: int,
) -> onnx.ModelProto:
    graph = oh.make_graph(nodes, "typed", inputs, outputs, inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    model.ir_version = min(model.ir_version, onnx.IR_VERSION)
    onnx.checker.check_model(model, full_check=True)
    return model


def concat_model(elem: int) -> TypedModel | None:
    """``Identity(xs) -> Concat(., S) -> Identity``: an input and an initializer of ``elem``."""
    opset = opset_for(elem)
    if not accepts("Concat", opset, 0, elem):
        return None
    nodes = [
        oh.make_node("Identity", ["xs"], ["a"], name="first"),
        oh.make_node("Concat", ["a", "S"], ["b"], axis=0, name="concat"),
        oh.make_node("Identity", ["b"], ["y"], name="last"),
    ]
    model = _model(
        nodes,
        [oh.make_tensor_value_info("xs", elem, [3])],
        [oh.make_tensor_value_info("y", elem, [5])],
        [_tensor(elem, (2,), "S", 1)],
        opset,
    )
    return TypedModel("concat", elem, model, ["Identity", "Concat"])


def combined_model(elem: int, only: set[str] | None = None, name: str = "combined") -> TypedModel:
    """Every construct the opset allows for ``elem`` in one graph, each to its own output
    (``only``: just these of them)."""
    opset = opset_for(elem)
    nodes: list[onnx.NodeProto] = []
    inits = [_tensor(elem, (2, 3), "S", 2)]
    outputs: list[onnx.ValueInfoProto] = []
    constructs: list[str] = []
    inputs = [
        oh.make_tensor_value_info("X", elem, [2, 3]),
        oh.make_tensor_value_info("C", T.BOOL, [2, 3]),
        oh.make_tensor_value_info("flag", T.BOOL, []),
    ]

    def node(op: str, ins: list[str], out: str, **attrs: object) -> str:
        nodes.append(oh.make_node(op, ins, [out], name=f"n_{out}", **attrs))
        return out

    def out(name: str, shape: list[int], of: int = elem) -> None:
        outputs.append(oh.make_tensor_value_info(name, of, shape))

    def add(construct: str, ok: bool, build: Callable[[], None]) -> None:
        if ok and (only is None or construct in only):
            build()
            constructs.append(construct)

    def ok(op: str, index: int = 0) -> bool:
        return accepts(op, opset, index, elem)

    has_identity = ok("Identity")
    x = node("Identity", ["X"], "x_id") if has_identity else "X"
    add("Identity", has_identity, lambda: out(node("Identity", [x], "identity_out"), [2, 3]))
    add(
        "Constant",
        ok("Concat"),
        lambda: (
            node("Constant", [], "K", value=_tensor(elem, (2, 3), "K", 3)),
            out(node("Concat", [x, "K"], "concat_k", axis=0), [4, 3]),
        ),
    )
    add(
        "Concat of constants",
        ok("Concat"),
        lambda: out(node("Concat", ["S", "S"], "folded", axis=1), [2, 6]),
    )

    def reshape() -> None:
        inits.extend([_i64("flat", [6]), _i64("back", [3, 2])])
        out(node("Reshape", [node("Reshape", [x, "flat"], "flat_out"), "back"], "reshaped"), [3, 2])

    add("Reshape", ok("Reshape"), reshape)

    def gather() -> None:
        inits.append(_i64("picks", [1, 0]))
        out(node("Gather", [x, "picks"], "gather_a", axis=0), [2, 3])
        out(node("Gather", [x, "picks"], "gather_b", axis=0), [2, 3])

    add("Gather", ok("Gather"), gather)
    add("Where", ok("Where", 1), lambda: out(node("Where", ["C", x, "S"], "where_out"), [2, 3]))
    add(
        "Transpose",
        ok("Transpose"),
        lambda: out(
            node("Transpose", [node("Transpose", [x], "t1", perm=[1, 0])], "t2", perm=[1, 0]),
            [2, 3],
        ),
    )

    def unsqueeze() -> None:
        inits.append(_i64("axis0", [0]))
        up = node("Unsqueeze", [x, "axis0"], "up")
        out(node("Squeeze", [up, "axis0"], "down"), [2, 3])

    add("Unsqueeze/Squeeze", ok("Unsqueeze") and ok("Squeeze"), unsqueeze)

    def expand() -> None:
        inits.append(_i64("same_shape", [2, 3]))
        out(node("Expand", [x, "same_shape"], "expanded"), [2, 3])

    add("Expand", ok("Expand"), expand)

    def slice_() -> None:
        inits.extend([_i64("s0", [0]), _i64("s1", [2]), _i64("sax", [1])])
        out(node("Slice", [x, "s0", "s1", "sax"], "sliced"), [2, 2])

    add("Slice", ok("Slice"), slice_)
    add("Shape", ok("Shape"), lambda: out(node("Shape", [x], "shape_out"), [2], T.INT64))
    can_cast = ok("Cast") and accepts("Cast", opset, 0, elem, output=True)
    add("Cast (no-op)", can_cast, lambda: out(node("Cast", [x], "same_cast", to=elem), [2, 3]))
    round_trip = (
        can_cast
        and elem not in (T.FLOAT, T.STRING)
        and accepts("Cast", opset, 0, T.FLOAT)
        and accepts("Cast", opset, 0, T.FLOAT, output=True)
    )
    add(
        "Cast to float and back",
        round_trip,
        lambda: out(
            node("Cast", [node("Cast", [x], "widened", to=T.FLOAT)], "narrowed", to=elem),
            [2, 3],
        ),
    )

    def if_() -> None:
        branches = []
        for label, src in (("then", x), ("else", "S")):
            b_out = f"{label}_out"
            branches.append(
                oh.make_graph(
                    [oh.make_node("Identity", [src], [b_out], name=f"n_{b_out}")],
                    label,
                    [],
                    [oh.make_tensor_value_info(b_out, elem, [2, 3])],
                )
            )
        nodes.append(
            oh.make_node(
                "If", ["flag"], ["if_out"], then_branch=branches[0], else_branch=branches[1]
            )
        )
        out("if_out", [2, 3])

    add("If", has_identity and accepts("If", opset, 0, elem, output=True), if_)
    if not outputs:
        # no op takes the type: it still is a graph input, an initializer and a graph output
        inits.append(_tensor(elem, (2, 3), "unused", 4))
        outputs.append(oh.make_tensor_value_info("S", elem, [2, 3]))
        constructs.append("initializer as output")
    used = {i for n in nodes for i in n.input} | {o.name for o in outputs}
    graph_inputs = [i for i in inputs if i.name in used or i.name == "X"]
    model = _model(nodes, graph_inputs, outputs, inits, opset)
    return TypedModel(name, elem, model, constructs)


def float_fed(typed: TypedModel) -> TypedModel | None:
    """``typed`` with its inputs of the element type fed as float and cast to it, and its
    outputs of the type cast back to float: onnxruntime's Python API cannot feed or return
    bfloat16, float8 or 4-bit arrays, but runs such a model. None where Cast cannot convert
    between float and the type."""
    elem, model = typed.elem, typed.model
    opset = model.opset_import[0].version
    legal = all(
        accepts("Cast", opset, 0, a) and accepts("Cast", opset, 0, b, output=True)
        for a, b in ((T.FLOAT, elem), (elem, T.FLOAT))
    )
    if elem in (T.FLOAT, T.STRING) or not legal:
        return None
    fed = onnx.ModelProto()
    fed.CopyFrom(model)
    graph = fed.graph
    casts_in, casts_out = [], []
    for vi in graph.input:
        if vi.type.tensor_type.elem_type == elem:
            inner = f"{vi.name}_as_float"
            casts_in.append(
                oh.make_node("Cast", [inner], [vi.name], to=elem, name=f"feed_{vi.name}")
            )
            vi.name = inner
            vi.type.tensor_type.elem_type = T.FLOAT
    for vi in graph.output:
        if vi.type.tensor_type.elem_type == elem:
            inner = f"{vi.name}_as_float"
            casts_out.append(
                oh.make_node("Cast", [vi.name], [inner], to=T.FLOAT, name=f"read_{vi.name}")
            )
            vi.name = inner
            vi.type.tensor_type.elem_type = T.FLOAT
    nodes = [*casts_in, *graph.node, *casts_out]
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.checker.check_model(fed, full_check=True)
    return TypedModel(f"{typed.name}-float-fed", elem, fed, typed.constructs)


def _runs(model: onnx.ModelProto) -> bool:
    import onnxruntime as ort

    try:
        session = ort.InferenceSession(
            model.SerializeToString(), providers=["CPUExecutionProvider"]
        )
        session.run(None, feeds(model))
    except Exception:
        return False
    return True


def runnable_model(elem: int) -> TypedModel | None:
    """The constructs of ``elem`` that onnxruntime's CPU provider has kernels for (each tried
    alone, fed as float where its Python API cannot feed the type), in one graph: the model
    whose results are compared. None when the combined model runs as it is, or nothing does."""
    full = combined_model(elem)
    if _runs(full.model):
        return None
    keep = set()
    for construct in full.constructs:
        alone = combined_model(elem, {construct})
        fed = float_fed(alone)
        if _runs(alone.model) or (fed is not None and _runs(fed.model)):
            keep.add(construct)
    if not keep:
        return None
    model = combined_model(elem, keep, "combined-runnable")
    if _runs(model.model):
        return model
    fed = float_fed(model)
    return fed if fed is not None and _runs(fed.model) else None


def models_for(elem: int) -> list[TypedModel]:
    """The models of ``elem``: every construct in one graph, the report's Concat (also fed and
    read as float where Cast allows), and the constructs onnxruntime runs."""
    concat = concat_model(elem)
    found = [combined_model(elem), concat, float_fed(concat) if concat else None]
    found.append(runnable_model(elem))
    return [m for m in found if m is not None]


def feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs for ``model``'s graph inputs, from :func:`values` (``flag`` and ``C`` vary)."""
    out: dict[str, np.ndarray] = {}
    for k, vi in enumerate(model.graph.input):
        tt = vi.type.tensor_type
        shape = tuple(d.dim_value for d in tt.shape.dim)
        out[vi.name] = values(tt.elem_type, shape, seed * 31 + k)
    return out
