"""The per-worker input cache: models and data a task fetched, kept by content hash (hard
links, read-only) so that the next task on the worker reads them without fetching again."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from graphtrim.integrations.entries import _SHA
from graphtrim.integrations.model_files import MODEL_FILE, ArtifactStoreError, sha256_files

CACHE_ENV = "GRAPHTRIM_INPUT_CACHE"  # the folder, or "off"

CACHE_SIZE_ENV = "GRAPHTRIM_INPUT_CACHE_GB"  # its size limit, 20 GB unless set


class InputCache:
    """A worker's copies of the inputs its tasks fetch (stored models, data files), each kept
    under its sha256: a content hash names the same bytes wherever they were read from, so a
    second task on this worker that needs them links them from here instead of fetching them
    again. A copy enters the cache whole (fetched into a folder of its own, checked against
    its hash, renamed into place) and is handed out as hard links (a copy across file
    systems), so evicting it never pulls a file from under a task. The least recently used
    copies go when the cache exceeds ``max_bytes``."""

    def __init__(self, root: str | os.PathLike[str], *, max_bytes: int = 20 << 30):
        self.root = Path(root).expanduser().resolve()
        self.max_bytes = max_bytes

    def __repr__(self) -> str:
        return f"InputCache({self.root})"

    @classmethod
    def from_env(cls, workdir: str | None = None) -> InputCache | None:
        """The cache ``GRAPHTRIM_INPUT_CACHE`` names (``off``: none); unset, a folder in the
        user's cache folder (``$XDG_CACHE_HOME/graphtrim/inputs``)."""
        where = os.environ.get(CACHE_ENV, "").strip()
        if where.lower() in ("off", "0", "false", "none"):
            return None
        if not where:
            base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
            where = str(Path(base) / "graphtrim" / "inputs")
        raw = os.environ.get(CACHE_SIZE_ENV, "").strip()
        try:
            size = float(raw) if raw else 20.0
        except ValueError:
            raise ArtifactStoreError(f"{CACHE_SIZE_ENV}={raw!r}: a number of GB") from None
        if size <= 0:
            raise ArtifactStoreError(f"{CACHE_SIZE_ENV}={raw!r}: a number of GB above 0")
        return cls(where, max_bytes=int(size * (1 << 30)))

    def model(
        self, uri: str, sha256: str, dest: str | os.PathLike[str], fetch: Callable[..., Path]
    ) -> Path:
        """The model entry at ``uri`` (content hash ``sha256``) in ``dest``, its model file
        returned; ``fetch(uri, folder)`` fetches it when this worker has no copy."""

        def get(folder: Path) -> None:
            path = fetch(uri, folder)
            names = [MODEL_FILE, *sorted(p.name for p in folder.iterdir() if p != path)]
            if sha256_files([folder / n for n in names], names) != sha256:
                raise ArtifactStoreError(f"{uri}: fetched files do not match sha256 {sha256}")

        entry = self._entry(sha256, get)
        out = Path(dest)
        out.mkdir(parents=True, exist_ok=True)
        for f in sorted(entry.iterdir()):
            _link(f, out / f.name)
        return out / MODEL_FILE

    def file(
        self, uri: str, sha256: str, dest: str | os.PathLike[str], fetch: Callable[..., Path]
    ) -> Path:
        """The single file at ``uri`` (sha256 ``sha256``) as ``dest``; ``fetch(uri, path)``
        fetches it when this worker has no copy."""
        from graphtrim.hashing import file_sha256

        def get(folder: Path) -> None:
            got = fetch(uri, folder / "file")
            if got != folder / "file":  # a local file used in place
                shutil.copyfile(got, folder / "file")
            if file_sha256(folder / "file") != sha256:
                raise ArtifactStoreError(f"{uri}: fetched file does not match sha256 {sha256}")

        entry = self._entry(sha256, get)
        out = Path(dest)
        out.parent.mkdir(parents=True, exist_ok=True)
        _link(entry / "file", out)
        return out

    def _entry(self, sha256: str, get: Callable[[Path], None]) -> Path:
        if not _SHA.fullmatch(sha256):
            raise ArtifactStoreError(f"not a sha256: {sha256!r}")
        entry = self.root / sha256
        if entry.is_dir():
            os.utime(entry)  # recently used
            return entry
        self.root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=self.root) as tmp:
            folder = Path(tmp) / "entry"
            folder.mkdir()
            get(folder)
            for f in folder.iterdir():  # shared by links: no task may write into them
                f.chmod(0o444)
            try:
                os.replace(folder, entry)
            except OSError:  # a concurrent task of this worker put the same bytes first
                if not entry.is_dir():
                    raise
        self._evict(keep=entry)
        return entry

    def _evict(self, keep: Path) -> None:
        entries = []
        for e in self.root.iterdir():
            if e == keep or not _SHA.fullmatch(e.name):
                continue
            try:
                size = sum(f.stat().st_size for f in e.iterdir())
                entries.append((e.stat().st_mtime, size, e))
            except OSError:
                continue
        total = sum(s for _, s, _ in entries) + sum(f.stat().st_size for f in keep.iterdir())
        for _, size, e in sorted(entries, key=lambda t: t[0]):
            if total <= self.max_bytes:
                break
            gone = self.root / f".evicted-{e.name}-{os.getpid()}-{time.monotonic_ns()}"
            try:
                os.replace(e, gone)
            except OSError:
                continue
            shutil.rmtree(gone, ignore_errors=True)
            total -= size


def _link(src: Path, dst: Path) -> None:
    """``dst`` as a hard link to ``src`` (a copy where the file systems differ)."""
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
