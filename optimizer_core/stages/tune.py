"""The settings search over an orchestrator's worker pool: one task per trial.

With ``tune`` in the config, an orchestrator runs :func:`tune_plan` once, then, round after
round, one :func:`tune_trial` task per trial of the round (mapped tasks on the device's queue,
under a pool; a ``ParallelFor`` in Kubeflow) and :func:`tune_select` on their results; the
quantize stage judges each kind's best trials on its worker and builds the champion as the
variant (:func:`graphtrim.stages.quantize.quantize` with ``tuned``). Between the steps the
search is JSON (:class:`graphtrim.tune.search_state.SearchState`); the feasible trials' models are
kept in the artifact store. Without ``tune`` the plan has no search and every step after it
returns at once.

``graphtrim pipeline run --tune`` on one machine runs the search in the quantize stage instead
(:func:`graphtrim.tune.search.tune`, candidates timed against each other in one process).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from graphtrim.stages.context import DataFiles, PipelineConfig, StageContext
from graphtrim.stages.records import ExportRecord, OptimizeRecord

logger = logging.getLogger("graphtrim.stages")

Step = dict[str, Any]  # {"search": the state as JSON or None, "batch": the next round's trials}


def _settings(config: PipelineConfig, policy: Any) -> Any:
    from graphtrim.tune.search import TuneSettings

    assert config.tune is not None
    return TuneSettings(
        budget_s=config.tune,
        objective=policy.tune.objective,
        size_weight=policy.tune.size_weight,
    )


def _wanted(config: PipelineConfig, exp: ExportRecord) -> list[str]:
    known = exp.reused or {}
    return [v for v in config.variants if v not in known]


class _CachedData(DataFiles):
    """The data files of a config, S3 objects read through this worker's input cache (by the
    content hashes the resolved config carries)."""

    def __init__(self, ctx: StageContext, config: PipelineConfig, folder: Path, cache: Any):
        super().__init__(ctx, config, folder)
        self.cache = cache
        self.digests = dict(config.data_sha256 or {})

    def path(self, key: str) -> Path:
        uri = self.uris[key]
        digest = self.digests.get(key)
        if uri not in self.local and digest and uri.startswith("s3://"):
            self.local[uri] = self.cache.file(
                uri, digest, self.folder / self.NAMES[key], self.ctx.fetch_file
            )
        return super().path(key)


@contextlib.contextmanager
def _inputs(
    ctx: StageContext, config: PipelineConfig, exp: ExportRecord, opt: OptimizeRecord
) -> Iterator[tuple[PipelineConfig, Path, Any, Any, Path]]:
    """What a step reads, in its scratch folder: the resolved config, the optimized model (the
    search's reference), the calibration and evaluation data, the folder. The models and the
    S3 data files come from this worker's input cache
    (:class:`~graphtrim.integrations.input_cache.InputCache`, ``GRAPHTRIM_INPUT_CACHE``)."""
    assert exp.model is not None and opt.model is not None
    from graphtrim.integrations.input_cache import InputCache

    cache = InputCache.from_env()
    with ctx.scratch("tune") as tmp:
        data = (
            DataFiles(ctx, config, tmp / "data")
            if cache is None
            else _CachedData(ctx, config, tmp / "data", cache)
        )
        config = config.resolved(ctx, data)
        if cache is None:
            reference = ctx.fetch(exp.model["uri"], tmp / "reference")
            base = ctx.fetch(opt.model["uri"], tmp / "optimized")
        else:  # every trial of a search reads the same inputs: fetched once per worker
            reference = cache.model(
                exp.model["uri"], exp.model["sha256"], tmp / "reference", ctx.fetch
            )
            base = cache.model(opt.model["uri"], opt.model["sha256"], tmp / "optimized", ctx.fetch)
        calib, evald = data.load(reference)
        yield config, base, calib, evald, tmp


def tune_plan(
    ctx: StageContext,
    config: PipelineConfig,
    exported: ExportRecord | Mapping[str, Any],
    optimized: OptimizeRecord | Mapping[str, Any],
    *,
    rounds: int | None = None,
) -> Step:
    """The search of every variant the run builds (those not judged before), from the
    registry's memory where it holds settings for this graph: its state and first round.
    ``rounds``: the trial layers the orchestrator has (:data:`graphtrim.tune.rounds.ROUNDS`)."""
    from graphtrim.integrations.registry import RegistryTuneMemory
    from graphtrim.tune import rounds as steps
    from graphtrim.tune.inputs import _model_ops, _subset
    from graphtrim.tune.memory import graph_signature

    if config.tune is None:
        return {"search": None, "batch": []}
    exp = ExportRecord.take(exported, ("run_id", "source", "model"), "tune")
    opt = OptimizeRecord.take(optimized, ("model",), "tune")
    wanted = _wanted(config, exp)
    if not wanted:
        return {"search": None, "batch": []}
    with _inputs(ctx, config, exp, opt) as (config, base, calib, evald, _tmp):
        policy = config.gate_policy()
        settings = _settings(config, policy)
        registry = ctx.registry()
        remembered = {
            k: RegistryTuneMemory(registry, exp.source["name"], scope=k).recall(
                graph_signature(base), config.device
            )
            for k in wanted
        }
        lat = policy.for_variant("__defaults__").latency
        screen = _subset(evald, settings.screen_samples)
        state, batch = steps.plan(
            wanted,
            _model_ops(base),
            signature=graph_signature(base),
            settings=settings,
            calibration=calib is not None,
            remembered=remembered,
            rounds=rounds or steps.ROUNDS,
            judge_runs=(lat.runs + lat.warmup) if lat is not None else 650,
            data_scale=max(1.0, len(evald) / max(1, len(screen))),
        )
    for kind, search in state.kinds.items():
        how = f"from the remembered {search.remembered.get('key')}" if search.remembered else ""
        ctx.say(f"tune: {kind}: {search.mode} search {how}".rstrip())
    ctx.say(f"tune: round 0: {len(batch)} trial(s), {config.tune:.0f} s budget")
    return {"search": state.to_json(), "batch": batch}


def tune_trial(
    ctx: StageContext,
    config: PipelineConfig,
    exported: ExportRecord | Mapping[str, Any],
    optimized: OptimizeRecord | Mapping[str, Any],
    trial: Mapping[str, Any],
) -> dict[str, Any]:
    """Build and screen one trial (:func:`graphtrim.tune.rounds.run_trial`) in a child process
    (a candidate that crashes the runtime is a failed trial, not a failed task); a feasible
    one's model goes to the artifact store (``uri``)."""
    from graphtrim.isolation import map_isolated
    from graphtrim.quantize.build import QuantizeConfig
    from graphtrim.redact import redact
    from graphtrim.tune.search import Trial
    from graphtrim.tune.space import Candidate

    exp = ExportRecord.take(exported, ("run_id", "source", "model"), "tune")
    opt = OptimizeRecord.take(optimized, ("model",), "tune")
    assert exp.model is not None and opt.model is not None and config.tune is not None
    key = trial["candidate"]["key"]
    with _inputs(ctx, config, exp, opt) as (config, base, calib, evald, tmp):
        policy = config.gate_policy()
        ctx.say(f"tune: trial {trial['number']}: {key} ({trial['origin']})")
        (out,) = map_isolated(
            "graphtrim.stages.tune:trial_job",
            [dict(trial)],
            common={
                "src": str(base),
                "work": str(tmp / "trial"),
                "config": QuantizeConfig(
                    preset=config.preset, tune_device=config.device, **(config.weights or {})
                ),
                "calibration": calib,
                "data": evald,
                "policy": policy,
                "settings": _settings(config, policy),
                "device": config.device,
                "tensorrt": config.tensorrt,
            },
            timeout=ctx.child_timeout,
            what=lambda _t: f"trial {key}",
            on_step=lambda line: ctx.say(f"tune: {line}"),
            fresh=True,
        )
        if isinstance(out, BaseException):
            logger.warning("tune: trial %s failed: %s", key, out)
            failed = Trial(
                int(trial["number"]),
                Candidate.from_json(trial["candidate"]),
                int(trial["round"]),
                str(trial["origin"]),
                status="failed",
                error=redact(f"{type(out).__name__}: {out}")[:2000],
            )
            return {"trial": failed.to_json(), "ref_ms": None, "accuracy_s": 0.0, "seconds": 0.0}
        doc = dict(out["trial"])
        path = doc.pop("path", None)
        doc["path"] = None  # this worker's scratch: the store keeps the model
        if path:
            stored = ctx.store().put_model(
                path,
                model=exp.source["name"],
                version=exp.source["version"],
                stage=f"tune-{doc['kind']}",
                parents=[opt.model["sha256"]],
                config_hash=config.config_hash,
                extra={"variant": doc["kind"], "tune_trial": key},
            )
            doc["uri"] = stored.uri
        ctx.say(f"tune: trial {trial['number']}: {doc['status']}")
        return {**out, "trial": doc}


def trial_job(item: Mapping[str, Any], **job: Any) -> Any:
    """One trial as a child process runs it (:mod:`graphtrim.isolation`)."""
    from graphtrim.isolation import step
    from graphtrim.tune.rounds import run_trial

    return run_trial(
        item, job["src"], job["work"], settings=job["settings"], progress=step, **_measured(job)
    )


def _measured(job: Mapping[str, Any]) -> dict[str, Any]:
    """What a trial and a judgement are measured with, from a child's job: the device, gate
    policy, data, calibration, quantize config and TensorRT switch."""
    return {k: job[k] for k in ("device", "policy", "data", "calibration", "config", "tensorrt")}


def tune_select(
    ctx: StageContext,
    config: PipelineConfig,
    search: Mapping[str, Any] | None,
    trials: Sequence[Mapping[str, Any] | None] | None,
) -> Step:
    """The search after a round of ``trials`` (:func:`tune_trial`'s results): its state and
    the next round, empty when it is done (or when there is no search)."""
    from graphtrim.tune import rounds as steps
    from graphtrim.tune.search_state import SearchState

    if not search:
        return {"search": None, "batch": []}
    state = SearchState.from_json(search)
    if state.done:
        return {"search": state.to_json(), "batch": []}
    got = [dict(t) if t else None for t in (trials or [])]
    state, batch = steps.select(state, got)
    for kind, s in state.kinds.items():
        if s.stopped is not None:
            ctx.say(f"tune: {kind}: {len(s.trials)} trial(s), stopped: {s.stopped}")
    ctx.say(f"tune: round {state.round}: {len(batch)} trial(s)")
    return {"search": state.to_json(), "batch": batch}


def judge_job(item: Mapping[str, Any], **job: Any) -> Any:
    """One kind's judgement as a child process runs it: ``item`` holds the ``kind``, the
    search's ``state`` and the ``paths`` of its best trials here, by number. Returns (the
    :class:`~graphtrim.tune.search.TuneResult`, the entry to remember or None)."""
    from graphtrim.isolation import step
    from graphtrim.tune.rounds import judge
    from graphtrim.tune.search_state import SearchState

    kind = item["kind"]
    result = judge(
        SearchState.from_json(item["state"]),
        kind,
        job["src"],
        Path(job["out"]) / kind,
        {int(k): v for k, v in item["paths"].items()},
        progress=step,
        **_measured(job),
    )
    return result, result.memory_entry()


def search_state(search: Mapping[str, Any] | None) -> Any:
    """The search a run's select steps ended with, or None."""
    from graphtrim.tune.search_state import SearchState

    return SearchState.from_json(search) if search else None
