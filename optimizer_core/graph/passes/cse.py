"""Common-subexpression elimination.

Two nodes with the same op, domain, attributes and the very same input values compute the same
outputs; the later one is replaced by the earlier. Identical initializers (same dtype, shape and
bytes) are merged first, so that nodes reading copies of a weight become identical too.
Non-deterministic ops, ops with subgraphs and ops of custom domains are never merged.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from typing import Any

import numpy as np
import onnx_ir as ir

from graphtrim import dtypes
from graphtrim.graph import _ir_utils as u
from graphtrim.graph.framework import GraphtrimPass, OptimizeOptions
from graphtrim.graph.rules import Rule


def _tensor_key(t: Any) -> Any:
    return ("T", int(t.dtype), tuple(t.shape.numpy()), t.tobytes())


# attributes whose values onnx_ir keeps as unhashable objects (a ``TypeAndShape`` such as
# ``Optional``'s ``type``, sparse tensors): keyed by their serialized form
_SERIALIZED_ATTRS = frozenset(
    {
        ir.AttributeType.TYPE_PROTO,
        ir.AttributeType.TYPE_PROTOS,
        ir.AttributeType.SPARSE_TENSOR,
        ir.AttributeType.SPARSE_TENSORS,
    }
)


def _serialized_key(attr: ir.Attr) -> Any:
    return ("S", ir.serde.serialize_attribute(attr).SerializeToString(deterministic=True))


def _attr_key(attr: ir.Attr) -> Any:
    if attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
        return None  # never reached: nodes with subgraphs are skipped
    if attr.type == ir.AttributeType.TENSOR:
        # attr.value, not as_tensor(): its protocol isinstance check dominates on large graphs
        return _tensor_key(attr.value)
    if attr.type == ir.AttributeType.TENSORS:
        return tuple(_tensor_key(t) for t in attr.value)
    if attr.type in _SERIALIZED_ATTRS:
        return _serialized_key(attr)
    value = attr.value
    key = tuple(value) if isinstance(value, list | tuple) else value
    try:
        hash(key)
    except TypeError:  # an attribute kind not listed above: compare what would be saved
        return _serialized_key(attr)
    return key


def _node_key(node: ir.Node) -> Any:
    attrs = tuple(sorted((name, int(a.type), _attr_key(a)) for name, a in node.attributes.items()))
    inputs = tuple(id(v) if v is not None else None for v in node.inputs)
    return (
        node.domain,
        node.op_type,
        node.overload,
        node.version,
        len(node.outputs),
        inputs,
        attrs,
    )


# whole-graph rules: initializers are grouped by type and bytes, nodes keyed by what they compute
RULES: tuple[Rule, ...] = (
    Rule(
        "duplicate-initializer",
        "initializer b -> initializer a when a and b have the same dtype, shape and bytes (not "
        "graph inputs or outputs, at most dedup_max_bytes)",
    ),
    Rule(
        "duplicate-node",
        "op(x..) twice -> once: a later node with the same op, domain, attributes and the very "
        "same inputs is replaced by the earlier (deterministic ops without subgraphs)",
    ),
    Rule("duplicate-constant", "Constant(t) twice -> once: duplicate-node for a Constant node"),
    Rule(
        "same-dim-read",
        "Gather(Shape(y), i) -> an earlier Gather(Shape(x), j) of the same form when x's dim j "
        "and y's dim i carry one name: one symbolic dim read once (the batch and sequence "
        "length read from input_ids and again from each layer's activations)",
    ),
)


def _dim_read(node: ir.Node) -> tuple[str, bool] | None:
    """``(dim name, scalar index)`` of ``Gather(Shape(x), i, axis=0)`` (a constant ``i``, no
    start/end on the Shape) when x's dim i is named; else ``None``."""
    if node.op_type != "Gather" or len(node.inputs) != 2 or node.attributes.get_int("axis", 0) != 0:
        return None
    shape_v, index_v = node.inputs
    shape = shape_v.producer() if shape_v is not None else None
    if shape is None or not u.is_op(shape, "Shape") or shape.attributes:
        return None
    index = u.const_ints(index_v)
    dims = u.symbolic_dims(shape.inputs[0])
    if index is None or len(index) != 1 or dims is None or index_v is None:
        return None
    i = index[0] + len(dims) if index[0] < 0 else index[0]
    if not 0 <= i < len(dims):
        return None
    dim = dims[i]
    if not isinstance(dim, str) or not dim:
        return None
    scalar = index_v.shape is not None and len(index_v.shape) == 0
    return dim, scalar


