"""What a verification found: the tolerances, each output's comparison and the record of a whole
run, JSON-serializable for reports and registry tags."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Tolerance:
    rtol: float = 1e-4
    atol: float = 1e-5
    min_cosine: float = 0.9999


@dataclasses.dataclass
class OutputComparison:
    name: str
    ok: bool
    max_abs_diff: float
    max_rel_diff: float
    cosine: float | None
    reason: str = ""
    # how far onnxruntime's own graph optimizations move the reference's output (max abs), when
    # the tolerance alone failed it; accepted within NOISE_FACTOR of it
    input_noise: float | None = None


# a difference that rounding alone explains: no larger than this many times the reference's own
# movement under onnxruntime's graph optimizations. That movement is one sample of the rounding
# noise and varies itself: 2.68e8 and 3.69e8 on the dynamo and TorchScript exports of one
# random-initialized MobileOne (logits near 1e15), whose re-parameterized form differs from both
# by 4.03e8; a change of one BatchNormalization scale by 1e-4 of itself moves the test model
# of this rule 167 times its noise
NOISE_FACTOR = 2.0

# how the reason of a float output that failed on its values alone begins (see compare_outputs)
_NUMERIC_MISMATCH = "max abs diff"

EQUAL, MISMATCH, UNVERIFIABLE = "equal", "mismatch", "unverifiable"


@dataclasses.dataclass
class VerificationRecord:
    """Outcome of :func:`verify`; ``ok`` only when every output of every trial matched.

    ``unverifiable`` says nothing was compared because the reference cannot be run (``error``
    says why): not ``ok``, and not a difference either. ``shape_only`` maps each output computed
    from a random op to that op's type; those were compared by shape and dtype only.
    """

    ok: bool
    trials: int
    outputs: list[OutputComparison]
    tolerance: Tolerance
    input_shapes: dict[str, list[int]]
    error: str = ""
    unverifiable: bool = False
    shape_only: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def cannot_verify(cls, tolerance: Tolerance, reason: str) -> VerificationRecord:
        return cls(False, 0, [], tolerance, {}, error=reason, unverifiable=True)

    @property
    def status(self) -> str:
        if self.unverifiable:
            return UNVERIFIABLE
        return EQUAL if self.ok else MISMATCH

    @property
    def max_rel_diff(self) -> float:
        return max((o.max_rel_diff for o in self.outputs), default=0.0)

    @property
    def max_abs_diff(self) -> float:
        return max((o.max_abs_diff for o in self.outputs), default=0.0)

    def first_failure(self) -> OutputComparison | None:
        return next((o for o in self.outputs if not o.ok), None)

    def summary(self) -> str:
        if self.unverifiable:
            return f"cannot verify: {self.error}"
        if self.error:
            return f"MISMATCH: {self.error}"
        status = "equal" if self.ok else "MISMATCH"
        if self.ok and self.shape_only and len(self.shape_only) == len(self.outputs):
            status = "equal (shape and dtype only)"
        text = (
            f"{status} on {self.trials} input set(s): max abs diff {self.max_abs_diff:.3g}, "
            f"max rel diff {self.max_rel_diff:.3g} (rtol {self.tolerance.rtol:g}, atol {self.tolerance.atol:g})"
        )
        bad = self.first_failure()
        if bad is not None:
            text += f"; first mismatch: output '{bad.name}' ({bad.reason})"
        for o in self.outputs:
            if o.ok and o.input_noise is not None:
                text += (
                    f"; output '{o.name}' differs by {o.max_abs_diff:.3g}, within the input's "
                    f"own rounding noise (onnxruntime's graph optimizations move it by "
                    f"{o.input_noise:.3g}: the output is ill-conditioned)"
                )
        text += "".join(f"; {note}" for note in shape_only_notes(self.shape_only))
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "trials": self.trials,
            "max_abs_diff": _json_number(self.max_abs_diff),
            "max_rel_diff": _json_number(self.max_rel_diff),
            "tolerance": dataclasses.asdict(self.tolerance),
            "input_shapes": self.input_shapes,
            "outputs": [
                {k: _json_number(v) for k, v in dataclasses.asdict(o).items()} for o in self.outputs
            ],
            "error": self.error,
            "status": self.status,
            "shape_only": dict(self.shape_only),
        }


def _json_number(value: Any) -> Any:
    """JSON has no infinity or NaN: a difference that is not a number (a shape or dtype
    mismatch, NaN positions that differ) is written as null; the reason says why."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def shape_only_notes(shape_only: Mapping[str, str]) -> list[str]:
    return [
        f"output '{name}' depends on random op {op}: compared by shape and dtype only"
        for name, op in shape_only.items()
    ]
