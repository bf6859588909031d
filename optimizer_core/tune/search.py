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
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from graphtrim.tune.engine import ProgressFn, _Search
from graphtrim.tune.inputs import _Clock, _model_ops
from graphtrim.tune.records import Trial, TuneError, TuneResult, TuneSettings
from graphtrim.tune.space import DEVICE_KINDS, Candidate, check_kinds, start_points

logger = logging.getLogger("graphtrim.tune")


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
