"""Content digests of files: what the lineage, the config hash and the demo's registry lookup
compare, computed in one place so they always agree."""

from __future__ import annotations

import hashlib
import os


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The hex sha256 of the file at ``path``, read in 1 MiB blocks (models can be large)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
