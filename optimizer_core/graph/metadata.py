"""Strip what exporters write for debugging and nothing computes with.

torch's ONNX exporter annotates every node with ``metadata_props`` (``namespace``,
``pkg.torch.onnx.stack_trace``, ``pkg.torch.onnx.class_hierarchy``, ...), and exporters may
write ``doc_string`` texts on nodes, values and graphs. On a small model that is a large share
of the file (61 KB of a 284 KB keyword-spotting model), which distorts size comparisons between
variants.

What goes, in the main graph, every subgraph (If/Loop/Scan bodies, any attribute graph) and
every function:

* every node's ``metadata_props`` and ``doc_string``;
* the ``doc_string`` of values (inputs, outputs, intermediate values, initializers), of graphs
  and of functions;
* keys under the ``pkg.`` namespace (package-specific annotations, such as
  ``pkg.torch.onnx.original_node_name``) in the ``metadata_props`` of values, graphs and
  functions; other keys there stay.

What stays: the model's own ``metadata_props`` (graphtrim writes ``graphtrim.*`` keys there and
users keep theirs) and ``doc_string``, and everything that takes part in computing: attributes,
names, types, shapes, weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, MutableMapping

import onnx_ir as ir

# protobuf field numbers (onnx.proto) of the removed fields, for the byte count
_NODE_DOC, _NODE_META = 6, 9
_GRAPH_DOC, _GRAPH_META = 10, 16
_VALUE_DOC, _VALUE_META = 3, 4
_FUNCTION_DOC, _FUNCTION_META = 8, 14

DEBUG_NAMESPACE = "pkg."


@dataclasses.dataclass(frozen=True)
class StrippedMetadata:
    """What :func:`strip_debug_metadata_stats` removed.

    ``items``: metadata entries plus doc strings removed. ``bytes``: their serialized size in
    the protobuf (tags, lengths and text; the length prefixes of the enclosing messages, which
    shrink too, are not counted), so the file shrinks by at least this much."""

    items: int = 0
    bytes: int = 0

    def __add__(self, other: StrippedMetadata) -> StrippedMetadata:
        return StrippedMetadata(self.items + other.items, self.bytes + other.bytes)

    def to_json(self) -> dict[str, int]:
        return {"items": self.items, "bytes": self.bytes}


def _varint_size(n: int) -> int:
    size = 1
    while n >= 0x80:
        n >>= 7
        size += 1
    return size


def _field_size(field: int, payload: int) -> int:
    """Bytes of a length-delimited field holding ``payload`` bytes."""
    return _varint_size(field << 3 | 2) + _varint_size(payload) + payload


def _entry_size(field: int, key: str, value: str) -> int:
    inner = _field_size(1, len(key.encode())) + _field_size(2, len(value.encode()))
    return _field_size(field, inner)


def _clear_doc(owner: ir.Node | ir.Value | ir.Graph | ir.Function, field: int) -> StrippedMetadata:
    doc = owner.doc_string
    if not doc:
        return StrippedMetadata()
    owner.doc_string = None
    return StrippedMetadata(1, _field_size(field, len(doc.encode())))


def _clear_props(
    props: MutableMapping[str, str], field: int, *, only_debug: bool
) -> StrippedMetadata:
    keys = [k for k in props if not only_debug or k.startswith(DEBUG_NAMESPACE)]
    size = sum(_entry_size(field, k, props[k]) for k in keys)
    for k in keys:
        del props[k]
    return StrippedMetadata(len(keys), size)


def _subgraphs(node: ir.Node) -> Iterator[ir.Graph]:
    for attr in node.attributes.values():
        if attr.is_ref():
            continue
        if attr.type == ir.AttributeType.GRAPH:
            yield attr.as_graph()
        elif attr.type == ir.AttributeType.GRAPHS:
            yield from attr.as_graphs()


def _strip_value(value: ir.Value) -> StrippedMetadata:
    return _clear_doc(value, _VALUE_DOC) + _clear_props(
        value.metadata_props, _VALUE_META, only_debug=True
    )


def _strip_nodes(nodes: Iterable[ir.Node]) -> StrippedMetadata:
    total = StrippedMetadata()
    for node in nodes:
        total += _clear_doc(node, _NODE_DOC)
        total += _clear_props(node.metadata_props, _NODE_META, only_debug=False)
        for out in node.outputs:
            total += _strip_value(out)
        for sub in _subgraphs(node):
            total += _strip_graph(sub)
    return total


def _strip_graph(graph: ir.Graph) -> StrippedMetadata:
    total = _clear_doc(graph, _GRAPH_DOC)
    total += _clear_props(graph.metadata_props, _GRAPH_META, only_debug=True)
    for value in [*graph.inputs, *graph.initializers.values()]:
        total += _strip_value(value)
    # graph outputs are node outputs (stripped with their node) or inputs/initializers
    return total + _strip_nodes(graph)


def strip_debug_metadata_stats(model: ir.Model) -> StrippedMetadata:
    """Remove exporter debug metadata from ``model`` in place; what was removed."""
    total = _strip_graph(model.graph)
    for function in model.functions.values():
        total += _clear_doc(function, _FUNCTION_DOC)
        total += _clear_props(function.metadata_props, _FUNCTION_META, only_debug=True)
        for value in function.inputs:
            total += _strip_value(value)
        total += _strip_nodes(function)
    return total


def strip_debug_metadata(model: ir.Model) -> int:
    """Remove exporter debug metadata from ``model`` in place; the number of items removed
    (metadata entries and doc strings). See the module's documentation for what goes."""
    return strip_debug_metadata_stats(model).items


# domains whose ops onnx's shape inference types by itself; a value made by an op of any
# other domain (onnxruntime's contrib ops included) keeps its annotation, since onnx's
# inference, which quantizers and converters run, cannot recover it
_INFERRED_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml"})


def _clear_annotation(value: ir.Value) -> int:
    if value.type is None and value.shape is None:
        return 0
    value.type = None
    value.shape = None
    return 1


def _strip_shapes(graph: ir.Graph | ir.Function) -> int:
    kept = {id(v) for v in [*graph.inputs, *graph.outputs]}
    removed = 0
    if isinstance(graph, ir.Graph):
        # an initializer's tensor carries its own type and shape
        for value in graph.initializers.values():
            if id(value) not in kept:
                removed += _clear_annotation(value)
    for node in graph:
        for sub in _subgraphs(node):
            removed += _strip_shapes(sub)
        if node.domain not in _INFERRED_DOMAINS:
            continue
        for value in node.outputs:
            if id(value) not in kept:
                removed += _clear_annotation(value)
    return removed


def strip_intermediate_shapes(model: ir.Model) -> int:
    """Remove the type and shape annotations (``value_info``) of intermediate values and
    initializers in ``model``, in place; the number of values cleared.

    Graph inputs and outputs (of the main graph, subgraphs and functions) keep theirs, and so
    does every value made by an op outside the standard domains. Runtimes and onnx's shape
    inference recover the rest; left in, the annotations steer onnxruntime's graph
    transformers, and over the bench corpus the outputs ran faster without them (docs/getting-started/cli.md)."""
    removed = _strip_shapes(model.graph)
    for function in model.functions.values():
        removed += _strip_shapes(function)
    return removed
