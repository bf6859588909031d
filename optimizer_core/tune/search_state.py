"""The orchestrated search between its steps (:mod:`graphtrim.tune.rounds`): each kind's trials
so far and why it stopped, and the whole search's state, which travels as JSON from one step's
task to the next."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from graphtrim.tune.records import Trial, TuneError, TuneSettings


@dataclasses.dataclass
class KindSearch:
    """One kind's search: its trials so far (each with ``uri``, its stored model, when
    feasible) and why it stopped (None while it goes on)."""

    kind: str
    mode: str  # full | memory | memory, then full
    remembered: dict[str, Any] | None
    trials: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    stopped: str | None = None
    best: float = 0.0  # the best score after the last round
    rounds: int = 0  # rounds of the full search taken
    notes: list[str] = dataclasses.field(default_factory=list)

    def loaded(self) -> list[Trial]:
        """The trials; a stored model (``uri``) stands for the model at hand."""
        out = []
        for doc in self.trials:
            trial = Trial.from_json(doc)
            trial.path = doc.get("path") or doc.get("uri")
            out.append(trial)
        return out


@dataclasses.dataclass
class SearchState:
    """The search between its steps."""

    signature: str
    settings: dict[str, Any]  # TuneSettings, objective and size weight resolved
    started: float  # epoch seconds: the rounds run on different machines
    rounds_left: int  # trial layers the orchestrator has left
    kinds: dict[str, KindSearch]
    round: int = 0
    numbers: int = 0  # trials numbered so far
    ref_ms: float | None = None  # the reference's p50, as the trials measured it
    accuracy_s: float = 0.0  # the longest screening accuracy check
    trial_s: list[float] = dataclasses.field(default_factory=list)  # each trial's wall time
    ops: list[str] = dataclasses.field(default_factory=list)  # the model's ops
    calibration: bool = True  # whether calibration data was given (int8-static needs it)
    judge_runs: int = 650  # the gates' timed runs and warm-up, per model judged
    data_scale: float = 1.0  # the gates' data over the screening subset

    @property
    def done(self) -> bool:
        return all(k.stopped is not None for k in self.kinds.values())

    def tune_settings(self) -> TuneSettings:
        return TuneSettings(**self.settings)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> SearchState:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(doc) - fields
        if unknown:
            raise TuneError(f"not a search state: unknown keys {', '.join(sorted(unknown))}")
        kinds = {k: KindSearch(**v) for k, v in dict(doc["kinds"]).items()}
        return cls(**{**dict(doc), "kinds": kinds})
