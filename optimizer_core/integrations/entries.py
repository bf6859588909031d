"""What every artifact store shares: a stored model entry (:class:`StoredModel`), the store
protocol, ``put_model`` over a backend's primitives (:class:`_EntryStore`), and the local
file-system backend (:class:`LocalStore`). The S3 backend and opening a store by URI are in
:mod:`graphtrim.integrations.artifacts`."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from graphtrim.errors import transient
from graphtrim.integrations.model_files import (
    MANIFEST,
    MODEL_FILE,
    ArtifactStoreError,
    _manifest,
    _normalized,
    _staged_names,
    model_files,
    sha256_files,
)

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


# the local disk, not the store: out of space, over the file size limit, over quota
DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def disk_full(what: str, exc: OSError) -> ArtifactStoreError:
    """One line for work on the store that the local disk stopped: what, the file and why.
    Worth a retry: space is freed, the next attempt goes through."""
    where = f" writing {exc.filename}" if exc.filename else ""
    return transient(ArtifactStoreError(f"{what}: local disk full{where} ({exc.strerror})"))


class MissingEntryError(ArtifactStoreError):
    """No complete model entry at the URI (never stored, half-written or deleted)."""


def safe_part(part: str) -> str:
    """``part`` (a model name, a version) as one safe component of a key or a path."""
    cleaned = _SAFE.sub("_", str(part)).strip("._") or "_"
    return cleaned[:200]


@dataclasses.dataclass(frozen=True)
class StoredModel:
    """Where a stored model lives and what it is."""

    uri: str  # the entry folder: file:///... or s3://bucket/key
    model_uri: str  # the model file within it
    sha256: str
    manifest: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"uri": self.uri, "model_uri": self.model_uri, "sha256": self.sha256}


class ArtifactStore(Protocol):
    def put_model(
        self,
        path: str | os.PathLike[str],
        *,
        model: str,
        version: str,
        stage: str,
        parents: Sequence[str] = (),
        config_hash: str | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> StoredModel: ...

    def fetch_model(self, uri: str, dest: str | os.PathLike[str]) -> Path: ...

    def put_file(self, path: str | os.PathLike[str], key: str) -> str: ...

    def delete(self, uri: str) -> bool: ...


class _EntryStore:
    """What both stores share: ``put_model`` over three primitives of the backend (where an
    entry goes, the entry if it is complete, writing a staged entry)."""

    def _scratch(self) -> contextlib.AbstractContextManager[Any]:
        """A folder (its path) removed when the context ends."""
        raise NotImplementedError

    def _locate(self, model: str, version: str, stage: str, sha: str) -> Any:
        raise NotImplementedError

    def _complete(self, where: Any) -> StoredModel | None:
        raise NotImplementedError

    def _write(self, where: Any, files: Sequence[Path], manifest: dict[str, Any]) -> StoredModel:
        raise NotImplementedError

    def put_model(
        self,
        path: str | os.PathLike[str],
        *,
        model: str,
        version: str,
        stage: str,
        parents: Sequence[str] = (),
        config_hash: str | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> StoredModel:
        """Store the model at ``path`` (with its external data) under its content hash; the
        same bytes stored again write nothing and return the entry already there."""
        with self._scratch() as tmp:
            try:
                src = _normalized(Path(path), Path(tmp))
            except OSError as exc:  # the copy of a model whose data is not model.onnx.data
                if exc.errno not in DISK_FULL:
                    raise
                where = f"staging {Path(path).name} for the store in {tmp}"
                raise disk_full(where, exc) from exc
            files = model_files(src)
            sha = sha256_files(files)
            where = self._locate(model, str(version), stage, sha)
            done = self._complete(where)
            if done is not None:
                return done
            manifest = _manifest(
                files,
                sha,
                model=model,
                version=version,
                stage=stage,
                parents=parents,
                config_hash=config_hash,
                extra=extra,
            )
            return self._write(where, files, manifest)


_SHA = re.compile(r"[0-9a-f]{64}")


class LocalStore(_EntryStore):
    """A directory on a local or mounted file system."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).expanduser().resolve()

    def __repr__(self) -> str:
        return f"LocalStore({self.root})"

    def _entry(self, model: str, version: str, stage: str, sha: str) -> Path:
        return self.root / safe_part(model) / safe_part(str(version)) / safe_part(stage) / sha

    def _scratch(self) -> tempfile.TemporaryDirectory[str]:
        self.root.mkdir(parents=True, exist_ok=True)
        return tempfile.TemporaryDirectory(prefix=".graphtrim-", dir=self.root)

    def _locate(self, model: str, version: str, stage: str, sha: str) -> Path:
        return self._entry(model, version, stage, sha)

    def _complete(self, where: Path) -> StoredModel | None:
        return self._stored(where) if (where / MANIFEST).is_file() else None

    def _write(self, where: Path, files: Sequence[Path], manifest: dict[str, Any]) -> StoredModel:
        staging = Path(tempfile.mkdtemp(prefix=".graphtrim-entry-", dir=self.root))
        try:
            for f, name in zip(files, _staged_names(files), strict=True):
                shutil.copyfile(f, staging / name)
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
            where.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.replace(staging, where)  # a folder appears whole or not at all
            except OSError:
                if not (where / MANIFEST).is_file():  # not a concurrent writer of the same bytes
                    shutil.rmtree(where, ignore_errors=True)
                    os.replace(staging, where)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return self._stored(where)

    def _stored(self, entry: Path) -> StoredModel:
        manifest = json.loads((entry / MANIFEST).read_text())
        return StoredModel(
            entry.as_uri(), (entry / MODEL_FILE).as_uri(), manifest["sha256"], manifest
        )

    def fetch_model(self, uri: str, dest: str | os.PathLike[str]) -> Path:
        entry = local_path(uri)
        if entry.name == MODEL_FILE:
            entry = entry.parent
        if not (entry / MANIFEST).is_file():
            raise MissingEntryError(f"{uri}: no complete model entry (manifest missing)")
        out = Path(dest)
        out.mkdir(parents=True, exist_ok=True)
        manifest = json.loads((entry / MANIFEST).read_text())
        for name in manifest["files"]:
            shutil.copyfile(entry / name, out / name)
        return out / MODEL_FILE

    def delete(self, uri: str) -> bool:
        """Remove the model entry at ``uri`` (its folder or its model file) from this store;
        False when there is none (deleting twice is not an error). The entry disappears whole
        (renamed away, then removed); anything that is not an entry of this store is refused."""
        entry = local_path(uri)
        if entry.name == MODEL_FILE:
            entry = entry.parent
        entry = entry.resolve()
        if not entry.is_relative_to(self.root) or not _SHA.fullmatch(entry.name):
            raise ArtifactStoreError(f"{uri}: not a model entry of {self!r}")
        if len(entry.relative_to(self.root).parts) != 4:
            raise ArtifactStoreError(f"{uri}: not a model entry of {self!r}")
        if not entry.exists():
            return False
        gone = self.root / f".graphtrim-deleted-{entry.name}-{os.getpid()}-{time.monotonic_ns()}"
        try:
            os.replace(entry, gone)
        except FileNotFoundError:  # a concurrent delete
            return False
        shutil.rmtree(gone, ignore_errors=True)
        return True

    def put_file(self, path: str | os.PathLike[str], key: str) -> str:
        target = self.root / key
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        shutil.copyfile(path, tmp)
        os.replace(tmp, target)
        return target.as_uri()


def local_path(uri: str) -> Path:
    """The local path of a folder or file given as a path or a ``file://`` URI."""
    if uri.startswith("file://"):
        from urllib.parse import unquote, urlparse

        return Path(unquote(urlparse(uri).path))
    return Path(uri)
