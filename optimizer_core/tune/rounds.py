"""The settings search in steps, for a pool of workers: each trial its own task.

:func:`graphtrim.tune.search.tune` runs a whole search in one process and times its candidates
against each other. An orchestrator spreads the same search over its workers instead, round by
round, with the state between the steps as JSON (an XCom, a KFP parameter):

1. :func:`plan` — the first round's trials: each wanted kind's fixed recipe, or, where the
   memory holds a champion for this graph and device, that champion and its neighbourhood in
   the knobs that depend on the weights (one round: the workers build them side by side).
2. :func:`run_trial` — one trial, on any worker of the device's class: built as ``graphtrim
   quantize`` builds it (the sensitivity fallback included), its accuracy gate checked on the
   screening subset and its size gate on the file, then timed against the reference on that
   worker, interleaved. Its score is that speedup: a ratio measured on one worker, so trials
   timed on different workers of one class can be ranked together. A trial that would start
   after the round's deadline is not built (``skipped``), so a search ends within its budget
   plus one trial.
3. :func:`select` — after each round: per kind, the neighbours of the best feasible trials
   (the beam), and of the nearest miss of a kind with none yet, become the next round; a kind
   stops when a round gains less than ``min_gain``, when nothing is left, when the
   orchestrator's rounds are used up, or when the budget (less the judgement's estimated
   time) is spent. A search from memory whose remembered settings fail their gates goes on as
   a full search.
4. :func:`judge` — per kind, on the worker that builds the variant: the best trials are
   re-timed against each other in one process (successive halving) and the finalists, with
   the best fixed recipe, judged by :func:`graphtrim.gates.evaluate` with the policy's full
   method; the champion is chosen as :func:`graphtrim.tune.search.choose` chooses (nothing
   wins on noise).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from graphtrim.tune.choice import nearest_misses, ranked
from graphtrim.tune.engine import _Search
from graphtrim.tune.inputs import _Clock
from graphtrim.tune.records import Trial, TuneError, TuneResult, TuneSettings
from graphtrim.tune.search_state import KindSearch, SearchState
from graphtrim.tune.space import Candidate, neighbours, start_points

# trial layers an orchestrator lays out by default: the recipes and four rounds of neighbours
ROUNDS = 5

# how many of a kind's best trials the judgement re-times against each other
JUDGED = 4


def _spec(
    state: SearchState, candidate: Candidate, origin: str, excluded: Sequence[str]
) -> dict[str, Any]:
    state.numbers += 1
    return {
        "number": state.numbers,
        "round": state.round,
        "origin": origin,
        "candidate": candidate.to_json(),
        "excluded": list(excluded),
    }


def _recipes(
    state: SearchState, kind: str, ops: frozenset[str], calibration: bool
) -> list[dict[str, Any]]:
    return [
        _spec(state, c, "recipe", []) for c in start_points([kind], ops, calibration=calibration)
    ]


def plan(
    kinds: Sequence[str],
    ops: frozenset[str],
    *,
    signature: str,
    settings: TuneSettings,
    calibration: bool,
    remembered: Mapping[str, Mapping[str, Any] | None] | None = None,
    rounds: int = ROUNDS,
    judge_runs: int = 650,
    data_scale: float = 1.0,
) -> tuple[SearchState, list[dict[str, Any]]]:
    """The search's state and its first round (trial specs, for :func:`run_trial`).
    ``settings``: objective and size weight resolved (the policy's); ``remembered``: the
    memory's entry per kind, if any; ``rounds``: the trial layers the orchestrator has;
    ``judge_runs`` (the gates' timed and warm-up runs) and ``data_scale`` (the gates' data
    over the screening subset) size the judgement the budget keeps time for."""
    settings.validate()
    if settings.objective is None or settings.size_weight is None:
        raise TuneError("plan: the objective and the size weight must be resolved")
    if rounds < 1:
        raise TuneError("a search needs at least one round")
    state = SearchState(
        signature=signature,
        settings=dataclasses.asdict(settings),
        started=time.time(),
        rounds_left=rounds,
        kinds={},
        ops=sorted(ops),
        calibration=calibration,
        judge_runs=judge_runs,
        data_scale=data_scale,
    )
    batch: list[dict[str, Any]] = []
    for kind in kinds:
        entry = dict((remembered or {}).get(kind) or {}) or None
        search = KindSearch(kind, "full", entry)
        state.kinds[kind] = search
        start = None
        if entry is not None:
            try:
                start = Candidate.from_json(entry)
            except (KeyError, TypeError, ValueError) as exc:
                search.notes.append(f"the remembered entry is unusable ({exc}): full search")
            if start is not None and start.kind != kind:
                search.notes.append(f"the remembered {start.key} is no {kind}: full search")
                start = None
        if start is not None:
            search.mode = "memory"
            excluded = [str(x) for x in (entry or {}).get("excluded") or []]
            batch.append(_spec(state, start, "memory", excluded))
            batch += [
                _spec(state, n, f"neighbour of {start.key}", excluded)
                for n in neighbours(start, ops, weights_only=True)
            ]
            continue
        mine = _recipes(state, kind, ops, calibration)
        if not mine:
            search.stopped = "nothing applies"
            search.notes.append(f"no {kind} applies to this model")
        batch += mine
    if not batch:
        raise TuneError(
            f"no variant of {', '.join(kinds)} applies to this model "
            f"(its ops: {', '.join(sorted(ops))})"
        )
    deadline = _deadline(state)
    for spec in batch:
        spec["deadline"] = deadline
    return state, batch


def run_trial(
    spec: Mapping[str, Any],
    source: str | Path,
    work: str | Path,
    *,
    device: str,
    policy: Any,
    data: Any,
    calibration: Any,
    config: Any,
    settings: TuneSettings,
    tensorrt: bool = False,
    progress: Any = None,
) -> dict[str, Any]:
    """Build and screen one trial (see the module's text) under ``work``; returns what
    :func:`select` reads: ``trial`` (its record; ``path``, its model, when feasible), the
    reference's p50 in ms as timed beside it (``ref_ms``), its accuracy check's seconds and its
    wall time."""
    from graphtrim.quantize.build import QuantizeConfig

    t0 = time.perf_counter()
    candidate = Candidate.from_json(spec["candidate"])
    late = time.time() - float(spec["deadline"])
    if late > 0:
        trial = Trial(int(spec["number"]), candidate, int(spec["round"]), str(spec["origin"]))
        # the deadline is the planning worker's clock: a worker whose clock runs ahead skips
        # trials a queue never delayed, so the line says which of the two it may be
        trial.status, trial.error = (
            "skipped",
            (
                f"the search's budget was spent before it started: this worker's clock reads "
                f"{late:.0f} s past the round's deadline (the trial waited that long, or this "
                "worker's clock is ahead of the one that planned the round: the budget is judged by "
                "the workers' clocks, which must agree)"
            ),
        )
        return {"trial": trial.to_json(), "ref_ms": None, "accuracy_s": 0.0, "seconds": 0.0}
    base = dataclasses.replace(config or QuantizeConfig(), tune_device=device)
    search = _Search(
        Path(source),
        Path(work),
        device=device,
        policy=policy,
        data=data,
        calibration=calibration,
        base=base,
        settings=settings,
        clock=_Clock(float("inf")),
        say=progress or (lambda _line: None),
        tensorrt=tensorrt,
    )
    trial = search.build(
        candidate,
        str(spec["origin"]),
        int(spec["round"]),
        [str(x) for x in spec.get("excluded") or []],
        number=int(spec["number"]),
    )
    if trial.feasible:
        search.time([trial], settings.screen_runs)
    return {
        "trial": trial.to_json() | {"path": trial.path if trial.feasible else None},
        "ref_ms": search.ref_ms,
        "accuracy_s": search.accuracy_s,
        "seconds": time.perf_counter() - t0,
    }


def _final_cost(state: SearchState) -> float:
    """Seconds the judgement of every kind is expected to take (generous): the gates' runs of
    the reference and the finalists, and their accuracy on all the data."""
    s = state.tune_settings()
    ms = state.ref_ms or 0.0
    models = s.finalists + 2  # the finalists, the recipe beside them and the reference
    per_kind = 1.5 * models * (state.judge_runs * ms / 1000.0 + state.data_scale * state.accuracy_s)
    return 2.0 + per_kind * sum(1 for k in state.kinds.values() if k.stopped != "nothing applies")


def _deadline(state: SearchState) -> float:
    """No trial starts after this (epoch seconds): the budget less the judgement."""
    return state.started + float(state.settings["budget_s"]) - _final_cost(state)


def select(
    state: SearchState, results: Sequence[Mapping[str, Any] | None]
) -> tuple[SearchState, list[dict[str, Any]]]:
    """Take a round's ``results`` (:func:`run_trial`'s; None for a trial whose task left
    nothing) and return the state and the next round (empty when the search is done)."""
    s = state.tune_settings()
    assert s.objective is not None and s.size_weight is not None
    ops, calibration = frozenset(state.ops), state.calibration
    for result in results:
        if not result:
            continue
        doc = dict(result["trial"])
        search = state.kinds.get(str(doc["kind"]))
        if search is None:
            raise TuneError(f"a trial of {doc['kind']}, which this search does not search")
        search.trials.append(doc)
        if result.get("ref_ms"):
            state.ref_ms = float(result["ref_ms"])
        state.accuracy_s = max(state.accuracy_s, float(result.get("accuracy_s") or 0.0))
        if result.get("seconds"):
            state.trial_s.append(float(result["seconds"]))
    state.round += 1
    state.rounds_left -= 1
    if state.rounds_left <= 0:
        for search in state.kinds.values():
            if search.stopped is None:
                search.stopped = "rounds"
        return state, []
    batch: list[dict[str, Any]] = []
    for kind, search in state.kinds.items():
        if search.stopped is not None:
            continue
        trials = search.loaded()
        tried = {t.candidate.key for t in trials}
        leaders = ranked(trials, s.objective, s.size_weight)
        best = leaders[0].score(s.objective, s.size_weight) if leaders else 0.0
        if any(t.status == "skipped" for t in trials):
            search.stopped = "budget"
            continue
        if search.mode == "memory":
            held = next((t for t in trials if t.origin == "memory"), None)
            if held is not None and held.feasible and held.speedup is not None:
                search.stopped, search.best = "memory: its neighbourhood checked", best
                continue
            search.notes.append("the remembered settings failed their gates here: full search")
            search.mode = "memory, then full"
            fresh = [
                c for c in start_points([kind], ops, calibration=calibration) if c.key not in tried
            ]
            if fresh:
                batch += [_spec(state, c, "recipe", []) for c in fresh]
                continue
            # the recipe was in the remembered neighbourhood: the full search goes on from here
        search.rounds += 1
        rescued = bool(leaders) and search.best == 0.0
        if search.rounds > 1 and best < search.best * (1 + s.min_gain) and not rescued:
            search.stopped = "converged"
            continue
        search.best = max(best, search.best)
        feasible_kinds = {kind} if leaders else set()
        lead = leaders[: s.beam] + nearest_misses(trials, feasible_kinds)
        seen: set[str] = set(tried)
        for t in lead:
            for n in neighbours(t.candidate, ops):
                if n.key not in seen:
                    seen.add(n.key)
                    batch.append(_spec(state, n, f"neighbour of {t.candidate.key}", t.excluded))
        if not any(b["candidate"]["kind"] == kind for b in batch):
            search.stopped = "exhausted"
    deadline = _deadline(state)
    typical = sorted(state.trial_s)[len(state.trial_s) // 2] if state.trial_s else 0.0
    if batch and time.time() + typical > deadline:
        for search in state.kinds.values():
            if search.stopped is None:
                search.stopped = "budget"
        return state, []
    for spec in batch:
        spec["deadline"] = deadline
    return state, batch


def to_judge(search: KindSearch, settings: TuneSettings) -> list[dict[str, Any]]:
    """The trials of ``search`` the judgement needs: its best few and its best recipe."""
    assert settings.objective is not None and settings.size_weight is not None
    best = ranked(search.loaded(), settings.objective, settings.size_weight)
    chosen = best[: max(JUDGED, settings.finalists)]
    recipe = next((t for t in best if t.candidate.recipe), None)
    if recipe is not None and recipe not in chosen:
        chosen.append(recipe)
    wanted = {t.number for t in chosen}
    return [t for t in search.trials if t["number"] in wanted]


def judge(
    state: SearchState,
    kind: str,
    source: str | Path,
    out_dir: str | Path,
    paths: Mapping[int, str | Path],
    *,
    device: str,
    policy: Any,
    data: Any,
    calibration: Any = None,
    config: Any = None,
    tensorrt: bool = False,
    progress: Any = None,
) -> TuneResult:
    """Judge ``kind``'s best trials (``paths``: their models here, by trial number) on this
    worker and choose its champion (see the module's text); the champion's model is copied to
    ``out_dir/<stem>.tuned.onnx``."""
    from graphtrim.modelio import publish_model
    from graphtrim.quantize.build import QuantizeConfig

    search = state.kinds[kind]
    settings = state.tune_settings()
    src, out = Path(source), Path(out_dir)
    clock = _Clock(max(60.0, _final_cost(state)))
    work = _Search(
        src,
        out,
        device=device,
        policy=policy,
        data=data,
        calibration=calibration,
        base=dataclasses.replace(config or QuantizeConfig(), tune_device=device),
        settings=settings,
        clock=clock,
        say=progress or (lambda _line: None),
        tensorrt=tensorrt,
    )
    for trial in search.loaded():
        local = paths.get(trial.number)
        trial.path = str(local) if local is not None else None
        work.trials[trial.candidate.key] = trial
    if search.mode == "memory" and search.remembered:
        work.incumbent = Candidate.from_json(search.remembered)
    champion, evaluation = work.decide() if work.ranked() else (None, None)
    output = None
    if champion is not None and champion.path is not None:
        out.mkdir(parents=True, exist_ok=True)
        output = str(out / f"{src.stem}.tuned.onnx")
        publish_model(Path(champion.path), Path(output))
    trials = list(work.trials.values())
    for t in trials:  # the paths were this worker's
        if t is not champion:
            t.path = None
    return TuneResult(
        str(src),
        device,
        state.signature,
        settings.objective or "latency",
        settings.size_weight or 0.0,
        search.mode,
        sorted(trials, key=lambda t: t.number),
        champion,
        output,
        search.stopped or "rounds",
        time.time() - state.started,
        settings.budget_s,
        evaluation,
        search.remembered,
        [
            f"{len({t.round for t in trials})} round(s) over the worker pool",
            *search.notes,
            *work.notes,
        ],
    )
