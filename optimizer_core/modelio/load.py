"""Reading a model: parse, validate, infer types and shapes, and deserialize into ``onnx_ir``.

External weights stay memory-mapped (``onnx_ir`` maps them lazily), so a model with several GB
of weights is never read into memory whole. onnx's shape inference runs on the protobuf
without its weights; what it finds is applied to the IR directly.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from graphtrim import dtypes
from graphtrim.errors import InvalidModelError, first_line
from graphtrim.modelio.attributes import check_attributes
from graphtrim.modelio.external import _check_external_data, _external_tensors
from graphtrim.modelio.guards import _check_runtime_ops, _check_types, _sort_nodes

# set in ``model.meta`` when the loader ran onnx shape inference on the model
SHAPES_INFERRED = "graphtrim.shapes_inferred"


def unknown_dim(dim: object) -> bool:
    """A dim nobody could name, or one onnx's inference could only name ``unk__<n>`` (its name
    for every dim it could not compute: a later run may compute it)."""
    if isinstance(dim, int):
        return False
    name = getattr(dim, "value", dim)
    return not name or (isinstance(name, str) and name.startswith("unk__"))


def merged_shape(new: ir.Shape | None, old: ir.Shape | None) -> ir.Shape | None:
    """``old`` with the dims ``new`` knows and ``old`` does not (a size, or a real name where
    ``old`` has none or only an ``unk__`` one); ``None`` when ``new`` adds nothing. The dims
    ``old`` knows stay, whatever ``new`` says of them: names the exporter gave are kept."""
    if new is None:
        return None
    if old is None:
        return new
    if len(new) != len(old):
        return None  # conflicting ranks: trust what the value already carries
    dims: list[int | str | ir.SymbolicDim | None] = []
    better = False
    for n, o in zip(new.dims, old.dims, strict=True):
        if unknown_dim(o) and not unknown_dim(n):
            dims.append(n if isinstance(n, int) else getattr(n, "value", n))
            better = True
        else:
            dims.append(o if isinstance(o, int) else getattr(o, "value", o))
    return ir.Shape(dims) if better else None


def more_specific(new: ir.Shape | None, old: ir.Shape | None) -> bool:
    """Whether ``new`` knows a dim ``old`` does not (see :func:`merged_shape`)."""
    return merged_shape(new, old) is not None


def max_opset() -> int:
    return int(onnx.defs.onnx_opset_version())


def read_proto(path: str | os.PathLike[str]) -> onnx.ModelProto:
    """Parse and validate the model's protobuf without loading external data."""
    return _read_validated(path)[0]


@dataclasses.dataclass
class Validated:
    """A model file read and validated once: its protobuf (external data not loaded), the file's
    bytes and whether it has external data. :func:`load_model` takes it instead of reading the
    file again, and releases the bytes once it has inferred the shapes."""

    path: Path
    proto: onnx.ModelProto
    data: bytes
    external: bool


def read_validated(path: str | os.PathLike[str]) -> Validated:
    """:func:`read_proto` that keeps what :func:`load_model` needs, so a caller that looks at
    the protobuf before loading the model reads and checks the file once."""
    proto, data, external = _read_validated(path)
    return Validated(Path(path), proto, data, external)


