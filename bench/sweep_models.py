"""Where a sweep's models come from besides the corpus: a folder of the user's own .onnx
files; the sizes of a model's symbolic dims."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def dim_values(path: Path, shapes: dict[str, list[int]] | None) -> dict[str, int]:
    """Sizes for the model's symbolic dims, read off the export's example shapes."""
    import onnx

    if not shapes:
        return {}
    model = onnx.load(str(path), load_external_data=False)
    dims: dict[str, int] = {}
    for inp in model.graph.input:
        shape = shapes.get(inp.name)
        if shape is None or not inp.type.HasField("tensor_type"):
            continue
        for d, size in zip(inp.type.tensor_type.shape.dim, shape, strict=False):
            if d.dim_param:
                dims.setdefault(d.dim_param, int(size))
    return dims


class FolderModels:
    """Every ``.onnx`` file under a folder, as corpus entries (``--models``): a user's own
    models swept against the anchors the way the corpus is. The family is the file's folder
    (relative to the root), the key its path; symbolic dims take ``--dim`` sizes, else 2."""

    def __init__(self, root: Path, dims: dict[str, int]) -> None:
        import hashlib

        import onnx

        self.root = root
        self.entries: list[dict[str, Any]] = []
        for path in sorted(root.rglob("*.onnx")):
            rel = path.relative_to(root)
            model = onnx.load(str(path), load_external_data=False)
            opset = {o.domain or "": o.version for o in model.opset_import}.get("")
            used = {
                d.dim_param
                for vi in model.graph.input
                for d in vi.type.tensor_type.shape.dim
                if d.dim_param in dims
            }
            self.entries.append(
                {
                    "key": re.sub(r"[^A-Za-z0-9_.-]+", "_", str(rel.with_suffix(""))),
                    "family": str(rel.parent) if str(rel.parent) != "." else root.name,
                    "exporter": "file",
                    "opset": opset,
                    "status": "ok",
                    "file": str(rel),
                    "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                    "dims": {d: dims[d] for d in sorted(used)},
                }
            )

    def ok(self) -> Iterator[dict[str, Any]]:
        yield from self.entries

    def model_path(self, entry: dict[str, Any]) -> Path:
        return self.root / entry["file"]
