"""What a settings search records: its settings, each trial (the settings tried, the build,
the measurement, the verdict) and the result with its champion per kind."""

from __future__ import annotations

import dataclasses
from typing import Any

from graphtrim.errors import GraphtrimError
from graphtrim.tune.space import Candidate


def _line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


class TuneError(GraphtrimError):
    """A search that cannot start (unknown kinds, no candidate the model can take)."""


@dataclasses.dataclass
class TuneSettings:
    """How the search runs. Defaults fit a 2-core machine and models of a few MB."""

    budget_s: float = 600.0
    # None: the policy's (``tune.objective``, else latency)
    objective: str | None = None
    # balanced: speedup x (1 / size ratio) ** size_weight; None: the policy's (0.25)
    size_weight: float | None = None
    beam: int = 2  # candidates whose neighbourhoods each round explores
    max_rounds: int = 4
    finalists: int = 2
    screen_samples: int = 16  # samples the screening accuracy check reads (whole batches)
    screen_runs: int = 20
    screen_warmup: int = 5
    # a round that raises the best score by less than this (relative) has converged
    min_gain: float = 0.02

    def validate(self) -> None:
        from graphtrim.gates.policy import TUNE_OBJECTIVES

        if self.objective is not None and self.objective not in TUNE_OBJECTIVES:
            raise TuneError(
                f"unknown objective '{self.objective}': use {', '.join(TUNE_OBJECTIVES)}"
            )
        if not self.budget_s > 0:
            raise TuneError("the budget must be positive")
        for name in ("beam", "finalists", "screen_samples", "screen_runs"):
            if getattr(self, name) < 1:
                raise TuneError(f"{name} must be at least 1")
        if self.max_rounds < 0:
            raise TuneError("max_rounds must be at least 0 (0: the start points alone)")


@dataclasses.dataclass
class Trial:
    """One candidate, built and measured."""

    number: int
    candidate: Candidate
    round: int
    origin: str  # recipe | memory | neighbour of <key>
    status: str = "pending"  # built | failed | inaccurate | too-big | screened
    path: str | None = None
    build_s: float = 0.0
    bytes: int | None = None
    size_ratio: float | None = None
    accuracy_passed: bool | None = None
    accuracy: dict[str, Any] = dataclasses.field(default_factory=dict)
    excluded: list[str] = dataclasses.field(default_factory=list)
    # each timing of this candidate: (runs, p50 speedup over the reference, block spread)
    timings: list[tuple[int, float, float]] = dataclasses.field(default_factory=list)
    verdict: dict[str, Any] | None = None  # the finalists' gates
    error: str | None = None

    @property
    def feasible(self) -> bool:
        return self.status in ("built", "screened") and self.accuracy_passed is not False

    @property
    def speedup(self) -> float | None:
        return self.timings[-1][1] if self.timings else None

    def score(self, objective: str, size_weight: float = 0.25) -> float:
        """Higher is better; 0 for a candidate not measured. ``balanced``: speedup x
        (1 / size ratio) ** ``size_weight``."""
        speed = self.speedup
        size = self.size_ratio
        if objective == "size":
            return 1.0 / size if size else 0.0
        if speed is None:
            return 0.0
        if objective == "balanced" and size:
            return speed * (1.0 / size) ** size_weight
        return speed

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Trial:
        """The trial :meth:`to_json` wrote."""
        return cls(
            number=int(doc["number"]),
            candidate=Candidate.from_json(doc),
            round=int(doc["round"]),
            origin=str(doc["origin"]),
            status=str(doc["status"]),
            path=doc.get("path"),
            build_s=float(doc.get("build_s") or 0.0),
            bytes=doc.get("bytes"),
            size_ratio=doc.get("size_ratio"),
            accuracy_passed=doc.get("accuracy_passed"),
            accuracy=dict(doc.get("accuracy") or {}),
            excluded=[str(x) for x in doc.get("excluded") or []],
            timings=[
                (int(t["runs"]), float(t["speedup_p50"]), float(t["spread"]))
                for t in doc.get("timings") or []
            ],
            verdict=doc.get("verdict"),
            error=doc.get("error"),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "number": self.number,
            **self.candidate.to_json(),
            "round": self.round,
            "origin": self.origin,
            "status": self.status,
            "build_s": round(self.build_s, 3),
            "bytes": self.bytes,
            "size_ratio": self.size_ratio,
            "accuracy_passed": self.accuracy_passed,
            "accuracy": self.accuracy,
            "excluded": self.excluded,
            "timings": [
                {"runs": r, "speedup_p50": round(s, 4), "spread": round(p, 4)}
                for r, s, p in self.timings
            ],
            "verdict": self.verdict,
            "error": self.error,
        }