class CommonSubexpressionElimination(GraphtrimPass):
    name = "cse"
    summary = "merge identical initializers and nodes computing the same thing"
    rules = RULES

    def __init__(self, options: OptimizeOptions | None = None):
        super().__init__(options)
        # id(tensor) -> (tensor, digest); the tensor is kept so its id cannot be reused
        self._digests: dict[int, tuple[Any, bytes]] = {}
        self._samples: dict[int, tuple[Any, bytes]] = {}

    def apply(self, model: ir.Model) -> bool:
        changed = False
        for graph in u.all_graphs(model):
            changed |= self._dedup_initializers(graph)
            changed |= self._dedup_nodes(graph)
        return changed

    def _digest(self, tensor: Any) -> bytes:
        """Hash of a tensor's bytes, computed once per tensor for the whole run: weights are
        read again only when they really have to be compared."""
        cached = self._digests.get(id(tensor))
        if cached is not None and cached[0] is tensor:
            return cached[1]
        digest = hashlib.blake2b(tensor.tobytes(), digest_size=20).digest()
        self._digests[id(tensor)] = (tensor, digest)
        return digest

    def _dedup_initializers(self, graph: ir.Graph) -> bool:
        groups: dict[tuple[Any, ...], list[ir.Value]] = defaultdict(list)
        for value in graph.initializers.values():
            tensor = value.const_value
            if tensor is None or value.is_graph_input() or value.is_graph_output():
                continue
            if dtypes.tensor_nbytes(tensor) > self.options.dedup_max_bytes:
                continue
            groups[(int(tensor.dtype), tuple(tensor.shape.numpy()))].append(value)
        changed = False
        for same_type in groups.values():
            if len(same_type) < 2:
                continue
            # a few elements spread over the tensor first: weights of one shape nearly always
            # differ there, and hashing all of their bytes (a large model's every layer) is not
            # needed to tell them apart
            by_sample: dict[bytes, list[ir.Value]] = defaultdict(list)
            for value in same_type:
                assert value.const_value is not None
                by_sample[self._sample(value.const_value)].append(value)
            for members in by_sample.values():
                if len(members) >= 2:
                    changed |= self._merge_equal(members)
        return changed

    def _sample(self, tensor: Any) -> bytes:
        """Bytes of up to 64 elements at even strides through ``tensor`` (b"" where numpy cannot
        hold them: such tensors are told apart by their digest alone); once per tensor."""
        cached = self._samples.get(id(tensor))
        if cached is not None and cached[0] is tensor:
            return cached[1]
        try:
            flat = tensor.numpy().reshape(-1)
            if flat.size > 64:
                flat = flat[np.linspace(0, flat.size - 1, 64).astype(np.int64)]
            sample = bytes(flat.tobytes())
        except Exception:
            sample = b""
        self._samples[id(tensor)] = (tensor, sample)
        return sample

    def _merge_equal(self, members: list[ir.Value]) -> bool:
        """Point every use of a tensor in ``members`` equal to an earlier one at that one."""
        changed = False
        seen: dict[bytes, ir.Value] = {}
        for value in members:
            assert value.const_value is not None
            digest = self._digest(value.const_value)
            first = seen.get(digest)
            if first is None:
                seen[digest] = value
                continue
            assert first.const_value is not None
            # equal digests: compare the bytes themselves (a collision keeps both)
            if first.const_value.tobytes() != value.const_value.tobytes():
                continue
            value.replace_all_uses_with(first)
            self.hit("duplicate-initializer")
            changed = True
        return changed

    def _dedup_nodes(self, graph: ir.Graph) -> bool:
        seen: dict[Any, ir.Node] = {}
        reads: dict[tuple[str, bool], ir.Node] = {}
        changed = False
        for node in u.nodes_in_order(graph):
            if (
                not u.is_standard(node)
                or node.op_type in u.NONDETERMINISTIC_OPS
                or u.has_subgraph(node)
                or not node.outputs
            ):
                continue
            read = _dim_read(node)
            if read is not None:
                earlier = reads.setdefault(read, node)
                if earlier is not node and u.replace_value(node.outputs[0], earlier.outputs[0]):
                    self.hit("same-dim-read")
                    changed = True
                    continue
            try:
                key = _node_key(node)
                first = seen.get(key)  # hashes the key
            except Exception:  # a node whose attributes cannot be compared stays as it is
                continue
            if first is None:
                seen[key] = node
                continue
            replaced = all(
                u.replace_value(dup, orig)
                for dup, orig in zip(node.outputs, first.outputs, strict=True)
            )
            if replaced:
                self.hit("duplicate-node" if node.op_type != "Constant" else "duplicate-constant")
                changed = True
        return changed
