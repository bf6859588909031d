"""Loading and saving ONNX models safely.

``load_model`` rejects what cannot be optimized with a one-line ``InvalidModelError``: a missing
or empty file, bytes that are not an ONNX protobuf, a truncated file, external data that is
missing, too short or outside the model's folder, and opsets outside the supported range.
External weights stay memory-mapped (``onnx_ir`` maps them lazily), so a model with several GB
of weights is never read into memory whole.

``save_model`` writes to a temporary folder beside the target and moves the files into place only
when everything was written, so a failure never leaves a half-written model behind.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
from pathlib import Path

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from optimizer_core.errors import InvalidModelError
from optimizer_core.graph.shape_inference import SHAPES_INFERRED, more_specific

MIN_OPSET = 7
# protobuf refuses messages over 2 GiB; keep a margin for the graph itself
PROTO_LIMIT_BYTES = 1_800_000_000


def max_opset() -> int:
    return int(onnx.defs.onnx_opset_version())


def _external_tensors(proto: onnx.ModelProto):
    def graphs(g: onnx.GraphProto):
        yield g
        for node in g.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    yield from graphs(attr.g)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for sub in attr.graphs:
                        yield from graphs(sub)

    for g in graphs(proto.graph):
        for t in g.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                yield t
        for node in g.node:
            for attr in node.attribute:
                if (
                    attr.type == onnx.AttributeProto.TENSOR
                    and attr.t.data_location == onnx.TensorProto.EXTERNAL
                ):
                    yield attr.t


def _check_external_data(proto: onnx.ModelProto, path: Path) -> bool:
    """Refuse unsafe or inconsistent external data; True when the model has any."""
    base = path.parent.resolve()
    found = False
    for tensor in _external_tensors(proto):
        found = True
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        if not location:
            raise InvalidModelError.at(
                path, f"tensor '{tensor.name}' has external data without a location"
            )
        loc = Path(location)
        if loc.is_absolute() or ".." in loc.parts:
            raise InvalidModelError.at(
                path, f"tensor '{tensor.name}' points outside the model folder: '{location}'"
            )
        target = (base / loc).resolve()
        if os.path.commonpath([base, target]) != str(base):
            raise InvalidModelError.at(
                path,
                f"tensor '{tensor.name}' external data resolves outside the model folder: '{location}'",
            )
        if not target.is_file():
            raise InvalidModelError.at(
                path, f"external data file '{location}' of tensor '{tensor.name}' is missing"
            )
        offset = _external_int(info, "offset", tensor, path) or 0
        length = _external_int(info, "length", tensor, path)
        expected = _tensor_nbytes(tensor)
        if length is not None and expected is not None and length != expected:
            raise InvalidModelError.at(
                path,
                f"external data length {length} of tensor '{tensor.name}' does not match its "
                f"shape and type ({expected} bytes)",
            )
        needed = length if length is not None else expected
        size = target.stat().st_size
        if needed is not None and offset + needed > size:
            raise InvalidModelError.at(
                path,
                f"external data file '{location}' is too short for tensor '{tensor.name}' "
                f"(needs {offset + needed} bytes, has {size})",
            )
    return found


# bytes per element of the fixed-width types (sub-byte and string types are not checked)
_ITEMSIZE: dict[int, int] = {
    onnx.TensorProto.FLOAT: 4,
    onnx.TensorProto.DOUBLE: 8,
    onnx.TensorProto.FLOAT16: 2,
    onnx.TensorProto.BFLOAT16: 2,
    onnx.TensorProto.INT8: 1,
    onnx.TensorProto.INT16: 2,
    onnx.TensorProto.INT32: 4,
    onnx.TensorProto.INT64: 8,
    onnx.TensorProto.UINT8: 1,
    onnx.TensorProto.UINT16: 2,
    onnx.TensorProto.UINT32: 4,
    onnx.TensorProto.UINT64: 8,
    onnx.TensorProto.BOOL: 1,
    onnx.TensorProto.COMPLEX64: 8,
    onnx.TensorProto.COMPLEX128: 16,
}


def _tensor_nbytes(tensor: onnx.TensorProto) -> int | None:
    itemsize = _ITEMSIZE.get(tensor.data_type)
    if itemsize is None or any(d < 0 for d in tensor.dims):
        return None
    return math.prod(tensor.dims) * itemsize


def _external_int(
    info: dict[str, str], key: str, tensor: onnx.TensorProto, path: Path
) -> int | None:
    raw = info.get(key)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise InvalidModelError.at(
            path, f"tensor '{tensor.name}' has an invalid external data {key}: '{raw}'"
        )
    return value


def read_proto(path: str | os.PathLike[str]) -> onnx.ModelProto:
    """Parse and validate the model's protobuf without loading external data."""
    return _read_validated(path)[0]


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
    opsets = {o.domain or "": o.version for o in proto.opset_import}
    default = opsets.get("", opsets.get("ai.onnx"))
    if default is None:
        raise InvalidModelError.at(p, "the model imports no default-domain opset")
    if not MIN_OPSET <= default <= max_opset():
        raise InvalidModelError.at(
            p,
            f"unsupported opset {default}: graphtrim supports opsets {MIN_OPSET} to {max_opset()}",
        )
    external = _check_external_data(proto, p)
    try:
        # with external data, check the file: the checker resolves data locations against the
        # model's folder only when it knows the path
        onnx.checker.check_model(str(p) if external else data)
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidModelError.at(p, f"invalid model (possibly truncated): {first}") from exc
    return proto, data, external


