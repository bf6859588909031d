"""What onnx's checker lets through and graphtrim refuses at load, and the checker's own
blind spots that are no fault.

Refused: element types that name no ONNX type (a tensor's ``data_type``, a value's type,
``Cast(to=...)`` and the other type-valued attributes). Accepted although the checker complains:
ops onnxruntime defines in the default domain, and nodes listed out of topological order
(read in an order that respects their inputs).
"""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx_ir as ir

from graphtrim.errors import InvalidModelError, first_line

_DATA_TYPES = frozenset(
    int(v) for v in ir.DataType if int(v) in onnx.TensorProto.DataType.values()
) - {onnx.TensorProto.UNDEFINED}

# integer attributes that name an element type, by op (default domain); True: 0 means "not
# given" (the op picks the type), False: the value must name a type
_TYPE_ATTRIBUTES: dict[str, dict[str, bool]] = {
    "Cast": {"to": False},
    "EyeLike": {"dtype": False},
    "RandomNormal": {"dtype": False},
    "RandomUniform": {"dtype": False},
    "RandomNormalLike": {"dtype": False},
    "RandomUniformLike": {"dtype": False},
    "Multinomial": {"dtype": False},
    "Bernoulli": {"dtype": False},
    "QuantizeLinear": {"output_dtype": True},
    "DequantizeLinear": {"output_dtype": True},
}


def _graphs_with_functions(proto: onnx.ModelProto):
    """Every graph of the model (subgraphs included) and every function body, as
    ``(where, nodes, graph or None)``."""

    def graphs(g: onnx.GraphProto, where: str):
        yield where, g.node, g
        for node in g.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    yield from graphs(attr.g, f"subgraph '{attr.name}' of node '{node.name}'")
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for sub in attr.graphs:
                        yield from graphs(sub, f"subgraph '{attr.name}' of node '{node.name}'")

    yield from graphs(proto.graph, "")
    for fn in proto.functions:
        yield f"function '{fn.domain}:{fn.name}'", fn.node, None


def _type_elem_types(tp: onnx.TypeProto):
    """The element types a value type names (tensors inside sequences, maps and optionals)."""
    kind = tp.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        yield getattr(tp, kind).elem_type
    elif kind == "sequence_type":
        yield from _type_elem_types(tp.sequence_type.elem_type)
    elif kind == "optional_type":
        yield from _type_elem_types(tp.optional_type.elem_type)
    elif kind == "map_type":
        yield tp.map_type.key_type
        yield from _type_elem_types(tp.map_type.value_type)


def _check_types(proto: onnx.ModelProto, path: Path) -> None:
    """Refuse element types that name no ONNX type.

    onnx's checker accepts any integer in ``Cast(to=...)``, a tensor's ``data_type`` and the
    other type-valued attributes; deserializing such a tensor or running a pass that reads the
    type then fails deep inside (``-1 is not a valid DataType``), an internal error for what
    is a broken input. One walk over the nodes and tensors, no weights read."""

    def bad(value: int) -> bool:
        return value not in _DATA_TYPES

    def tensor(t: onnx.TensorProto, what: str) -> None:
        if bad(t.data_type):
            raise InvalidModelError.at(
                path, f"{what} has data type {t.data_type}, which is no ONNX element type"
            )

    for where, nodes, graph in _graphs_with_functions(proto):
        inside = f" (in {where})" if where else ""
        if graph is not None:
            for t in graph.initializer:
                tensor(t, f"initializer '{t.name}'{inside}")
            for sp in graph.sparse_initializer:
                tensor(sp.values, f"sparse initializer '{sp.values.name}'{inside}")
            for vi in [*graph.input, *graph.output, *graph.value_info]:
                for elem in _type_elem_types(vi.type):
                    # 0: the type is not known (yet); the checker judges where it must be
                    if elem and bad(elem):
                        raise InvalidModelError.at(
                            path,
                            f"value '{vi.name}'{inside} has element type {elem}, which is "
                            "no ONNX element type",
                        )
        for node in nodes:
            label = (
                f"{node.op_type} node '{node.name}'" if node.name else f"an unnamed {node.op_type}"
            ) + inside
            typed = _TYPE_ATTRIBUTES.get(node.op_type, {}) if node.domain in ("", "ai.onnx") else {}
            for attr in node.attribute:
                if attr.ref_attr_name:
                    continue  # in a function body: the value comes from the calling node
                if attr.type == onnx.AttributeProto.TENSOR:
                    tensor(attr.t, f"attribute '{attr.name}' of {label}")
                elif attr.type == onnx.AttributeProto.TENSORS:
                    for t in attr.tensors:
                        tensor(t, f"attribute '{attr.name}' of {label}")
                elif attr.type == onnx.AttributeProto.SPARSE_TENSOR:
                    tensor(attr.sparse_tensor.values, f"attribute '{attr.name}' of {label}")
                elif attr.name in typed and attr.type == onnx.AttributeProto.INT:
                    if attr.i == 0 and typed[attr.name]:
                        continue
                    if bad(attr.i):
                        raise InvalidModelError.at(
                            path,
                            f"attribute '{attr.name}' of {label} is {attr.i}, which is no ONNX "
                            "element type",
                        )


