"""What a build records: its attempts, the variant it built, the runtime defects it avoided."""

from __future__ import annotations

import dataclasses
from typing import Any

from graphtrim.quantize.agreement import Agreement
from graphtrim.quantize.config import QuantizeConfig
from graphtrim.quantize.kinds import kind
from graphtrim.quantize.sensitivity import NodeError


@dataclasses.dataclass(frozen=True)
class RuntimeDefect:
    """A runtime bug a converted model can hit, and the form of the variant that avoids it.
    Tried in order when a candidate crashes its runtime at the default optimization level;
    the form is used only when it loads there (and then passes the usual checks)."""

    name: str
    runtime: str
    what: str
    keep_float: tuple[str, ...]  # fp16: op types computed in float32 instead
    form: str

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "keep_float": list(self.keep_float)}


RUNTIME_DEFECTS: dict[str, tuple[RuntimeDefect, ...]] = {
    "fp16": (
        RuntimeDefect(
            "ort-fp16-transpose-matmul",
            "onnxruntime 1.32 CPUExecutionProvider (ORT_ENABLE_ALL, ORT_ENABLE_LAYOUT)",
            "an fp16 Transpose(perm=[1,0,2]) read through a Cast by a float MatMul: "
            "MatmulTransposeFusion moves the Cast above the Transpose, then NchwcTransformer "
            "segfaults while the session is created",
            ("Transpose",),
            "with Transpose kept in float32",
        ),
    ),
}


@dataclasses.dataclass
class Attempt:
    number: int
    excluded: list[str]
    accuracy_passed: bool | None
    measured: dict[str, Any]
    most_sensitive: list[NodeError] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "excluded": list(self.excluded),
            "accuracy_passed": self.accuracy_passed,
            "measured": self.measured,
            "most_sensitive": [e.to_json() for e in self.most_sensitive],
        }


@dataclasses.dataclass
class VariantBuild:
    variant: str
    source: str
    output: str
    seconds: float
    config: QuantizeConfig
    attempts: list[Attempt]
    optimization: dict[str, Any]
    cleanup: dict[str, Any] | None
    # what tuning for ``config.tune_device`` measured and kept (None: not tuned)
    tuning: dict[str, Any] | None = None
    # known runtime defects the candidate hit, and the form that avoided each
    runtime_defects: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # how the built variant agrees with the float model (build_variant always measures it)
    agreement: Agreement | None = None
    # what the converter reports about the last attempt (weight-only: settings, form, counts)
    conversion: dict[str, Any] | None = None
    # why the fallback stopped before its last attempt (every convertible node in float)
    stopped: str | None = None

    @property
    def excluded(self) -> list[str]:
        return self.attempts[-1].excluded if self.attempts else []

    @property
    def accuracy_passed(self) -> bool | None:
        return self.attempts[-1].accuracy_passed if self.attempts else None

    def to_json(self) -> dict[str, Any]:
        return {
            "variant": self.variant,
            "source": self.source,
            "output": self.output,
            "seconds": round(self.seconds, 3),
            "config": self.config.to_json(),
            "config_hash": self.config.digest(),
            "excluded_nodes": self.excluded,
            "accuracy_passed": self.accuracy_passed,
            "attempts": [a.to_json() for a in self.attempts],
            "optimization": self.optimization,
            "cleanup": self.cleanup,
            "tuning": self.tuning,
            "runtime_defects": self.runtime_defects,
            "agreement": self.agreement.to_json() if self.agreement is not None else None,
            "conversion": self.conversion,
            "stopped": self.stopped,
            "advice": kind(self.variant).advice if self.accuracy_passed is False else None,
        }