def _read_validated(path: str | os.PathLike[str]) -> tuple[onnx.ModelProto, bytes, bool]:
    """The parsed and validated model, the file's bytes and whether it has external data.

    onnx's checker and shape inference work on serialized bytes; handing them the file's own
    bytes saves serializing the parsed model again (several times the cost of the check)."""
    p = Path(path)
    if not p.exists():
        raise InvalidModelError.at(p, "no such file")
    if not p.is_file():
        raise InvalidModelError.at(p, "not a regular file")
    if p.stat().st_size == 0:
        raise InvalidModelError.at(p, "empty file")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise InvalidModelError.at(p, f"cannot read the file: {exc.strerror or exc}") from exc
    try:
        proto = onnx.ModelProto.FromString(data)
    except (DecodeError, RuntimeError, ValueError, UnicodeDecodeError) as exc:
        raise InvalidModelError.at(p, f"not an ONNX model (protobuf parse failed: {exc})") from exc
    if proto.ir_version <= 0 or (not proto.graph.node and not proto.graph.output):
        raise InvalidModelError.at(p, "not an ONNX model (no IR version or empty graph)")
    # a model without a default-domain opset (only ai.onnx.ml, say) or older than the passes
    # support (graph.opset.MIN_OPSET) is valid: it is checked like any other and optimize writes
    # it out unchanged (graph.opset.passthrough_reason); one newer than this onnx is refused
    opsets = {o.domain or "": o.version for o in proto.opset_import}
    default = opsets.get("", opsets.get("ai.onnx"))
    if default is not None and not 1 <= default <= max_opset():
        raise InvalidModelError.at(
            p, f"unsupported opset {default}: graphtrim reads opsets 1 to {max_opset()}"
        )
    external = _check_external_data(proto, p)
    _check_types(proto, p)
    try:
        # with external data, check the file: the checker resolves data locations against the
        # model's folder only when it knows the path
        onnx.checker.check_model(str(p) if external else data)
    except onnx.checker.ValidationError as exc:
        first = first_line(exc)
        if "topologically sorted" in first and _sort_nodes(proto.graph):
            # onnxruntime runs nodes in any order that respects their inputs (onnxruntime's own
            # fp16 converter appends its input Casts last): read the nodes in such an order
            data = proto.SerializeToString()
            try:
                onnx.checker.check_model(str(p) if external else data)
                return proto, data, external
            except onnx.checker.ValidationError as again:
                exc = again
                first = first_line(exc)
        if "No Op registered for" in first:
            # an op onnxruntime defines is no fault: what the checker says without them is
            left = _check_runtime_ops(proto)
            if left is None:
                return proto, data, external
            first = left or first
        raise InvalidModelError.at(p, f"invalid model: onnx's checker refuses it: {first}") from exc
    return proto, data, external


# graph inputs and outputs whose type has a map in it (``ai.onnx.ml`` classifiers' ZipMap:
# ``seq(map(int64, float))``): onnx_ir cannot represent map types, so such a value is read with a
# stand-in type and its real type is written back on save (graph input/output name -> TypeProto)
MAP_TYPES = "graphtrim.map_types"


def _has_map(tp: onnx.TypeProto) -> bool:
    kind = tp.WhichOneof("value")
    if kind == "map_type":
        return True
    if kind == "sequence_type":
        return _has_map(tp.sequence_type.elem_type)
    if kind == "optional_type":
        return _has_map(tp.optional_type.elem_type)
    return False


def _stand_in(tp: onnx.TypeProto) -> onnx.TypeProto:
    """The same type with each map(K, V) replaced by V (a tensor type onnx_ir reads)."""
    kind = tp.WhichOneof("value")
    out = onnx.TypeProto()
    if kind == "map_type":
        out.CopyFrom(_stand_in(tp.map_type.value_type))
    elif kind == "sequence_type":
        out.sequence_type.elem_type.CopyFrom(_stand_in(tp.sequence_type.elem_type))
    elif kind == "optional_type":
        out.optional_type.elem_type.CopyFrom(_stand_in(tp.optional_type.elem_type))
    else:
        out.CopyFrom(tp)
    return out


