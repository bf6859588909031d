"""What a search reads off its inputs: the op types of a model, its size on disk, the first
batches of the data that hold a number of samples; and the clock of its budget."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


class _Clock:
    def __init__(self, budget_s: float) -> None:
        self.start = time.monotonic()
        self.deadline = self.start + budget_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.deadline - time.monotonic()


def _model_ops(path: Path) -> frozenset[str]:
    import onnx

    from graphtrim.tune.memory import op_histogram

    return frozenset(op for _, op in op_histogram(onnx.load(str(path), load_external_data=False)))


def _bytes(path: Path) -> int:
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)


def _subset(data: Any, samples: int) -> Any:
    """The first batches of ``data`` that hold ``samples`` samples (at least one batch)."""
    from graphtrim.data import EvalData

    batches, held = 0, 0
    for batch in data.batches:
        if held >= samples:
            break
        batches += 1
        held += len(next(iter(batch.values()))) if batch else 1
    if batches >= len(data):
        return data
    return EvalData(
        data.batches[:batches],
        data.labels[:batches] if data.labels is not None else None,
        f"{data.digest}:first{batches}",
        f"{data.source} (first {batches} batches)",
        data.tokens,
    )
