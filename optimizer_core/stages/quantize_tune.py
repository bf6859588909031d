"""The quantize stage's settings search (``tuned``): the search per variant kind in a child
process (:func:`tune_job`), remembered in and recalled from the registry, its trials logged to
the stage's MLflow run and their models cleaned up but for the champion's."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graphtrim.errors import GraphtrimError
from graphtrim.redact import redact
from graphtrim.stages.context import PipelineConfig, StageContext
from graphtrim.stages.records import OptimizeRecord, QuantizeRecord
from graphtrim.stages.tracking import T

if TYPE_CHECKING:
    from graphtrim.quantize.build import QuantizeConfig

logger = logging.getLogger("graphtrim.stages")


def _tuned(
    ctx: StageContext,
    config: PipelineConfig,
    record: QuantizeRecord,
    mlflow: Any,
    store: Any,
    qconfig: QuantizeConfig,
    wanted: list[str],
    base: Path,
    tmp: Path,
    calib: Any,
    evald: Any,
    source: Mapping[str, Any],
    run_id: str,
    opt: OptimizeRecord,
    tuned: Mapping[str, Any] | None = None,
) -> list[str]:
    """Search the settings of each ``wanted`` kind over its own knobs (a child process each,
    ``config.tune`` seconds each), or, with ``tuned`` (the state of a search an orchestrator
    ran over its workers, :mod:`graphtrim.stages.tune`), judge each kind's best trials here;
    store each champion as the variant of its kind (with what the search found in its record),
    keep the winning settings on the source's registered model, log every trial; returns the
    kinds with no champion, to be built with their fixed recipes."""
    from graphtrim.integrations.entries import MissingEntryError
    from graphtrim.integrations.registry import RegistryTuneMemory
    from graphtrim.isolation import map_isolated
    from graphtrim.tune.memory import graph_signature
    from graphtrim.tune.report import summary

    assert config.tune is not None
    registry = ctx.registry()
    memories = {k: RegistryTuneMemory(registry, source["name"], scope=k) for k in wanted}
    signature = graph_signature(base)
    common = {
        "src": str(base),
        "out": str(tmp / "tuned"),
        "config": qconfig,
        "calibration": calib,
        "data": evald,
        "policy": config.gate_policy(),
        "device": config.device,
        "tensorrt": config.tensorrt,
    }
    fixed = []
    state = None
    if tuned is not None:
        from graphtrim.stages.tune import search_state
        from graphtrim.tune.rounds import to_judge

        state = search_state(tuned)
        searched = [k for k in wanted if state is not None and k in state.kinds]
        fixed += [k for k in wanted if k not in searched]
        items = []
        for kind in searched:
            picked = to_judge(state.kinds[kind], state.tune_settings())
            ctx.say(f"quantize: judging the {len(picked)} best trial(s) of {kind}'s search")
            paths = {}
            for t in picked:
                if not t.get("uri"):
                    continue
                try:
                    paths[t["number"]] = str(ctx.fetch(t["uri"], tmp / "trials" / str(t["number"])))
                except MissingEntryError:  # deleted after an earlier attempt's judgement
                    ctx.say(f"quantize: trial {t['number']} of {kind}: its model was deleted")
            items.append({"kind": kind, "state": state.to_json(), "paths": paths})
        target, wanted = "graphtrim.stages.tune:judge_job", searched
    else:
        items = []
        for kind in wanted:
            remembered = memories[kind].recall(signature, config.device)
            ctx.say(
                f"quantize: searching the settings of {kind} for {config.tune:.0f} s"
                + (f", from the remembered {remembered.get('key')}" if remembered else "")
            )
            items.append(
                {"kind": kind, "remembered": remembered, "where": memories[kind].describe()}
            )
        target, common["budget"] = "graphtrim.stages.quantize_tune:tune_job", config.tune
    outcomes = map_isolated(
        target,
        items,
        common=common,
        # the budget, the judgement it may overrun by, and the fixed time a child needs
        timeout=max(ctx.child_timeout, 2 * config.tune + 600),
        what=lambda item: f"searching the settings of {item['kind']}",
        on_step=lambda line: ctx.say(f"quantize: tune: {line}"),
        fresh=True,
    )
    for kind, outcome in zip(wanted, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            logger.warning("quantize: the settings search of %s failed: %s", kind, outcome)
            mlflow.set_tag(run_id, f"{T}tune.error.{kind}", redact(outcome)[:5000])
            ctx.say(f"quantize: the search of {kind} failed ({outcome}): its fixed recipe")
            fixed.append(kind)
            continue
        result, remember = outcome
        doc = result.to_json()
        mlflow.log_dict(run_id, doc, f"graphtrim/tune-{kind}.json")
        # the trials' table and the speed/size front, beside the run's other reports
        from graphtrim.tune.report import write_tune_reports

        reports = write_tune_reports(doc, tmp / "tune-reports" / kind)
        mlflow.log_artifacts(run_id, str(reports["html"].parent), f"graphtrim/reports/tune-{kind}")
        _log_trials(mlflow, run_id, result)
        ctx.say(f"quantize: tune {kind}: {summary(doc)}")
        champion = result.champion
        if champion is None or result.output is None:
            mlflow.set_tag(run_id, f"{T}tune.champion.{kind}", "none")
            fixed.append(kind)
            if state is not None:
                _clean_trials(ctx, store, state.kinds[kind].trials, None)
            continue
        if remember is not None:
            memories[kind].remember(signature, config.device, remember)
        stored = store.put_model(
            Path(result.output),
            model=source["name"],
            version=source["version"],
            stage=f"variant-{kind}",
            parents=[opt.model["sha256"]] if opt.model else [],
            config_hash=config.config_hash,
            extra={"variant": kind, "tuned": champion.candidate.key},
        )
        mlflow.set_tag(run_id, f"{T}tune.champion.{kind}", champion.candidate.key[:5000])
        record.variants[kind] = {
            "model": stored.to_json(),
            "attempts": 1,
            "excluded": champion.excluded,
            "accuracy_passed": champion.accuracy_passed,
            "conversion": None,
            "agreement": None,
            "tuning": {
                "key": champion.candidate.key,
                "settings": champion.candidate.overrides(),
                "trials": len(result.trials),
                "seconds": round(result.seconds, 1),
                "mode": result.mode,
                "stopped": result.stopped,
                "signature": result.signature,
                "speedup_p50": champion.speedup,
                "against_recipe": result.against_recipe(),
            },
        }
        if state is not None:  # the champion is stored as the variant: the rest can go
            _clean_trials(ctx, store, state.kinds[kind].trials, champion.number)
    return fixed


KEEP_TRIALS_ENV = "GRAPHTRIM_KEEP_TRIALS"


def _clean_trials(
    ctx: StageContext, store: Any, trials: Sequence[Mapping[str, Any]], champion: int | None
) -> None:
    """Delete the stored models of a judged search's trials from the artifact store, all but
    the champion's (``champion``: its trial number; None: there is none), unless
    ``GRAPHTRIM_KEEP_TRIALS`` is set (to look at them). The champion's trial entry stays, so a
    retry of this stage judges it again and comes to the same champion. A trial model that
    cannot be deleted is a warning: the variant is built either way."""
    import os

    uris = sorted({t["uri"] for t in trials if t.get("uri") and t.get("number") != champion})
    if not uris:
        return
    if os.environ.get(KEEP_TRIALS_ENV, "").strip().lower() not in ("", "0", "false", "no"):
        ctx.say(f"quantize: {len(uris)} trial model(s) kept in the store ({KEEP_TRIALS_ENV})")
        return
    deleted = 0
    for uri in uris:
        try:
            deleted += bool(store.delete(uri))
        except GraphtrimError as exc:
            logger.warning("quantize: trial model %s not deleted: %s", uri, exc)
    ctx.say(f"quantize: {deleted} trial model(s) deleted from the store, the champion's kept")


def tune_job(item: Mapping[str, Any], **job: Any) -> Any:
    """One kind's settings search as a child process runs it (:mod:`graphtrim.isolation`):
    ``item`` holds the ``kind``, the memory's entry for this graph (``remembered``, or None)
    and where it is kept (``where``); ``job``: ``src`` (the optimized model, the search's
    reference too), ``out``, ``config``, ``calibration`` and ``data`` (:class:`EvalData`),
    ``policy``, ``device``, ``tensorrt``, ``budget`` (seconds). Returns (the
    :class:`~graphtrim.tune.search.TuneResult`, the entry to remember or None)."""
    from graphtrim.isolation import step
    from graphtrim.stages.context import parse_policy
    from graphtrim.tune.memory import HeldMemory
    from graphtrim.tune.search import TuneSettings, tune

    policy = job["policy"]
    if policy is None or isinstance(policy, Mapping):
        policy = parse_policy(policy)
    memory = HeldMemory(item["remembered"], item["where"])
    result = tune(
        job["src"],
        Path(job["out"]) / item["kind"],
        device=job["device"],
        policy=policy,
        data=job["data"],
        calibration=job["calibration"],
        config=job["config"],
        kinds=[item["kind"]],
        settings=TuneSettings(budget_s=job["budget"]),
        memory=memory,
        tensorrt=job["tensorrt"],
        progress=step,
    )
    return result, memory.remembered


def _log_trials(mlflow: Any, run_id: str, result: Any) -> None:
    """Each trial of a search as a child run of the pipeline's run: its settings as params,
    its numbers as metrics, its status and verdict as tags."""
    from graphtrim.stages.tracking import log_metrics, params

    experiment_id = mlflow.get_run(run_id).info.experiment_id
    champion = result.champion.number if result.champion is not None else None
    for trial in result.trials:
        timing = trial.timings[-1] if trial.timings else None
        tags = {
            "mlflow.parentRunId": run_id,
            "mlflow.runName": f"tune {trial.number}: {trial.candidate.key}"[:250],
            f"{T}tune.kind": trial.candidate.kind,
            f"{T}tune.status": trial.status,
            f"{T}tune.origin": trial.origin[:5000],
            f"{T}tune.champion": str(trial.number == champion).lower(),
        }
        if trial.verdict is not None:
            tags[f"{T}tune.verdict"] = json.dumps(trial.verdict, sort_keys=True)[:5000]
        if trial.error:
            tags[f"{T}tune.error"] = redact(trial.error)[:5000]
        child = mlflow.create_run(experiment_id, tags=tags).info.run_id
        settings = {f"tune.{k}": json.dumps(v) for k, v in trial.candidate.values().items()}
        mlflow.log_batch(child, params=params({"tune.kind": trial.candidate.kind, **settings}))
        log_metrics(
            mlflow,
            child,
            {
                "build_seconds": trial.build_s,
                "size_ratio": trial.size_ratio,
                "speedup_p50": timing[1] if timing else None,
                "timing_runs": timing[0] if timing else None,
                "timing_spread": timing[2] if timing else None,
                "excluded_nodes": len(trial.excluded),
                **{
                    f"accuracy.{k}": v
                    for k, v in trial.accuracy.items()
                    if isinstance(v, int | float) and not isinstance(v, bool)
                },
            },
        )
        mlflow.set_terminated(child, status="FINISHED" if trial.status != "failed" else "FAILED")
