"""Writing a model atomically.

``save_model`` writes to a staging folder beside the target and moves the files into place
only when everything was written, so a failure never leaves a half-written model behind. Such
folders (:func:`staging_dir`) carry the host and process that made them: one left by a process
that was killed is removed by the next write beside the same output.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir

from graphtrim import dtypes
from graphtrim.errors import InvalidModelError
from graphtrim.modelio.external import _resolved, has_external_data
from graphtrim.modelio.load import MAP_TYPES, input_files, restore_map_types

# protobuf refuses messages over 2 GiB; keep a margin for the graph itself
PROTO_LIMIT_BYTES = 1_800_000_000


def initializer_bytes(model: ir.Model) -> int:
    return sum(
        dtypes.tensor_nbytes(v.const_value)
        for g in model.graphs()
        for v in g.initializers.values()
        if v.const_value is not None
    )


# a staging folder of a dead process is left alone this long after its last change: a
# process on another machine that shares the folder and the host name (a container
# started from the same image) may still be writing it
STALE_GRACE_SECONDS = 60.0
_STAGING = ".staging."


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64] or "host"


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a process id this module wrote: never someone else's to remove
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # it exists, under another user
    return True


def remove_stale_staging(target: str | os.PathLike[str]) -> list[Path]:
    """Remove the staging folders beside ``target`` that a process of this host left when it
    was killed: named for ``target`` (``.<name>.staging.<host>.<pid>.<random>``), made by a
    process that no longer exists, unchanged for :data:`STALE_GRACE_SECONDS`. Folders of live
    processes, of other hosts and of other outputs stay. Returns what was removed."""
    t = Path(target)
    prefix = f".{t.name}{_STAGING}"
    host = _host()
    removed: list[Path] = []
    try:
        entries = list(os.scandir(t.parent))
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        parts = entry.name[len(prefix) :].split(".")
        if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
            continue
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            if now - entry.stat(follow_symlinks=False).st_mtime < STALE_GRACE_SECONDS:
                continue
        except OSError:
            continue
        if _pid_alive(int(parts[1])):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        if not os.path.lexists(entry.path):
            removed.append(Path(entry.path))
    return removed


def staging_dir(target: str | os.PathLike[str]) -> Path:
    """A new hidden folder beside ``target`` to build it in, named
    ``.<name>.staging.<host>.<pid>.<random>``; stale ones a killed process left for the same
    ``target`` are removed first (:func:`remove_stale_staging`). The caller removes it."""
    t = Path(target)
    t.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(t)
    return Path(
        tempfile.mkdtemp(prefix=f".{t.name}{_STAGING}{_host()}.{os.getpid()}.", dir=t.parent)
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
    tmpdir = staging_dir(target)
    try:
        tmp_model = tmpdir / target.name
        if external_data:
            ir.save(model, tmp_model, external_data=data_name, size_threshold_bytes=1024)
        else:
            _save_inline(model, tmp_model)
        written = [target]
        tmp_data = tmpdir / data_name
        if tmp_data.exists() and tmp_data.stat().st_size > 0:
            os.replace(tmp_data, target.parent / data_name)
            written.append(target.parent / data_name)
        else:
            # a data file left by an earlier save under this name no longer belongs to the model
            (target.parent / data_name).unlink(missing_ok=True)
        if model.meta.get(MAP_TYPES):
            saved = onnx.load(str(tmp_model), load_external_data=False)
            restore_map_types(saved, model.meta[MAP_TYPES])
            onnx.save(saved, str(tmp_model))
        os.replace(tmp_model, target)
        return written
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


_STREAMED_BYTES = 64 * 1024  # initializers larger than this are written by _save_inline itself


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _len_field(number: int, length: int) -> bytes:
    """The key and length of a length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(length)


# protobuf field numbers (onnx.proto): ModelProto.graph, GraphProto.initializer,
# TensorProto.raw_data
_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_RAW_DATA = 7, 5, 9


def _save_inline(model: ir.Model, path: Path) -> None:
    """``model`` as one protobuf file, its large weights written straight from their buffers.

    Serializing a model of hundreds of MB through protobuf copies every weight twice and costs
    seconds; here the model is serialized without its large main-graph initializers and each
    of them is appended as a ``GraphProto.initializer`` field by hand (protobuf fields may come
    in any order, repeated ones are appended), its bytes written from the tensor's own
    buffer. Strings and tensors onnx_ir does not hold as raw bytes go the usual way."""
    graph = model.graph
    kept = list(graph.initializers.items())
    big = [
        v
        for _, v in kept
        if v.const_value is not None
        and v.const_value.dtype != ir.DataType.STRING
        and dtypes.tensor_nbytes(v.const_value) > _STREAMED_BYTES
        and not isinstance(v.const_value, ir.ExternalTensor)
    ]
    if not big:
        ir.save(model, path)
        return
    tensors = {id(v): v.const_value for v in big}
    for v in big:
        graph.initializers.pop(v.name or "")
    try:
        proto = ir.serde.serialize_model(model)
    finally:
        graph.initializers.clear()
        for _, v in kept:
            graph.initializers[v.name or ""] = v
    # the skeleton's initializers are there already; the large ones follow
    pieces: list[tuple[bytes, Any]] = []
    for v in big:
        tensor = tensors[id(v)]
        assert tensor is not None
        meta = onnx.TensorProto(
            name=v.name or "",
            dims=list(tensor.shape.numpy()),
            data_type=int(tensor.dtype),
        )
        if tensor.doc_string:
            meta.doc_string = tensor.doc_string
        for key, value in tensor.metadata_props.items():
            meta.metadata_props.add(key=key, value=value)
        raw = tensor.tobytes()
        head = meta.SerializeToString() + _len_field(_TENSOR_RAW_DATA, len(raw))
        pieces.append((head, raw))
    # the value infos serde gives initializers (their type and shape), as it would have
    inputs = {v.name for v in graph.inputs}
    for v in big:
        described = v.shape is not None or v.type is not None or v.metadata_props or v.doc_string
        if described and v.name not in inputs:
            proto.graph.value_info.append(ir.serde.serialize_value(v))
    graph_bytes = proto.graph.SerializeToString()
    proto.ClearField("graph")
    graph_len = len(graph_bytes) + sum(
        len(_len_field(_GRAPH_INITIALIZER, len(h) + len(r))) + len(h) + len(r) for h, r in pieces
    )
    with open(path, "wb") as f:
        f.write(proto.SerializeToString())
        f.write(_len_field(_MODEL_GRAPH, graph_len))
        f.write(graph_bytes)
        for head, raw in pieces:
            f.write(_len_field(_GRAPH_INITIALIZER, len(head) + len(raw)))
            f.write(head)
            f.write(raw)


def _same_file(a: Path, b: Path) -> bool:
    """``a`` and ``b`` are one file: the same path after links are resolved, or the same inode
    (a hard link, another case of the name on a case-insensitive file system)."""
    if _resolved(a, a) == _resolved(b, b):
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