def deserialize(proto: onnx.ModelProto) -> ir.Model:
    """``ir.serde.deserialize_model`` that also reads models with map-typed values: the main
    graph's map-typed inputs and outputs get a stand-in type (their real types are kept in
    ``model.meta[MAP_TYPES]`` and restored by :func:`save_model`), map-typed ``value_info``
    entries are dropped (they are hints; inference finds them again)."""
    graph = proto.graph
    saved: dict[str, onnx.TypeProto] = {}
    if any(_has_map(vi.type) for vi in (*graph.input, *graph.output, *graph.value_info)):
        proto = copy.copy(proto)  # shallow: the caller's proto is not changed
        proto.graph.CopyFrom(graph)
        for vi in (*proto.graph.input, *proto.graph.output):
            if _has_map(vi.type):
                saved[vi.name] = copy.deepcopy(vi.type)
                vi.type.CopyFrom(_stand_in(vi.type))
        kept = [vi for vi in proto.graph.value_info if not _has_map(vi.type)]
        del proto.graph.value_info[:]
        proto.graph.value_info.extend(kept)
    model = ir.serde.deserialize_model(proto)
    if saved:
        model.meta[MAP_TYPES] = saved
    return model


def restore_map_types(proto: onnx.ModelProto, saved: dict[str, onnx.TypeProto]) -> None:
    """Give the main graph's inputs and outputs back the map types :func:`deserialize` replaced."""
    for vi in (*proto.graph.input, *proto.graph.output):
        if vi.name in saved:
            vi.type.CopyFrom(saved[vi.name])


def load_model(path: str | os.PathLike[str], validated: Validated | None = None) -> ir.Model:
    """Load a validated model into ``onnx_ir``; external data stays memory-mapped.

    ``validated``: the file as :func:`read_validated` read it (then the file is not read again;
    its bytes are released here)."""
    if validated is not None and validated.path == Path(path) and validated.data:
        proto, data, external = validated.proto, validated.data, validated.external
        validated.data = b""
    else:
        proto, data, external = _read_validated(path)
    # inferring on the protobuf (weights not loaded) is far cheaper than on the IR later;
    # it is an aid only: custom ops and odd models load without it
    inferred: dict[str, onnx.TypeProto] = {}
    ran = False
    with contextlib.suppress(Exception):
        light = _without_weights(proto)
        result = onnx.shape_inference.infer_shapes(
            data if light is None else light.SerializeToString(),
            check_type=False,
            strict_mode=False,
            data_prop=True,
        )
        inferred = {vi.name: vi.type for vi in result.graph.value_info}
        ran = True
    del data
    model = deserialize(proto)
    _apply_inferred_types(model.graph, inferred)
    _apply_ml_types(model.graph)
    check_attributes(model, path)
    if ran and not _has_subgraphs(proto.graph):
        # what inference could not find now it will not find before a pass changes the graph
        model.meta[SHAPES_INFERRED] = True
    if external:
        ir.external_data.set_base_dir(model.graph, os.path.dirname(os.path.abspath(path)))
    return model


def _inference_reads(tensor: onnx.TensorProto) -> bool:
    """Whether onnx's inference may need this initializer's values: small ones, and integer
    ones up to 64 KiB (shapes, indices, axes). Weights only lend it their type."""
    size = dtypes.proto_nbytes(tensor.data_type, tensor.dims)
    if size is None:  # strings: by their count
        size = 8 * math.prod(tensor.dims)
    if size <= 1024:
        return True
    return tensor.data_type in _INTEGER_TYPES and size <= 64 * 1024


_INTEGER_TYPES = {
    onnx.TensorProto.INT8,
    onnx.TensorProto.UINT8,
    onnx.TensorProto.INT16,
    onnx.TensorProto.UINT16,
    onnx.TensorProto.INT32,
    onnx.TensorProto.UINT32,
    onnx.TensorProto.INT64,
    onnx.TensorProto.UINT64,
}


def _copy_fields(src: Any, dst: Any, skip: str) -> None:
    for field, value in src.ListFields():
        if field.name == skip:
            continue
        if field.is_repeated:
            getattr(dst, field.name).extend(value)
        elif field.message_type is not None:
            getattr(dst, field.name).CopyFrom(value)
        else:
            setattr(dst, field.name, value)


