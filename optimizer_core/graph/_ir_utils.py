"""Small helpers over ``onnx_ir`` shared by the passes.

Everything here reads the graph or performs one well-defined edit; no pass logic lives here.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import onnx_ir as ir

from graphtrim import dtypes

STANDARD_DOMAINS = frozenset({"", "ai.onnx"})

# Ops whose result is not a function of their inputs: never folded, merged or deduplicated.
NONDETERMINISTIC_OPS = frozenset(
    {
        "RandomNormal",
        "RandomNormalLike",
        "RandomUniform",
        "RandomUniformLike",
        "Multinomial",
        "Bernoulli",
    }
)


def is_standard(node: ir.Node) -> bool:
    return node.domain in STANDARD_DOMAINS


def is_op(node: ir.Node | None, *op_types: str) -> bool:
    return node is not None and node.domain in STANDARD_DOMAINS and node.op_type in op_types


def has_subgraph(node: ir.Node) -> bool:
    return any(
        attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
        for attr in node.attributes.values()
    )


def opset_version(model: ir.Model, domain: str = "") -> int:
    version = model.opset_imports.get(domain)
    if version is None and domain == "":
        version = model.opset_imports.get("ai.onnx")
    return int(version) if version is not None else 0


def node_opset(node: ir.Node, model: ir.Model) -> int:
    if node.version is not None:
        return int(node.version)
    return opset_version(model, "" if node.domain in STANDARD_DOMAINS else node.domain)


# ---------------------------------------------------------------- constants


def _constant_node_array(node: ir.Node) -> np.ndarray | None:
    attrs = node.attributes
    if "value" in attrs:
        tensor = attrs["value"].value
        return tensor.numpy()
    for key, dtype in (("value_float", np.float32), ("value_int", np.int64)):
        if key in attrs:
            return np.array(attrs[key].value, dtype=dtype)
    for key, dtype in (("value_floats", np.float32), ("value_ints", np.int64)):
        if key in attrs:
            return np.array(list(attrs[key].value), dtype=dtype)
    return None  # sparse_value and strings: not treated as constants


def is_overridable_input(value: ir.Value) -> bool:
    """An initializer also listed as a graph input can be fed at run time: not a constant."""
    return value.is_graph_input()


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """The value as a numpy array when it is a compile-time constant, else ``None``."""
    if value is None:
        return None
    if value.const_value is not None:
        if value.is_initializer() and is_overridable_input(value):
            return None
        try:
            return value.const_value.numpy()
        except Exception:  # unreadable or string tensors are not usable constants
            return None
    producer = value.producer()
    if producer is not None and is_op(producer, "Constant"):
        try:
            return _constant_node_array(producer)
        except Exception:
            return None
    return None


def is_constant(value: ir.Value | None) -> bool:
    if value is None:
        return False
    if value.const_value is not None:
        return not (value.is_initializer() and is_overridable_input(value))
    producer = value.producer()
    return (
        producer is not None
        and is_op(producer, "Constant")
        and (
            "value" in producer.attributes
            or any(
                k in producer.attributes
                for k in ("value_float", "value_int", "value_floats", "value_ints")
            )
        )
    )


def const_nbytes(value: ir.Value) -> int:
    # from the value's own shape and type when known: asking a lazily parsed tensor is slower
    if value.shape is not None and value.shape.is_static():
        size = dtypes.nbytes(value.dtype, value.shape.numpy())
        if size is not None:
            return size
    if value.const_value is not None:
        return dtypes.tensor_nbytes(value.const_value)
    arr = const_array(value)
    return 0 if arr is None else int(arr.nbytes)


def fill_of(value: ir.Value | None) -> tuple[list[int], np.ndarray] | None:
    """``(shape, element)`` of a ``ConstantOfShape`` fill with a constant shape; else ``None``."""
    producer = value.producer() if value is not None else None
    if producer is None or not is_op(producer, "ConstantOfShape") or not producer.inputs:
        return None
    shape = const_ints(producer.inputs[0])
    if shape is None or any(d < 0 for d in shape):
        return None
    attr = producer.attributes.get("value")
    element = attr.value.numpy().reshape(-1) if attr is not None else np.zeros(1, np.float32)
    if element.size != 1:
        return None
    return shape, element


def const_shape(value: ir.Value | None) -> tuple[int, ...] | None:
    """The shape of a constant ``value`` (an initializer, a Constant or a fill)."""
    arr = const_array(value)
    if arr is not None:
        return tuple(arr.shape)
    fill = fill_of(value)
    return tuple(fill[0]) if fill is not None else None


def is_all(value: ir.Value | None, scalar: float) -> bool:
    """True when ``value`` is a constant (a fill too) whose every element equals ``scalar``."""
    fill = fill_of(value)
    if fill is not None:
        shape, element = fill
        return math.prod(shape) > 0 and element.dtype != object and bool(element[0] == scalar)
    arr = const_array(value)
    if arr is None or arr.size == 0 or arr.dtype == object:
        return False
    if arr.size > 65536:
        return False
    return bool(np.all(arr == scalar))


def const_ints(value: ir.Value | None) -> list[int] | None:
    arr = const_array(value)
    if arr is None or arr.dtype.kind not in "iu":
        return None
    return [int(x) for x in arr.reshape(-1)]


def ints_given(node: ir.Node, name: str, index: int) -> list[int] | None:
    """The ints ``name`` of ``node``: its attribute (older opsets) or its constant input
    ``index`` (newer ones); [] when it has neither, None when the input is not constant."""
    if name in node.attributes:
        return list(node.attributes[name].as_ints())
    if len(node.inputs) > index and node.inputs[index] is not None:
        return const_ints(node.inputs[index])
    return []


# ---------------------------------------------------------------- shapes and types


def dims(value: ir.Value | None) -> list[int | None] | None:
    """The shape with symbolic or unknown dims as ``None``; ``None`` when the rank is unknown."""
    if value is None or value.shape is None:
        return None
    return [d if isinstance(d, int) else None for d in value.shape.dims]


def symbolic_dims(value: ir.Value | None) -> list[int | str | None] | None:
    """Like :func:`dims` but named symbolic dims are kept as their names."""
    if value is None or value.shape is None:
        return None
    out: list[int | str | None] = []
    for d in value.shape.dims:
        if isinstance(d, int):
            out.append(d)
        else:
            out.append(d.value if isinstance(d.value, str) else None)
    return out


def static_shape(value: ir.Value | None) -> tuple[int, ...] | None:
    d = dims(value)
    if d is None or any(x is None for x in d):
        return None
    return tuple(int(x) for x in d)  # type: ignore[arg-type]


# ops whose output has the shape of their first input
_SHAPE_KEEPING = frozenset(
    {"Relu", "LeakyRelu", "Sigmoid", "Tanh", "Erf", "Gelu", "Neg", "Abs", "Sqrt", "Exp", "Log",
     "Reciprocal", "Cast", "Identity", "Softmax", "LogSoftmax", "Dropout", "Clip", "HardSigmoid",
     "HardSwish", "Elu", "Selu", "Softplus", "Mish", "LayerNormalization", "RMSNormalization"}
)  # fmt: skip
_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum"})


def last_dim(value: ir.Value | None, depth: int = 0) -> int | None:
    """The static size of ``value``'s last dim where its shape is unknown but its producers tell
    (a MatMul by a constant weight, ops that keep or broadcast the shape); ``None`` if unknown.
    A known last dim also says the rank is at least 1."""
    if value is None or depth > 16:
        return None
    known = symbolic_dims(value)
    if known is not None:
        return known[-1] if known and isinstance(known[-1], int) else None
    node = value.producer()
    if node is None or not is_standard(node) or node.outputs[0] is not value:
        return None
    if node.op_type == "MatMul" and len(node.inputs) == 2:
        weight = dims(node.inputs[1])
        return weight[-1] if weight and len(weight) >= 2 and isinstance(weight[-1], int) else None
    if node.op_type in _SHAPE_KEEPING:
        return last_dim(node.inputs[0], depth + 1)
    if node.op_type in _ELEMENTWISE:
        # a valid broadcast makes the output's last dim the one operand dim that is not 1
        for operand in node.inputs:
            d = last_dim(operand, depth + 1)
            if d is not None and d != 1:
                return d
    return None


def rank(value: ir.Value | None) -> int | None:
    if value is None:
        return None
    if value.shape is not None:
        return len(value.shape)
    arr = const_array(value)
    return None if arr is None else arr.ndim


def is_tensor_value(value: ir.Value) -> bool:
    return value.type is None or isinstance(value.type, ir.TensorType)


# ---------------------------------------------------------------- editing


def replace_value(old: ir.Value, new: ir.Value) -> bool:
    """Make every user of ``old`` read ``new`` instead.

    When ``old`` is an output of its graph, ``new`` takes over its name so the model's
    interface is unchanged; if ``new`` cannot be renamed (it is a graph input, an
    initializer, another output, or lives in an outer scope) nothing is changed and
    ``False`` is returned.
    """
    if old is new:
        return False
    graph = old.graph
    if graph is not None and old.is_graph_output():
        if (
            new.is_graph_input()
            or new.is_graph_output()
            or new.is_initializer()
            or new.graph is not graph
            or new.producer() is None
        ):
            return False
        name = old.name
        # the old value keeps a (unique) name: its producer stays valid until dead code goes
        old.name = f"{name}__replaced_{id(old):x}"
        new.name = name
        if old.shape is not None:
            # the output keeps its declared dims (an inferred shape may name them differently);
            # only dims it leaves unknown are taken from ``new``
            if new.shape is None or len(new.shape) != len(old.shape):
                new.shape = old.shape
            else:
                new.shape = ir.Shape(
                    [
                        o if isinstance(o, int) or o.value is not None else n
                        for o, n in zip(old.shape.dims, new.shape.dims, strict=True)
                    ]
                )
        if new.type is None and old.type is not None:
            new.type = old.type
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        return True
    old.replace_all_uses_with(new)
    return True


def single_consumer(value: ir.Value) -> bool:
    """Used by exactly one node input and not a graph output."""
    return len(value.uses()) == 1 and not value.is_graph_output()


class NameGenerator:
    """Unique value and node names across every graph of a model (onnxruntime refuses a model
    with two nodes of one name when it loads it from a file)."""

    def __init__(self, model: ir.Model):
        self._used: set[str] = set()
        for graph in all_graphs(model):
            for v in graph.inputs:
                if v.name:
                    self._used.add(v.name)
            self._used.update(n for n in graph.initializers if n)
            for node in graph:
                if node.name:
                    self._used.add(node.name)
                for out in node.outputs:
                    if out.name:
                        self._used.add(out.name)
        self._counter = itertools.count()

    def __call__(self, hint: str) -> str:
        hint = hint or "gt"
        name = hint
        while name in self._used:
            name = f"{hint}__gt{next(self._counter)}"
        self._used.add(name)
        return name


def add_initializer(
    graph: ir.Graph, array: np.ndarray, name: str, like: ir.Value | None = None
) -> ir.Value:
    tensor = dtypes.tensor(array, name)
    value = ir.Value(
        name=name, const_value=tensor, shape=ir.Shape(array.shape), type=ir.TensorType(tensor.dtype)
    )
    if like is not None and like.metadata_props:
        value.metadata_props.update(like.metadata_props)
    graph.register_initializer(value)
    return value


_SUBGRAPH_OPS = frozenset({"If", "Loop", "Scan", "SequenceMap"})


def subgraphs_of(node: ir.Node) -> list[ir.Graph]:
    out: list[ir.Graph] = []
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            out.append(attr.as_graph())
        elif attr.type == ir.AttributeType.GRAPHS:
            out.extend(attr.as_graphs())
    return out


# ids of models known to contain no subgraph (see ``flat_model``)
_FLAT_MODELS: set[int] = set()


@contextlib.contextmanager
def flat_model(model: ir.Model) -> Iterator[None]:
    """While active, :func:`all_graphs` answers ``[model.graph]`` without walking, if the
    model has no subgraph on entry. Sound for the passes of graphtrim, which never create a
    control-flow node (they only move or remove existing ones)."""
    flat = len(all_graphs(model)) == 1
    if flat:
        _FLAT_MODELS.add(id(model))
    try:
        yield
    finally:
        _FLAT_MODELS.discard(id(model))


def all_graphs(model: ir.Model) -> list[ir.Graph]:
    """The main graph and every subgraph, outer graphs first (a snapshot, safe to edit).

    A plain walk: much cheaper than ``model.graphs()`` on large graphs, and passes call it often.
    """
    if id(model) in _FLAT_MODELS:
        return [model.graph]
    out: list[ir.Graph] = []
    pending = [model.graph]
    while pending:
        graph = pending.pop(0)
        out.append(graph)
        for node in graph:
            # standard ops carry subgraphs only in control flow; other domains may carry any
            if node.op_type in _SUBGRAPH_OPS or node.domain not in STANDARD_DOMAINS:
                pending.extend(subgraphs_of(node))
    return out


def standard_nodes(model: ir.Model) -> Iterator[tuple[ir.Graph, ir.Node]]:
    """(graph, node) for every standard-domain node of every graph, in order; a snapshot, so
    rewrites may edit the graph, and nodes removed or moved meanwhile are skipped."""
    for graph in all_graphs(model):
        for node in list(graph):
            if node.graph is graph and node.domain in STANDARD_DOMAINS:
                yield graph, node


def nodes_in_order(graph: ir.Graph) -> Iterator[ir.Node]:
    # a snapshot, so a pass may remove or insert nodes while it walks
    yield from list(graph)


def count_nodes(model: ir.Model) -> int:
    return sum(len(g) for g in all_graphs(model))


def op_counts(model: ir.Model) -> dict[str, int]:
    counts: dict[str, int] = {}
    for graph in model.graphs():
        for node in graph:
            key = (
                node.op_type
                if node.domain in STANDARD_DOMAINS
                else f"{node.domain}::{node.op_type}"
            )
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def _detach(node: ir.Node) -> None:
    """Stop ``node`` (and every node of its subgraphs) from counting as a user of its inputs."""
    for i in range(len(node.inputs)):
        if node.inputs[i] is not None:
            node.replace_input_with(i, None)
    for graph in subgraphs_of(node):
        for inner in graph:
            _detach(inner)


class _RemovalCounter:
    """Counts nodes removed through :func:`remove_nodes`, so the driver can report removed and
    added nodes per pass without walking the graph."""

    total = 0


def removed_so_far() -> int:
    return _RemovalCounter.total


def remove_nodes(graph: ir.Graph, nodes: Iterable[ir.Node]) -> int:
    """Remove nodes whose outputs are no longer used, releasing their inputs."""
    nodes = list(nodes)
    for node in nodes:
        _detach(node)
    if nodes:
        graph.remove(nodes, safe=False)
        _RemovalCounter.total += sum(_nested_count(n) for n in nodes)
    return len(nodes)


def _nested_count(node: ir.Node) -> int:
    """The node itself plus every node of its subgraphs."""
    return 1 + sum(_nested_count(inner) for g in subgraphs_of(node) for inner in g)


def perm_of(node: ir.Node, r: int | None) -> list[int] | None:
    """A Transpose's permutation: its ``perm``, or the reversed axes when it has none and the
    rank ``r`` is known. None when unknown, or when ``perm`` is no permutation of its length
    (or, with ``r`` known, not of ``r`` axes): a rule then declines."""
    attr = node.attributes.get_ints("perm", None)
    if attr is None:
        return None if r is None else list(reversed(range(r)))
    perm = [int(p) for p in attr]
    if sorted(perm) != list(range(len(perm))) or (r is not None and len(perm) != r):
        return None
    return perm


def normalize_axes(axes: Sequence[int], r: int) -> list[int] | None:
    out = []
    for a in axes:
        a = a + r if a < 0 else a
        if not 0 <= a < r:
            return None
        out.append(a)
    return out


def is_dead(node: ir.Node) -> bool:
    """No output is read or is a graph output (nodes without outputs are never dead)."""
    if not node.outputs:
        return False
    return all(not out.uses() and not out.is_graph_output() for out in node.outputs)


def sweep_dead(model: ir.Model) -> int:
    """Remove dead nodes, what only they read, and initializers nothing reads any more."""
    removed = 0
    for graph in all_graphs(model):
        for node in reversed(list(graph)):
            if node.graph is graph and is_dead(node):
                remove_nodes(graph, [node])
                removed += 1
        for name, init in list(graph.initializers.items()):
            if not init.uses() and not init.is_graph_output() and not init.is_graph_input():
                graph.initializers.pop(name)
    return removed