@dataclasses.dataclass
class TuneResult:
    """What a search did and found."""

    source: str
    device: str
    signature: str
    objective: str
    size_weight: float
    mode: str  # full | memory | memory, then full
    trials: list[Trial]
    champion: Trial | None
    output: str | None  # the champion's file
    stopped: str  # why the exploration ended
    seconds: float
    budget_s: float
    evaluation: dict[str, Any] | None
    remembered: dict[str, Any] | None  # the memory entry the search started from
    notes: list[str] = dataclasses.field(default_factory=list)

    def front(self) -> list[Trial]:
        """Feasible, timed trials no other beats on speed, size and accuracy at once."""
        pts = [t for t in self.trials if t.feasible and t.speedup is not None and t.size_ratio]

        def acc(t: Trial) -> float:
            cos = t.accuracy.get("cosine")
            return float(cos) if isinstance(cos, int | float) else 0.0

        def beats(a: Trial, b: Trial) -> bool:
            sa, sb = a.speedup or 0.0, b.speedup or 0.0
            za, zb = a.size_ratio or 1.0, b.size_ratio or 1.0
            ge = sa >= sb and za <= zb and acc(a) >= acc(b)
            return ge and (sa > sb or za < zb or acc(a) > acc(b))

        return [t for t in pts if not any(beats(o, t) for o in pts if o is not t)]

    def against_recipe(self) -> dict[str, Any] | None:
        """The champion against the fixed recipe judged beside it (the same timing run): the
        recipe, its verdict and the ratio of their p50 speedups."""
        judged = [t for t in self.trials if t.candidate.recipe and t.verdict is not None]
        recipe = max(judged, key=lambda t: t.score(self.objective, self.size_weight), default=None)
        if recipe is None or self.champion is None:
            return None
        ratio = None
        if self.champion.speedup and recipe.speedup:
            ratio = self.champion.speedup / recipe.speedup
        return {
            "recipe": recipe.candidate.key,
            "recipe_passed": bool(recipe.verdict and recipe.verdict.get("passed")),
            "recipe_speedup_p50": recipe.speedup,
            "champion_over_recipe": ratio,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "device": self.device,
            "signature": self.signature,
            "objective": self.objective,
            "size_weight": self.size_weight,
            "mode": self.mode,
            "stopped": self.stopped,
            "seconds": round(self.seconds, 2),
            "budget_s": self.budget_s,
            "champion": self.champion.to_json() if self.champion else None,
            "output": self.output,
            "front": [t.number for t in self.front()],
            "against_recipe": self.against_recipe(),
            "trials": [t.to_json() for t in self.trials],
            "remembered": self.remembered,
            "evaluation": self.evaluation,
            "notes": self.notes,
        }

    def memory_entry(self) -> dict[str, Any] | None:
        """What the memory keeps of the champion."""
        c = self.champion
        if c is None:
            return None
        return {
            **c.candidate.to_json(),
            "excluded": c.excluded,
            "speedup_p50": c.speedup,
            "size_ratio": c.size_ratio,
            "source": self.source,
        }
