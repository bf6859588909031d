"""Before/after statistics of a model and their rendering as a table or JSON."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx_ir as ir

from graphtrim import dtypes
from graphtrim.graph import _ir_utils as u


@dataclasses.dataclass
class ModelStats:
    nodes: int
    op_counts: dict[str, int]
    initializers: int
    initializer_bytes: int
    file_bytes: int | None = None

    @classmethod
    def of(cls, model: ir.Model, files: Sequence[Path] = ()) -> ModelStats:
        inits = [v for g in u.all_graphs(model) for v in g.initializers.values()]
        size = sum(dtypes.tensor_nbytes(v.const_value) for v in inits if v.const_value is not None)
        file_bytes = sum(p.stat().st_size for p in files if p.exists()) if files else None
        return cls(u.count_nodes(model), u.op_counts(model), len(inits), size, file_bytes)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def format_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def before_after_table(before: ModelStats, after: ModelStats, seconds: float | None = None) -> str:
    """A fixed-width table: nodes per op type, totals, size and time."""
    ops = sorted(set(before.op_counts) | set(after.op_counts))
    width = max([len(o) for o in ops] + [14])
    lines = [f"{'op type':<{width}}  {'before':>8}  {'after':>8}  {'change':>8}"]
    lines.append("-" * len(lines[0]))
    for op in ops:
        b, a = before.op_counts.get(op, 0), after.op_counts.get(op, 0)
        lines.append(
            f"{op:<{width}}  {b:>8}  {a:>8}  {a - b:>+8}"
            if a != b
            else f"{op:<{width}}  {b:>8}  {a:>8}  {'':>8}"
        )
    lines.append("-" * len(lines[0]))
    lines.append(
        f"{'nodes':<{width}}  {before.nodes:>8}  {after.nodes:>8}  {after.nodes - before.nodes:>+8}"
    )
    lines.append(
        f"{'initializers':<{width}}  {before.initializers:>8}  {after.initializers:>8}  {after.initializers - before.initializers:>+8}"
    )
    lines.append(
        f"{'weights':<{width}}  {format_bytes(before.initializer_bytes):>8}  {format_bytes(after.initializer_bytes):>8}"
    )
    if before.file_bytes is not None or after.file_bytes is not None:
        lines.append(
            f"{'file size':<{width}}  {format_bytes(before.file_bytes):>8}  {format_bytes(after.file_bytes):>8}"
        )
    if seconds is not None:
        lines.append(f"{'optimize time':<{width}}  {'':>8}  {seconds:>7.2f}s")
    return "\n".join(lines)