def load_model(path: str | os.PathLike[str]) -> ir.Model:
    """Load a validated model into ``onnx_ir``; external data stays memory-mapped."""
    proto, data, external = _read_validated(path)
    # inferring on the protobuf (weights not loaded) is far cheaper than on the IR later;
    # it is an aid only: custom ops and odd models load without it
    inferred: dict[str, onnx.TypeProto] = {}
    ran = False
    with contextlib.suppress(Exception):
        result = onnx.shape_inference.infer_shapes(
            data, check_type=False, strict_mode=False, data_prop=True
        )
        inferred = {vi.name: vi.type for vi in result.graph.value_info}
        ran = True
    del data
    model = ir.serde.deserialize_model(proto)
    _apply_inferred_types(model.graph, inferred)
    if ran and not _has_subgraphs(proto.graph):
        # what inference could not find now it will not find before a pass changes the graph
        model.meta[SHAPES_INFERRED] = True
    if external:
        ir.external_data.set_base_dir(model.graph, os.path.dirname(os.path.abspath(path)))
    return model


def _has_subgraphs(graph: onnx.GraphProto) -> bool:
    return any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
        for n in graph.node
        for a in n.attribute
    )


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
            if more_specific(new, old):
                out.shape = new


def has_external_data(model: ir.Model) -> bool:
    return any(
        isinstance(v.const_value, ir.ExternalTensor)
        for g in model.graphs()
        for v in g.initializers.values()
    )


def initializer_bytes(model: ir.Model) -> int:
    return sum(
        int(v.const_value.nbytes)
        for g in model.graphs()
        for v in g.initializers.values()
        if v.const_value is not None
    )


def save_model(
    model: ir.Model, path: str | os.PathLike[str], *, external_data: bool | None = None
) -> list[Path]:
    """Write ``model`` atomically; returns the files written.

    With ``external_data=None`` weights go to ``<name>.data`` beside the model when the model
    had external data or would not fit into one protobuf.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if external_data is None:
        external_data = has_external_data(model) or initializer_bytes(model) > PROTO_LIMIT_BYTES
    data_name = f"{target.name}.data"
    tmpdir = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tmp_model = tmpdir / target.name
        if external_data:
            ir.save(model, tmp_model, external_data=data_name, size_threshold_bytes=1024)
        else:
            ir.save(model, tmp_model)
        written = [target]
        tmp_data = tmpdir / data_name
        if tmp_data.exists() and tmp_data.stat().st_size > 0:
            os.replace(tmp_data, target.parent / data_name)
            written.append(target.parent / data_name)
        else:
            # a data file left by an earlier save under this name no longer belongs to the model
            (target.parent / data_name).unlink(missing_ok=True)
        os.replace(tmp_model, target)
        return written
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


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


def _same_file(a: Path, b: Path) -> bool:
    """``a`` and ``b`` are one file: the same path after links are resolved, or the same inode
    (a hard link, another case of the name on a case-insensitive file system)."""
    if a.resolve() == b.resolve():
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def refuse_overwrite(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], proto: onnx.ModelProto | None = None
) -> None:
    """Refuse an output ``dst`` whose model file or data file (``<name>.data``) is, or aliases
    through a link or a case-insensitive name, any file the input model reads: writing it
    would destroy the input. Raises :class:`InvalidModelError` naming both."""
    inputs = input_files(src, proto)
    target = Path(dst)
    for out in (target, target.with_name(target.name + ".data")):
        for used in inputs:
            if _same_file(out, used):
                raise InvalidModelError(
                    f"output {out} would overwrite the input ({used}, read by {src}); "
                    "choose another output path"
                )


def publish_model(built: Path, target: Path) -> None:
    """Move a finished model file (and its ``.data`` file) over ``target``, data first; a data
    file ``target`` had that ``built`` does not need goes."""
    data = built.with_name(built.name + ".data")
    target_data = target.with_name(target.name + ".data")
    if data.exists():
        os.replace(data, target_data)
    else:
        target_data.unlink(missing_ok=True)
    os.replace(built, target)
