"""Shape and type inference with onnx's inference, merged into the IR by value name.

Large initializers are hidden from the serialized copy (declared as typed graph inputs instead),
so inference never copies the weights; failures (custom ops, unusual models) leave the model as
it was. Only values whose shape or type is unknown or less specific are updated, which keeps
symbolic dims the exporter named.
"""

from __future__ import annotations

import logging

import onnx
import onnx_ir as ir

from graphtrim import dtypes
from graphtrim.graph import _ir_utils as u
from graphtrim.modelio import SHAPES_INFERRED, merged_shape, unknown_dim
from graphtrim.modelio.protos import all_graphs

logger = logging.getLogger("graphtrim.optimizer")

# ``SHAPES_INFERRED`` is set in ``model.meta`` by a loader that ran onnx's inference (data
# propagation on) on the whole model, weights included, and copied its results in

_INLINE_LIMIT = 1024  # initializers up to this many bytes travel (data propagation reads them)


def _serialize_without_weights(model: ir.Model) -> onnx.ModelProto:
    graph = model.graph
    hidden: list[tuple[ir.Value, ir.TensorProtocol]] = []
    added_inputs: list[ir.Value] = []
    try:
        for value in list(graph.initializers.values()):
            tensor = value.const_value
            if tensor is None or dtypes.tensor_nbytes(tensor) <= _INLINE_LIMIT:
                continue
            if value.shape is None:
                value.shape = ir.Shape(tensor.shape.numpy())
            if value.dtype is None:
                value.dtype = tensor.dtype
            hidden.append((value, tensor))
            graph.initializers.pop(value.name or "")
            value.const_value = None
            if not value.is_graph_input():
                graph.inputs.append(value)
                added_inputs.append(value)
        return ir.serde.serialize_model(model)
    finally:
        for value in added_inputs:
            graph.inputs.remove(value)
        for value, tensor in hidden:
            value.const_value = tensor
            graph.register_initializer(value)


def _forget_unknown_dims(graph: onnx.GraphProto) -> None:
    """Clear the ``unk__<n>`` names of dims in ``graph``'s value infos and outputs (subgraphs
    too): onnx's inference keeps a dim name a value already carries, so a name it gave when it
    could not compute the dim would hide what it can compute now."""
    for g in all_graphs(graph):
        for vi in (*g.value_info, *g.output):
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
                for d in vi.type.tensor_type.shape.dim:
                    if d.HasField("dim_param") and d.dim_param.startswith("unk__"):
                        d.ClearField("dim_param")


_RUN = "graphtrim.inference_run"  # in ``model.meta``: inference runs that named dims so far


def _name_unknown_dims_apart(types: dict[str, onnx.TypeProto], run: int) -> None:
    """Give the ``unk__<n>`` dims of one inference run names of that run alone
    (``unk__<run>_<n>``). Within a run, one name on two dims means inference proved them equal;
    across runs its counter starts again, and a value named in one run must not look equal to
    another named in a later one."""
    for tp in types.values():
        if tp.WhichOneof("value") != "tensor_type" or not tp.tensor_type.HasField("shape"):
            continue
        for d in tp.tensor_type.shape.dim:
            if d.HasField("dim_param") and d.dim_param.startswith("unk__"):
                d.dim_param = f"unk__{run}_{d.dim_param[5:]}"


def _collect_types(graph: onnx.GraphProto, out: dict[str, onnx.TypeProto]) -> None:
    for g in all_graphs(graph):
        for vi in (*g.value_info, *g.output):
            if vi.type.HasField("tensor_type") or vi.type.WhichOneof("value") is not None:
                out.setdefault(vi.name, vi.type)


def _reshape_ranks(model: ir.Model) -> bool:
    """Give a Reshape output that has no shape its rank: the length of its shape tensor, which
    inference knows where it cannot read the entries (a shape read from unnamed dims with a
    -1 among them defeats onnx's Reshape inference, and then every value downstream has no
    shape). Returns whether it set one."""
    learned = False
    for graph in u.all_graphs(model):
        for node in graph:
            if not u.is_op(node, "Reshape") or len(node.inputs) < 2:
                continue
            if node.outputs[0].shape is not None:
                continue
            target = node.inputs[1]
            n = u.dims(target) if target is not None else None
            if n is None or len(n) != 1 or n[0] is None:
                continue
            node.outputs[0].shape = ir.Shape([None] * n[0])
            learned = True
    return learned


