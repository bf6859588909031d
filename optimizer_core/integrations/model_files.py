"""A model's files as the artifact stores keep them: the model and the external data it
reads, their combined sha256, and the manifest written beside them."""

from __future__ import annotations

import datetime as dt
import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from graphtrim.errors import GraphtrimError

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
MANIFEST = "manifest.json"


class ArtifactStoreError(GraphtrimError):
    """The artifact store cannot be reached or refused an operation."""


def model_files(path: str | os.PathLike[str]) -> list[Path]:
    """The files of a model: the ``.onnx`` and the external data files it references."""
    import onnx

    p = Path(path)
    files = [p]
    proto = onnx.load(str(p), load_external_data=False)
    seen: set[str] = set()
    for t in _external_tensors(proto):
        loc = next((e.value for e in t.external_data if e.key == "location"), "")
        if loc and loc not in seen:
            seen.add(loc)
            target = (p.parent / loc).resolve()
            if Path(loc).is_absolute() or not target.is_relative_to(p.parent.resolve()):
                raise ArtifactStoreError(
                    f"{p}: external data location '{loc}' points outside the model's folder"
                )
            if not target.is_file():
                raise ArtifactStoreError(f"{p}: external data file '{loc}' is missing")
            files.append(p.parent / loc)
    return files


def _external_tensors(proto: Any) -> list[Any]:
    """Every tensor of the model stored outside it: initializers and tensor attributes, in
    the main graph, in subgraphs (If / Loop / Scan bodies) and in functions."""
    import onnx

    out: list[Any] = []

    def graph(g: Any) -> None:
        out.extend(g.initializer)
        out.extend(s.values for s in g.sparse_initializer)
        nodes(g.node)

    def nodes(ns: Any) -> None:
        for n in ns:
            for a in n.attribute:
                if a.HasField("t"):
                    out.append(a.t)
                out.extend(a.tensors)
                if a.HasField("g"):
                    graph(a.g)
                for sub in a.graphs:
                    graph(sub)

    graph(proto.graph)
    for f in proto.functions:
        nodes(f.node)
    return [t for t in out if t.data_location == onnx.TensorProto.EXTERNAL]


def sha256_files(files: Sequence[Path], names: Sequence[str] | None = None) -> str:
    """One digest over the files' names inside an entry and their bytes. The names default to
    the entry's (``model.onnx`` for the first file, the data files' own names), so the same
    model has the same digest whatever its file is called."""
    h = hashlib.sha256()
    for f, name in zip(files, names or _staged_names(files), strict=True):
        h.update(name.encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


def _manifest(
    files: Sequence[Path],
    sha: str,
    *,
    model: str,
    version: str,
    stage: str,
    parents: Sequence[str],
    config_hash: str | None,
    extra: Mapping[str, Any] | None,
) -> dict[str, Any]:
    names = _staged_names(files)
    return {
        "sha256": sha,
        "model": model,
        "version": str(version),
        "stage": stage,
        "files": {n: f.stat().st_size for n, f in zip(names, files, strict=True)},
        "parents": list(parents),
        "config_hash": config_hash,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        **dict(extra or {}),
    }


def _staged_names(files: Sequence[Path]) -> list[str]:
    """Names inside an entry: the model is always ``model.onnx``; data files keep their names,
    which the model references (a model whose data file is not ``model.onnx.data`` is
    rewritten by the caller before storing)."""
    return [MODEL_FILE if i == 0 else f.name for i, f in enumerate(files)]


def _normalized(path: Path, tmp: Path) -> Path:
    """``path`` itself when its external data (if any) is ``model.onnx.data``; else a copy in
    ``tmp`` saved that way, so the stored entry is self-consistent."""
    files = model_files(path)
    if len(files) == 1 or (len(files) == 2 and files[1] == path.parent / DATA_FILE):
        return path
    import onnx

    proto = onnx.load(str(path))
    out = tmp / MODEL_FILE
    onnx.save(proto, str(out), save_as_external_data=True, location=DATA_FILE)
    return out
