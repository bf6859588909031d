"""``graphtrim tune``: measure settings instead of fixing a recipe, under a time budget.

The search, on a noisy machine:

1. **Start points.** The fixed recipe of every kind the model can take (what ``graphtrim
   variants`` builds), or, when the memory holds a champion for this graph signature and
   device, that champion alone (its nodes kept in float included).
2. **Screening.** Each candidate is built as ``graphtrim quantize`` builds it (the sensitivity
   fallback included), its accuracy gate checked on a subset of the data and its size gate on
   the file: those are hard constraints. The feasible ones are timed against the reference,
   interleaved, with a short run; the score is the policy's objective (p50 speedup, size, or a
   weighted product of both).
3. **Neighbourhoods.** The best feasible candidates (the beam) lead, with the nearest miss of
   each kind that has no feasible candidate yet; their neighbours (one knob changed,
   :mod:`graphtrim.tune.space`) are built and screened next, round after round, until a round
   improves nothing beyond ``min_gain``, nothing is left, or the budget runs out. A search from
   memory re-checks one neighbourhood only, in the knobs whose best value can change with the
   weights; when the remembered settings fail, the full search runs with what is left of the
   budget.
4. **Successive halving.** The feasible candidates are re-timed with twice the runs, the better
   half kept, until the finalists are left.
5. **Finalists** are judged by :func:`graphtrim.gates.evaluate` with the policy's full method
   and data. The champion is the best one that passes every gate: an undecided latency gate (a
   measurement inside the noise) does not pass, so nothing wins on noise; and where the best
   beats the incumbent judged beside it (the fixed recipe, or the remembered champion in a
   search from memory) by less than that run's noise (the blocks' spread, at least
   ``min_gain``), the incumbent stays.

The budget is checked before each build and each timing, with the finalists' judgement
estimated from what screening measured, so a search ends within the budget plus one trial.
Every trial is recorded: settings, build, accuracy, size, timings, verdict, and why it stopped.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from graphtrim.errors import GraphtrimError, PassFailure, VerificationError
from graphtrim.tune.space import DEVICE_KINDS, Candidate, check_kinds, neighbours, start_points

logger = logging.getLogger("graphtrim.tune")

ProgressFn = Callable[[str], None]


_REFERENCE = "\x00reference"  # the reference's session: a key no candidate takes


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


class _Search:
    def __init__(
        self,
        source: Path,
        work: Path,
        *,
        device: str,
        policy: Any,
        data: Any,
        calibration: Any,
        base: Any,
        settings: TuneSettings,
        clock: _Clock,
        say: ProgressFn,
        tensorrt: bool,
    ) -> None:
        from graphtrim.data import input_specs
        from graphtrim.gates.language import is_decoder
        from graphtrim.gates.policy import LatencyThresholds

        self.source, self.work = source, work
        self.device, self.policy, self.data = device, policy, data
        self.calibration, self.base, self.settings = calibration, base, settings
        self.clock, self.say, self.tensorrt = clock, say, tensorrt
        self.trials: dict[str, Trial] = {}
        self.screen_data = _subset(data, settings.screen_samples)
        self.ref_bytes = _bytes(source)
        self.lat = policy.for_variant("__defaults__").latency or LatencyThresholds()
        self.specs = input_specs(source)
        self.decoder = is_decoder(self.specs)
        self.ref_ms: float | None = None
        self.accuracy_s: float = 0.0  # the longest accuracy check seen, on the screening data
        self.notes: list[str] = []
        # what a challenger must beat by more than the noise: the remembered champion in a
        # search from memory (else the best fixed recipe)
        self.incumbent: Candidate | None = None

    # -- measuring ------------------------------------------------------------------------
    def feeds(self) -> dict[str, Any]:
        if self.decoder:
            from graphtrim.gates import language

            return language.step_feeds(self.specs, self.data.tokens, self.lat.decode_past)
        return dict(next(iter(self.data)))

    def build(
        self,
        candidate: Candidate,
        origin: str,
        round_: int,
        excluded: Sequence[str] = (),
        *,
        number: int | None = None,
    ) -> Trial:
        import dataclasses as dc

        from graphtrim.gates.accuracy import accuracy_check
        from graphtrim.quantize.build import QuantizeError, build_variant

        trial = Trial(number or len(self.trials) + 1, candidate, round_, origin)
        self.trials[candidate.key] = trial
        folder = self.work / f"trial{trial.number:03d}"
        # the name the champion is published under: its data file is named after it
        dst = folder / f"{self.source.stem}.tuned.onnx"
        cfg = dc.replace(
            self.base,
            **candidate.overrides(),
            nodes_to_exclude=sorted({*self.base.nodes_to_exclude, *excluded}),
        )
        self.say(f"trial {trial.number}: building {candidate.key} ({origin})")
        check = accuracy_check(
            self.source,
            self.screen_data,
            self.policy,
            candidate.kind,
            device=self.device,
            tensorrt=self.tensorrt,
        )
        t0 = time.perf_counter()

        def timed_check(path: Path) -> tuple[bool, dict[str, Any]]:
            c0 = time.perf_counter()
            out = check(path)
            self.accuracy_s = max(self.accuracy_s, time.perf_counter() - c0)
            return out

        try:
            build = build_variant(
                self.source,
                dst,
                candidate.kind,
                config=cfg,
                calibration=self.calibration.batches if self.calibration is not None else None,
                accuracy_check=timed_check,
            )
        except Exception as exc:  # this candidate cannot be built: the search goes on
            if not isinstance(exc, QuantizeError) or isinstance(
                exc, VerificationError | PassFailure
            ):
                # a pass that changed results, or an error no converter should raise
                logger.error("trial %d (%s): %s", trial.number, candidate.key, _line(exc))
            text = str(exc) if isinstance(exc, GraphtrimError) else _line(exc)
            trial.status, trial.error = "failed", " ".join(text.split())
            trial.build_s = time.perf_counter() - t0
            self.say(f"trial {trial.number}: not built: {trial.error}")
            shutil.rmtree(folder, ignore_errors=True)
            return trial
        trial.build_s = time.perf_counter() - t0
        trial.path = str(dst)
        trial.excluded = list(build.excluded)
        trial.accuracy_passed = build.accuracy_passed
        last = build.attempts[-1].measured if build.attempts else {}
        trial.accuracy = {k: v for k, v in last.items() if isinstance(v, int | float | str | list)}
        trial.bytes = _bytes(dst)
        trial.size_ratio = trial.bytes / self.ref_bytes if self.ref_bytes else None
        size = self.policy.for_variant(candidate.kind).size
        if build.accuracy_passed is False:
            trial.status = "inaccurate"
        elif size is not None and (
            (size.max_ratio is not None and not (trial.size_ratio or 0) <= size.max_ratio)
            or (size.max_bytes is not None and not trial.bytes <= size.max_bytes)
        ):
            trial.status = "too-big"
            trial.error = f"size ratio {trial.size_ratio:.3f} over the size gate"
        else:
            trial.status = "built"
        if not trial.feasible:
            shutil.rmtree(folder, ignore_errors=True)
            trial.path = None
        self.say(
            f"trial {trial.number}: {trial.status}, {trial.size_ratio or 0:.3f}x the size, "
            f"{len(trial.excluded)} node(s) in float, {trial.build_s:.1f} s"
        )
        return trial

    def time(self, trials: Sequence[Trial], runs: int) -> None:
        """Time ``trials`` against the reference, interleaved; append to their timings. A
        candidate that cannot be opened or run leaves the race (``failed``, with why)."""
        from graphtrim.gates.latency import measure_latency
        from graphtrim.runtime import open_session, providers_for

        if not trials:
            return
        providers = providers_for(self.device, tensorrt=self.tensorrt)

        def opened(path: str | Path) -> Any:
            return open_session(
                path, device=self.device, threads=self.lat.threads, providers=providers
            )

        sessions: dict[str, Any] = {_REFERENCE: opened(self.source)}
        racing: list[Trial] = []
        for t in trials:
            try:
                assert t.path is not None
                sessions[t.candidate.key] = opened(t.path)
                racing.append(t)
            except Exception as exc:
                t.status, t.error = "failed", f"cannot be opened: {_line(exc)}"
                self.say(f"trial {t.number}: {t.error}")
        if not racing:
            return
        try:
            run = measure_latency(
                sessions,
                self.feeds(),
                baseline=_REFERENCE,
                runs=runs,
                warmup=self.settings.screen_warmup,
                blocks=3 if runs >= 12 else 1,
            )
        except Exception as exc:  # which one failed is not said: each is tried alone
            if len(racing) == 1:
                racing[0].status, racing[0].error = "failed", f"timing failed: {_line(exc)}"
                self.say(f"trial {racing[0].number}: {racing[0].error}")
                return
            sessions.clear()
            for t in racing:
                self.time([t], runs)
            return
        finally:
            sessions.clear()
        self.ref_ms = run.stats[_REFERENCE].p50_ms
        for t in racing:
            t.timings.append((runs, run.speedup(t.candidate.key), run.spread(t.candidate.key)))
            t.status = "screened"

    # -- budget ---------------------------------------------------------------------------
    def final_cost(self, finalists: Sequence[Trial]) -> float:
        """Seconds the finalists' judgement is expected to take (generous)."""
        if self.ref_ms is None:
            return 0.0
        ms = self.ref_ms * (1 + sum(1.0 / max(t.speedup or 1.0, 0.05) for t in finalists))
        runs = self.lat.runs + self.lat.warmup
        scale = max(1.0, len(self.data) / max(1, len(self.screen_data)))
        return 1.5 * (runs * ms / 1000.0 + scale * self.accuracy_s * (len(finalists) + 1)) + 2.0

    def room_for(self, seconds: float, finalists: int) -> bool:
        pool = self.ranked()[:finalists]
        return self.clock.left() > seconds + self.final_cost(pool)

    def score(self, trial: Trial) -> float:
        assert self.settings.objective is not None and self.settings.size_weight is not None
        return trial.score(self.settings.objective, self.settings.size_weight)

    def ranked(self) -> list[Trial]:
        s = self.settings
        assert s.objective is not None and s.size_weight is not None
        return ranked(self.trials.values(), s.objective, s.size_weight)

    def typical_build_s(self) -> float:
        built = [t.build_s for t in self.trials.values() if t.build_s]
        return sorted(built)[len(built) // 2] if built else 0.0

    # -- the search -----------------------------------------------------------------------
    def explore(
        self,
        starts: Sequence[tuple[Candidate, str, list[str]]],
        rounds: int,
        *,
        weights_only: bool = False,
    ) -> str:
        """Screen ``starts``, then the beam's neighbourhoods for up to ``rounds`` rounds (in
        the knobs that depend on the weights only, with ``weights_only``); returns why it
        stopped. A kind none of whose candidates is feasible yet has the neighbourhood of its
        nearest miss explored too: another scale or calibration may bring it within its
        gates."""
        s = self.settings
        ops = _model_ops(self.source)
        queue = [(c, origin, ex) for c, origin, ex in starts if c.key not in self.trials]
        best_before = self.best_score()
        kinds_before = {t.candidate.kind for t in self.ranked()}
        for round_ in range(rounds + 1):
            built: list[Trial] = []
            for candidate, origin, excluded in queue:
                if candidate.key in self.trials:
                    continue
                if not self.room_for(self.typical_build_s(), s.finalists):
                    self.time([t for t in built if t.feasible], s.screen_runs)
                    return "budget"
                built.append(self.build(candidate, origin, round_, excluded))
            feasible = [t for t in built if t.feasible]
            if feasible:
                self.say(f"round {round_}: timing {len(feasible)} candidate(s)")
                self.time(feasible, s.screen_runs)
            best = self.best_score()
            if round_ == rounds:
                return "rounds"
            rescued = {t.candidate.kind for t in feasible} - kinds_before
            if round_ > 0 and best < best_before * (1 + s.min_gain) and not rescued:
                return "converged"
            best_before = max(best, best_before)
            kinds_before = {t.candidate.kind for t in self.ranked()}
            leaders = self.ranked()[: s.beam] + self.nearest_misses(kinds_before)
            queue = [
                (n, f"neighbour of {lead.candidate.key}", lead.excluded)
                for lead in leaders
                for n in neighbours(lead.candidate, ops, weights_only=weights_only)
                if n.key not in self.trials
            ]
            if not queue:
                return "exhausted"
        return "rounds"

    def nearest_misses(self, feasible_kinds: set[str]) -> list[Trial]:
        return nearest_misses(self.trials.values(), feasible_kinds)

    def best_score(self) -> float:
        ranked = self.ranked()
        return self.score(ranked[0]) if ranked else 0.0

    def halve(self) -> list[Trial]:
        """Successive halving over the feasible candidates: re-time the better half with
        twice the runs until the finalists are left; the best fixed recipe joins them."""
        s = self.settings
        pool = self.ranked()
        runs = s.screen_runs
        while len(pool) > s.finalists:
            pool = pool[: max(s.finalists, math.ceil(len(pool) / 2))]
            runs *= 2
            cost = runs * (self.ref_ms or 0) * (len(pool) + 1) / 1000.0
            if not self.room_for(cost, s.finalists):
                break
            self.say(f"halving: {len(pool)} candidate(s), {runs} runs each")
            self.time(pool, runs)
            pool = [t for t in self.ranked() if t in pool]
        final = pool[: s.finalists]
        # the best fixed recipe runs beside them: the judgement times the champion against it
        recipe = next((t for t in self.ranked() if t.candidate.recipe), None)
        if recipe is not None and recipe not in final:
            final.append(recipe)
        return final

    def decide(self) -> tuple[Trial | None, dict[str, Any] | None]:
        """Halve, judge the finalists; when none passes (a screening subset can pass where all
        the data fails), the next best candidates not judged yet, while the budget allows."""
        champion, evaluation = self.judge(self.halve())
        while champion is None:
            rest = [t for t in self.ranked() if t.verdict is None][: self.settings.finalists]
            if not rest or not self.room_for(0.0, len(rest)):
                break
            self.say("no finalist passed every gate: judging the next candidates")
            champion, evaluation = self.judge(rest)
        return champion, evaluation

    def judge(self, finalists: Sequence[Trial]) -> tuple[Trial | None, dict[str, Any] | None]:
        from graphtrim.gates.evaluate import evaluate

        if not finalists:
            return None, None
        self.say(f"judging {len(finalists)} finalist(s) with the full gates")
        evaluation = evaluate(
            self.source,
            {t.candidate.key: t.path for t in finalists if t.path},
            policy=self.policy,
            data=self.data,
            device=self.device,
            tensorrt=self.tensorrt,
            kinds={t.candidate.key: t.candidate.kind for t in finalists},
        )
        doc = evaluation.to_json()
        passed = []
        for t in finalists:
            v = evaluation.variant(t.candidate.key)
            gates = {g.gate: g.status for g in v.gates}
            lat = v.gate("latency")
            full = lat.measured.get("speedup_p50") if lat else None
            if isinstance(full, int | float):
                spread = lat.measured.get("spread") if lat else None
                t.timings.append((self.lat.runs, float(full), float(spread or 0.0)))
            t.verdict = {
                "passed": v.passed,
                "gates": gates,
                "reasons": [r for g in v.gates for r in g.reasons],
            }
            if v.passed:
                passed.append(t)
        if not passed:
            return None, doc
        assert self.settings.objective is not None
        champion, note = choose(
            passed,
            self.settings.objective,
            self.settings.min_gain,
            self.incumbent,
            size_weight=self.settings.size_weight or 0.0,
        )
        if note:
            self.notes.append(note)
        return champion, doc


def ranked(trials: Iterable[Trial], objective: str, size_weight: float) -> list[Trial]:
    """The feasible, timed trials with a model at hand, best first by ``objective``."""
    feasible = [t for t in trials if t.feasible and t.speedup is not None and t.path is not None]
    return sorted(feasible, key=lambda t: -t.score(objective, size_weight))


def nearest_misses(trials: Iterable[Trial], feasible_kinds: set[str]) -> list[Trial]:
    """Per kind with no feasible candidate, the built one closest to its gates: the smallest
    over the size gate, else the most accurate under the accuracy gate."""
    out = []
    missed = [
        t
        for t in trials
        if t.status in ("too-big", "inaccurate") and t.candidate.kind not in feasible_kinds
    ]

    def closeness(t: Trial) -> tuple[int, float]:
        if t.status == "too-big":
            return (0, t.size_ratio or float("inf"))
        cos = t.accuracy.get("cosine")
        return (1, -float(cos) if isinstance(cos, int | float) else 0.0)

    for kind in dict.fromkeys(t.candidate.kind for t in missed):
        out.append(min((t for t in missed if t.candidate.kind == kind), key=closeness))
    return out


def choose(
    passed: Sequence[Trial],
    objective: str,
    min_gain: float,
    incumbent: Candidate | None = None,
    *,
    size_weight: float = 0.25,
) -> tuple[Trial, str | None]:
    """The champion among trials that passed every gate in one judgement, and why the
    incumbent was kept if it was. The incumbent is the remembered champion in a search from
    memory, else the best fixed recipe; the best by ``objective`` replaces it only by more than
    that run's noise (the larger spread of their blocks' speedups, at least ``min_gain``; sizes
    are exact): a gain inside the noise is no gain."""
    ranked = sorted(passed, key=lambda t: -t.score(objective, size_weight))
    top = ranked[0]
    held = next((t for t in ranked if incumbent is not None and t.candidate == incumbent), None)
    held = held or next((t for t in ranked if t.candidate.recipe), None)
    if held is None or held is top:
        return top, None
    noise = 0.0
    if objective != "size":
        spreads = [t.timings[-1][2] for t in (top, held) if t.timings]
        noise = max([min_gain, *spreads])
    base = held.score(objective, size_weight)
    gain = top.score(objective, size_weight) / base - 1 if base else float("inf")
    if gain < noise:
        what = "remembered champion" if held.candidate == incumbent else "fixed recipe"
        return held, (
            f"{top.candidate.key} measured {gain:+.1%} against the {what} "
            f"{held.candidate.key}, inside this run's noise ({noise:.1%}): the {what} stays"
        )
    return top, None


def _parse_kinds(kinds: Sequence[str] | None, device: str) -> list[str]:
    if not kinds:
        return list(DEVICE_KINDS[device])
    try:
        check_kinds(kinds)
    except KeyError as exc:
        raise TuneError(str(exc.args[0])) from exc
    return list(kinds)


def tune(
    source: str | Path,
    out_dir: str | Path,
    *,
    device: str = "cpu",
    policy: Any = None,
    data: Any = None,
    calibration: Any = None,
    config: Any = None,
    kinds: Sequence[str] | None = None,
    settings: TuneSettings | None = None,
    memory: Any = None,
    tensorrt: bool = False,
    keep_trials: bool = False,
    progress: ProgressFn | None = None,
) -> TuneResult:
    """Search the settings of ``source``'s variants for the best that passes every gate on
    ``device``, within ``settings.budget_s`` (see the module's text). The champion is written
    to ``out_dir/<stem>.tuned.onnx``; with ``memory`` (a :class:`~graphtrim.tune.memory.
    TuneMemory`), the search starts from what it remembers for this graph and device, and a
    champion is remembered for the next version."""
    from graphtrim.data import input_specs, random_data
    from graphtrim.gates.policy import GatePolicy
    from graphtrim.modelio import publish_model, read_proto, staging_dir
    from graphtrim.quantize.build import QuantizeConfig
    from graphtrim.runtime import providers_for
    from graphtrim.tune.memory import graph_signature

    settings = settings or TuneSettings()
    settings.validate()
    clock = _Clock(settings.budget_s)
    say = progress or (lambda _line: None)
    src, out = Path(source), Path(out_dir)
    read_proto(src)  # a corrupt model is an InvalidModelError before any work
    specs = input_specs(src)
    providers_for(device, tensorrt=tensorrt)  # a missing GPU is an error before any work
    policy = policy or GatePolicy()
    settings = dataclasses.replace(
        settings,
        objective=settings.objective or policy.tune.objective,
        size_weight=(
            policy.tune.size_weight if settings.size_weight is None else settings.size_weight
        ),
    )
    kind_list = _parse_kinds(kinds, device)
    if data is None:
        data = calibration if calibration is not None else random_data(specs, batches=8)
    base = config or QuantizeConfig()
    base = dataclasses.replace(base, tune_device=device)
    base.validate()
    signature = graph_signature(src)
    ops = _model_ops(src)
    out.mkdir(parents=True, exist_ok=True)
    work = staging_dir(out / f"{src.stem}.tune")
    search = _Search(
        src,
        work,
        device=device,
        policy=policy,
        data=data,
        calibration=calibration,
        base=base,
        settings=settings,
        clock=clock,
        say=say,
        tensorrt=tensorrt,
    )
    notes: list[str] = []
    remembered = memory.recall(signature, device) if memory is not None else None
    start: Candidate | None = None
    if remembered is not None:
        try:
            start = Candidate.from_json(remembered)
        except (KeyError, TypeError, ValueError) as exc:
            notes.append(f"the remembered entry is unusable ({exc}): full search")
            start = None
        if start is not None and start.kind not in kind_list:
            notes.append(
                f"the remembered {start.kind} is not among the kinds searched: full search"
            )
            start = None
    try:
        champion: Trial | None = None
        evaluation: dict[str, Any] | None = None
        mode = "full"
        if start is not None:
            mode = "memory"
            search.incumbent = start
            say(f"memory: starting from {start.key} ({memory.describe()})")
            excluded = [str(x) for x in remembered.get("excluded") or []] if remembered else []
            # one neighbourhood, in the knobs that depend on the weights: the others time the
            # same on every version of this graph
            stopped = search.explore([(start, "memory", excluded)], rounds=1, weights_only=True)
            remembered_trial = search.trials.get(start.key)
            if remembered_trial is None or not remembered_trial.feasible:
                notes.append("the remembered settings failed their gates here: full search")
            else:
                champion, evaluation = search.decide()
                if champion is None:
                    notes.append("no finalist of the remembered neighbourhood passed: full search")
            if champion is None:
                mode = "memory, then full"
                search.incumbent = None
        if champion is None:
            starts: list[tuple[Candidate, str, list[str]]] = [
                (c, "recipe", [])
                for c in start_points(kind_list, ops, calibration=calibration is not None)
            ]
            if not starts:
                raise TuneError(
                    f"no variant of {', '.join(kind_list)} applies to this model "
                    f"(its ops: {', '.join(sorted(ops))})"
                )
            stopped = search.explore(starts, rounds=settings.max_rounds)
            champion, evaluation = search.decide()
        output = None
        if champion is not None and champion.path is not None:
            output = str(out / f"{src.stem}.tuned.onnx")
            publish_model(Path(champion.path), Path(output))
            say(f"champion: {champion.candidate.key}, {champion.speedup or 0:.3f}x, {output}")
        result = TuneResult(
            str(src),
            device,
            signature,
            settings.objective or "latency",
            settings.size_weight or 0.0,
            mode,
            list(search.trials.values()),
            champion,
            output,
            stopped,
            clock.elapsed(),
            settings.budget_s,
            evaluation,
            remembered,
            notes + search.notes,
        )
        if memory is not None and champion is not None:
            entry = result.memory_entry()
            assert entry is not None
            memory.remember(signature, device, entry)
        if keep_trials:
            kept = out / f"{src.stem}.trials"
            shutil.rmtree(kept, ignore_errors=True)
            shutil.copytree(work, kept)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def write_result(result: TuneResult, folder: str | Path) -> dict[str, Path]:
    """``tune.json``, ``tune.md`` and ``tune.html`` of ``result`` in ``folder``."""
    from graphtrim.tune.report import write_tune_reports

    return write_tune_reports(result.to_json(), folder)