_RUNTIME_DOMAIN = "graphtrim.runtime-defined"


def _check_runtime_ops(proto: onnx.ModelProto) -> str | None:
    """onnx's checker on the model with the default-domain ops onnx does not define but
    onnxruntime does (``SimplifiedLayerNormalization``, as onnxruntime-genai's model builder
    and onnxruntime's transformer optimizer write it) left unchecked, as the checker leaves ops
    of other domains: None when it passes, else its first complaint ("" when there is no such
    op to leave out). An op that neither defines is still refused."""
    opsets = {o.domain or "": o.version for o in proto.opset_import}
    version = opsets.get("", opsets.get("ai.onnx"))
    if version is None:
        return ""
    runtime = runtime_defined_ops(version)
    moved = 0
    copy_ = onnx.ModelProto()
    copy_.CopyFrom(proto)  # data that is external stays out of the copy
    graphs = [copy_.graph]
    while graphs:
        graph = graphs.pop()
        for tensor in graph.initializer:
            _drop_external(tensor)  # checked already (_check_external_data); bytes lack a folder
        for node in graph.node:
            if node.domain in ("", "ai.onnx") and node.op_type in runtime:
                if not onnx.defs.has(node.op_type, ""):
                    node.domain = _RUNTIME_DOMAIN
                    moved += 1
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    _drop_external(attr.t)
                graphs.extend([attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs)
    if not moved:
        return ""
    copy_.opset_import.add(domain=_RUNTIME_DOMAIN, version=1)
    try:
        onnx.checker.check_model(copy_.SerializeToString())
    except onnx.checker.ValidationError as exc:
        return first_line(exc)
    return None


def _drop_external(tensor: onnx.TensorProto) -> None:
    """Make an external tensor a one-element inline one, for a check that has no folder."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return
    del tensor.external_data[:]
    del tensor.dims[:]
    tensor.data_location = onnx.TensorProto.DEFAULT
    tensor.raw_data = bytes(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize)


def runtime_defined_ops(version: int) -> frozenset[str]:
    """The default-domain ops onnxruntime defines at opset ``version`` (its schemas include
    ops onnx does not have, such as ``SimplifiedLayerNormalization``); empty without
    onnxruntime."""
    try:
        from onnxruntime.capi.onnxruntime_pybind11_state import get_all_operator_schema
    except ImportError:
        return frozenset()
    return frozenset(
        s.name
        for s in get_all_operator_schema()
        if s.domain in ("", "ai.onnx") and s.since_version <= version
    )


def _outer_names(graph: onnx.GraphProto) -> set[str]:
    """Names a subgraph reads from its enclosing scopes."""
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    read: set[str] = set()
    for node in graph.node:
        read.update(n for n in node.input if n)
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                read |= _outer_names(sub)
        defined.update(node.output)
    read.update(o.name for o in graph.output)
    return read - defined


def _sort_nodes(graph: onnx.GraphProto) -> bool:
    """Order the main graph's nodes so that each comes after the producers of what it reads
    (subgraphs' reads of outer values included); False when no such order exists (a cycle, or
    a value nothing produces)."""
    available = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    produced = {o for node in graph.node for o in node.output}
    needs: list[set[str]] = []
    for node in graph.node:
        wanted = set(node.input)
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                wanted |= _outer_names(sub) & produced
        needs.append(wanted - available)
    order: list[int] = []
    ready = [i for i, n in enumerate(needs) if not n]
    waiting = {i for i, n in enumerate(needs) if n}
    readers: dict[str, list[int]] = {}
    for i in waiting:
        for name in needs[i]:
            readers.setdefault(name, []).append(i)
    while ready:
        i = ready.pop(0)
        order.append(i)
        for out in graph.node[i].output:
            for j in readers.pop(out, []):
                needs[j].discard(out)
                if not needs[j] and j in waiting:
                    waiting.discard(j)
                    ready.append(j)
    if waiting:
        return False
    sorted_nodes = [onnx.NodeProto() for _ in order]
    for target, i in zip(sorted_nodes, order, strict=True):
        target.CopyFrom(graph.node[i])
    del graph.node[:]
    graph.node.extend(sorted_nodes)
    return True