def _adds(tp: onnx.TypeProto, old: ir.Shape | None) -> bool:
    """Whether the inferred tensor type ``tp`` may say more about the shape than ``old``: the
    test of ``more_specific`` on the protobuf itself, which saves deserializing every value's
    type when (as after most rewrites) inference finds nothing new. Non-tensor types: True."""
    if old is None or tp.WhichOneof("value") != "tensor_type":
        return True
    tt = tp.tensor_type
    if not tt.HasField("shape"):
        return False
    dims = tt.shape.dim
    if len(dims) != len(old):
        return False  # conflicting ranks: ``more_specific`` keeps the old shape
    for n, o in zip(dims, old.dims, strict=True):
        if not unknown_dim(o):
            continue
        if n.HasField("dim_value") or (
            n.HasField("dim_param") and not n.dim_param.startswith("unk__")
        ):
            return True
    return False


def unknown_shape_ids(model: ir.Model) -> set[int]:
    """Ids of node outputs with no type, no shape, or a dim nobody could compute."""
    out: set[int] = set()
    for graph in u.all_graphs(model):
        for node in graph:
            for value in node.outputs:
                if (
                    value.type is None
                    or value.shape is None
                    or any(unknown_dim(d) for d in value.shape.dims)
                ):
                    out.add(id(value))
    return out


class ShapeInference(ir.passes.InPlacePass):
    """Fills in unknown shapes and types; never counts as a change of the model, but says in
    ``learned`` whether its last call made some value's type or shape more specific.

    With ``only_if_unknown`` it runs only where some value lacks shape information (no shape,
    or a dim inference could not compute), and not on its first call when the loader has just
    run the same inference (``SHAPES_INFERRED``). The driver calls it after the model changed:
    a rewrite that replaced no value (a Pad fused into its Conv, a computed Reshape target made
    constant) can make shapes downstream computable.
    """

    def __init__(self, only_if_unknown: bool = False) -> None:
        super().__init__()
        self.only_if_unknown = only_if_unknown
        self.runs = 0
        self.learned = False
        self._first = True

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.learned = False
        first, self._first = self._first, False
        run = True
        if self.only_if_unknown:
            # not where the loader has just run it, nor where every shape is known
            run = not (first and model.meta.get(SHAPES_INFERRED)) and bool(unknown_shape_ids(model))
        if run:
            self.runs += 1
            self._infer(model)
        if _reshape_ranks(model):
            # once more, for the values after the Reshapes that now have a rank
            self.learned = True
            self.runs += 1
            self._infer(model)
        return ir.passes.PassResult(model, False)

    def _infer(self, model: ir.Model) -> None:
        try:
            proto = _serialize_without_weights(model)
            _forget_unknown_dims(proto.graph)
            inferred = onnx.shape_inference.infer_shapes(
                proto, check_type=False, strict_mode=False, data_prop=True
            )
        except Exception as exc:  # inference is an aid, never a requirement
            logger.debug("shape inference failed: %s", exc)
            return
        types: dict[str, onnx.TypeProto] = {}
        _collect_types(inferred.graph, types)
        run = int(model.meta.get(_RUN, 0)) + 1
        model.meta[_RUN] = run
        _name_unknown_dims_apart(types, run)
        for graph in u.all_graphs(model):
            for node in graph:
                for value in node.outputs:
                    tp = types.get(value.name or "")
                    if tp is None or (value.type is not None and not _adds(tp, value.shape)):
                        continue
                    try:
                        shape = ir.serde.deserialize_type_proto_for_shape(tp)
                        vtype = ir.serde.deserialize_type_proto_for_type(tp)
                    except Exception:
                        continue
                    if value.type is None and vtype is not None:
                        value.type = vtype
                        self.learned = True
                    merged = merged_shape(shape, value.shape)
                    if merged is not None:
                        value.shape = merged
                        self.learned = True
