"""External data: where a model's tensors say their bytes are, and whether that is safe.

A location must be relative, inside the model's folder once links are resolved, free of NUL and
control characters, name an existing file, and that file must hold the tensor's bytes at the
offset and length given (the length, where given, must match the tensor's shape and type).
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx
import onnx_ir as ir

from graphtrim import dtypes
from graphtrim.errors import GraphtrimError, InvalidModelError
from graphtrim.modelio.protos import all_graphs


def _external_tensors(proto: onnx.ModelProto):
    for g in all_graphs(proto.graph):
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
    base = _resolved(path.parent, path, InvalidModelError)
    found = False
    for tensor in _external_tensors(proto):
        found = True
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        if not location:
            raise InvalidModelError.at(
                path, f"tensor '{tensor.name}' has external data without a location"
            )
        if any(ord(c) < 32 for c in location):
            # a path with a NUL byte reaches no file (the OS refuses it); one with a newline
            # or another control character is no file name a model is saved with
            what = "a NUL byte" if "\x00" in location else "a control character"
            raise InvalidModelError.at(
                path,
                f"tensor '{tensor.name}' has {what} in its external data location {location!r}",
            )
        loc = Path(location)
        if loc.is_absolute() or ".." in loc.parts:
            raise InvalidModelError.at(
                path, f"tensor '{tensor.name}' points outside the model folder: '{location}'"
            )
        target = _resolved(base / loc, path, InvalidModelError)
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


def _tensor_nbytes(tensor: onnx.TensorProto) -> int | None:
    """The bytes the tensor's external data must hold (packed for sub-byte types); None for
    strings, which are not checked."""
    return dtypes.proto_nbytes(tensor.data_type, tensor.dims)


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


def has_external_data(model: ir.Model) -> bool:
    return any(
        isinstance(v.const_value, ir.ExternalTensor)
        for g in model.graphs()
        for v in g.initializers.values()
    )


def _resolved(path: Path, what: Path, error: type[GraphtrimError] = GraphtrimError) -> Path:
    """``path`` with its links resolved; a symlink loop (or a path the OS refuses) is an error
    naming ``what``, not a traceback."""
    try:
        return path.resolve()
    except (RuntimeError, OSError) as exc:  # RuntimeError: "Symlink loop from ..."
        named = f" (named by {what})" if what != path else ""
        raise error(f"cannot resolve {path}{named}: {exc}") from exc
