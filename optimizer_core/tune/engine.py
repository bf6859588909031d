"""The state of one settings search and what it does with it: build a trial, time finalists
against each other, rank and halve them, judge the champion against the reference. The whole
search in one process (:mod:`graphtrim.tune.search`) and the orchestrated rounds
(:mod:`graphtrim.tune.rounds`) both drive it."""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from graphtrim.errors import GraphtrimError, PassFailure, VerificationError
from graphtrim.tune.choice import choose, nearest_misses, ranked
from graphtrim.tune.inputs import _bytes, _Clock, _model_ops, _subset
from graphtrim.tune.records import Trial, TuneSettings, _line
from graphtrim.tune.space import Candidate, neighbours

ProgressFn = Callable[[str], None]


logger = logging.getLogger("graphtrim.tune")

_REFERENCE = "\x00reference"  # the reference's session: a key no candidate takes


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