def _without_weights(proto: onnx.ModelProto) -> onnx.ModelProto | None:
    """``proto`` for onnx's inference without the bytes of its weights: each initializer that
    inference only needs the type of becomes a graph input of that type (the main graph's; a
    model of hundreds of MB is then not copied into inference and out again). ``None`` when
    there is none to leave out (or the model keeps sparse initializers)."""
    graph = proto.graph
    if graph.sparse_initializer or all(_inference_reads(t) for t in graph.initializer):
        return None
    light = onnx.ModelProto()
    _copy_fields(proto, light, skip="graph")
    _copy_fields(graph, light.graph, skip="initializer")
    inputs = {i.name for i in graph.input}
    for tensor in graph.initializer:
        if _inference_reads(tensor):
            light.graph.initializer.append(tensor)
        elif tensor.name not in inputs:
            light.graph.input.append(
                onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims)
            )
    return light


def _has_subgraphs(graph: onnx.GraphProto) -> bool:
    return any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
        for n in graph.node
        for a in n.attribute
    )


# ai.onnx.ml ops whose output type the spec fixes but onnx's inference does not report:
# op -> {output position: element type}
_ML_FLOAT = ir.DataType.FLOAT
ML_OUTPUT_TYPES: dict[str, dict[int, ir.DataType]] = {
    "Scaler": {0: _ML_FLOAT},
    "Normalizer": {0: _ML_FLOAT},
    "FeatureVectorizer": {0: _ML_FLOAT},
    "OneHotEncoder": {0: _ML_FLOAT},
    "LinearRegressor": {0: _ML_FLOAT},
    "SVMRegressor": {0: _ML_FLOAT},
    "TreeEnsembleRegressor": {0: _ML_FLOAT},
    "LinearClassifier": {1: _ML_FLOAT},
    "SVMClassifier": {1: _ML_FLOAT},
    "TreeEnsembleClassifier": {1: _ML_FLOAT},
}


def _apply_ml_types(graph: ir.Graph) -> None:
    """Give ``ai.onnx.ml`` outputs the element type their op's definition fixes, where nothing
    else gave them one (a Cast to float after a Scaler is then seen to be a no-op)."""
    for node in graph:
        if node.domain != "ai.onnx.ml":
            continue
        for pos, dtype in ML_OUTPUT_TYPES.get(node.op_type, {}).items():
            if pos < len(node.outputs) and node.outputs[pos].type is None:
                node.outputs[pos].type = ir.TensorType(dtype)


def _apply_inferred_types(graph: ir.Graph, inferred: dict[str, onnx.TypeProto]) -> None:
    """Give the main graph's node outputs their inferred tensor types, and shapes where the
    inferred shape says more than the declared one.

    Done directly on the IR rather than by deserializing ``value_info`` entries, which costs
    several times more per value; non-tensor types are left to later inference."""
    if not inferred:
        return
    for node in graph:
        for out in node.outputs:
            tp = inferred.get(out.name or "")
            if tp is None or tp.WhichOneof("value") != "tensor_type":
                continue
            tt = tp.tensor_type
            if not tt.elem_type:
                continue
            if out.type is None:
                out.type = ir.TensorType(ir.DataType(tt.elem_type))
            old = out.shape
            if not tt.HasField("shape") or (old is not None and old.is_static()):
                continue
            new = ir.Shape(
                [
                    d.dim_value
                    if d.HasField("dim_value")
                    else (d.dim_param if d.HasField("dim_param") else None)
                    for d in tt.shape.dim
                ]
            )
            merged = merged_shape(new, old)
            if merged is not None:
                out.shape = merged


def input_files(path: str | os.PathLike[str], proto: onnx.ModelProto | None = None) -> list[Path]:
    """The files the model at ``path`` reads: the model file and every external data file any
    tensor names, in any graph or subgraph and in ``Constant`` attributes."""
    p = Path(path)
    if proto is None:
        proto = read_proto(p)
    files = [p]
    for tensor in _external_tensors(proto):
        for entry in tensor.external_data:
            if entry.key == "location":
                f = p.parent / entry.value
                if f not in files:
                    files.append(f)
    return files
