"""Which registered versions still need a pipeline run under the current config.

A version is done when a variant of it with that config hash is registered, or a pipeline run
for it with the same config hash finished (whatever its gates decided: a version whose
variants all failed is not retried every scan), or such a run is alive. A run that FAILED or
was KILLED is retried; so is one still RUNNING whose stage process is gone (the orchestrator's
task instance it recorded no longer runs, or, where the orchestrator cannot tell, it ran on this
host and its pid is no longer there) or that started longer ago than ``stale_after`` seconds
(``$GRAPHTRIM_SCAN_STALE_HOURS``, 6 hours): a crashed process never ends its MLflow run. Each
retry gets a new run id (``run_key`` with the number of attempts that did not finish), so the
orchestrator does not refuse it as the run that already happened.

Versions that graphtrim registered itself (its variants) are not sources: they are skipped,
with one log line each, unless ``allow_variant_source``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from collections.abc import Mapping
from typing import Any

from graphtrim.stages.context import DEFAULT_VARIANTS, PipelineConfig, StageContext, TaskStateFn

T = "graphtrim."
STALE_ENV = "GRAPHTRIM_SCAN_STALE_HOURS"
DEFAULT_STALE_HOURS = 6.0

logger = logging.getLogger("graphtrim.scan")


def variant_skip_message(
    name: str, version: str, tags: Mapping[str, str] | None, *, switch: str
) -> str | None:
    """The one log line saying why a version is skipped as a graphtrim output (a variant
    graphtrim registered), or None for a source version. ``switch`` names what would let it
    through."""
    from graphtrim.integrations.registry import KEY_TAG, VARIANT_TAG, is_graphtrim_output

    if not is_graphtrim_output(tags):
        return None
    tags = dict(tags or {})
    what = (
        f"{VARIANT_TAG}={tags[VARIANT_TAG]}"
        if VARIANT_TAG in tags
        else f"{KEY_TAG}={tags[KEY_TAG]}"
    )
    return f"skipping {name} v{version}: a graphtrim variant ({what}); {switch} to optimize it"


def _config_for(tags: dict[str, str]) -> PipelineConfig:
    variants = tuple(v.strip() for v in tags.get(T + "variants", "").split(",") if v.strip())
    return PipelineConfig(
        variants=variants or DEFAULT_VARIANTS,
        calibration=tags.get(T + "calibration") or None,
        eval_data=tags.get(T + "eval_data") or None,
    )


def run_key(name: str, version: str, config_hash: str, attempt: int = 0) -> str:
    """The orchestrator run id for optimizing ``name`` v``version`` under a config: the same
    for every scan and every event, so a second trigger of the same work is refused by the
    orchestrator's own uniqueness (Airflow: one run id per DAG) instead of running twice.
    ``attempt`` counts the earlier runs of that work that did not finish: a retry is new work."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-")[:120]
    key = f"graphtrim__{safe}__v{version}__{config_hash[:16]}"
    return f"{key}__r{attempt}" if attempt else key


def conf_for(
    ctx: StageContext,
    name: str,
    version: str,
    tags: dict[str, str] | None = None,
    *,
    attempt: int = 0,
) -> dict[str, Any]:
    """The optimize run's conf for a version, from its registered model's ``graphtrim.*`` tags,
    with its ``run_key`` (for attempt ``attempt``) under ``run_id``."""
    if tags is None:
        tags = dict(ctx.registry().client.get_registered_model(name).tags or {})
    config = _config_for(tags).resolved(ctx)
    conf: dict[str, Any] = {
        "model_name": name,
        "version": str(version),
        "variants": list(config.variants),
    }
    if config.calibration:
        conf["calibration"] = config.calibration
    if config.eval_data:
        conf["eval_data"] = config.eval_data
    return {"conf": conf, "run_id": run_key(name, str(version), config.config_hash, attempt)}


def stale_after_default() -> float:
    """Seconds after which a run still RUNNING counts as abandoned: ``$GRAPHTRIM_SCAN_STALE_HOURS``
    (hours), 6 hours without it."""
    raw = os.environ.get(STALE_ENV, "").strip()
    try:
        hours = float(raw) if raw else DEFAULT_STALE_HOURS
    except ValueError as exc:
        raise ValueError(f"${STALE_ENV} must be a number of hours, not {raw!r}") from exc
    return hours * 3600.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _stages_in_progress(tags: Mapping[str, str]) -> list[dict[str, Any]]:
    """Where the stages of a run that started and did not end are running: each stage writes
    ``graphtrim.worker.<label>`` (host, pid) when it starts and ``graphtrim.seconds.<label>``
    when it ends."""
    out = []
    for key, value in tags.items():
        if not key.startswith(T + "worker."):
            continue
        label = key[len(T + "worker.") :]
        if T + "seconds." + label in tags:
            continue
        try:
            doc = json.loads(value)
        except ValueError:
            continue
        if isinstance(doc, dict):
            out.append(doc)
    return out


# the orchestrator's states of a task instance that no longer runs (Airflow's names)
ENDED_STATES = frozenset(
    {"success", "failed", "up_for_retry", "upstream_failed", "skipped", "removed"}
)


def dead_stages(tags: Mapping[str, str], task_state: TaskStateFn | None = None) -> str | None:
    """Why a run's stage processes are known to be gone, or None: every stage it started and
    did not end is, by the orchestrator's own state of the task instance the stage recorded
    (``task_state``, on any host), a task that no longer runs; or, where the orchestrator
    cannot tell, it ran on this host in a process that no longer exists. Between two stages,
    with none in progress, nothing is known to be dead."""
    host = socket.gethostname()
    started = _stages_in_progress(tags)
    if not started:
        return None
    if task_state is not None:
        states = [_task_state(w, task_state) for w in started]
        if all(state is not None for state in states):
            if not all(state in ENDED_STATES for state in states):
                return None  # a stage's task runs (or waits to): the run is alive
            return "; ".join(
                f"its task {_task_name(w)} is {state} in {w['orchestrator']['name']}"
                for w, state in zip(started, states, strict=True)
            )
    if all(
        w.get("host") == host
        and isinstance(w.get("pid"), int)
        and w["pid"] != os.getpid()
        and not _alive(w["pid"])
        for w in started
    ):
        pids = ", ".join(str(w["pid"]) for w in started)
        return f"its stage process ({pids} on {host}) is gone"
    return None


def _task_state(worker: Mapping[str, Any], task_state: TaskStateFn) -> str | None:
    """The orchestrator's state of the task instance ``worker`` recorded (lower case), or
    None: none recorded, or the orchestrator cannot say."""
    if not isinstance(worker.get("orchestrator"), Mapping):
        return None
    try:
        state = task_state(worker)
    except Exception as exc:  # the orchestrator cannot be asked: fall back to the pid
        logger.info("task state of %s unknown: %s", _task_name(worker), exc)
        return None
    return None if state is None else str(state).rsplit(".", 1)[-1].lower()


def _task_name(worker: Mapping[str, Any]) -> str:
    ti = worker.get("orchestrator") or {}
    index = ti.get("map_index", -1)
    where = f"{ti.get('dag_id')}/{ti.get('run_id')}/{ti.get('task_id')}"
    return where + (f"[{index}]" if isinstance(index, int) and index >= 0 else "")


def abandoned(
    run: Any,
    *,
    stale_after: float,
    now: float | None = None,
    task_state: TaskStateFn | None = None,
) -> str | None:
    """Why a run still RUNNING (or SCHEDULED) is abandoned, or None while it may be alive:
    its stage processes are gone (:func:`dead_stages`), or it started more than
    ``stale_after`` seconds ago."""
    if run.info.status not in ("RUNNING", "SCHEDULED") or run.info.end_time:
        return None
    dead = dead_stages(dict(run.data.tags or {}), task_state)
    if dead is not None:
        return dead
    now = time.time() if now is None else now
    age = now - (run.info.start_time or 0) / 1000.0
    if age > stale_after:
        return f"RUNNING for {age / 3600:.1f} h, over the {stale_after / 3600:.1f} h staleness"
    return None


def _done(
    client: Any,
    name: str,
    version: str,
    config_hash: str,
    experiment: str,
    *,
    stale_after: float,
    task_state: TaskStateFn | None = None,
) -> tuple[bool, int]:
    """Whether ``name`` v``version`` needs no run under ``config_hash``, and how many runs of
    that work ended without finishing (FAILED, KILLED, abandoned)."""
    registered = client.search_model_versions(
        f"tags.`{T}source.name` = '{name}' and tags.`{T}source.version` = '{version}' and "
        f"tags.`{T}config_hash` = '{config_hash}'"
    )
    if registered:
        return True, 0
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return False, 0
    runs = client.search_runs(
        [exp.experiment_id],
        f"tags.`{T}source.name` = '{name}' and tags.`{T}source.version` = '{version}' and "
        f"tags.`{T}config_hash` = '{config_hash}'",
    )
    failed = 0
    live = False
    for r in runs:
        status = r.info.status
        if status == "FINISHED":
            return True, 0
        if status in ("RUNNING", "SCHEDULED"):
            why = abandoned(r, stale_after=stale_after, task_state=task_state)
            if why is None:
                live = True
                continue
            logger.info("%s v%s: run %s is abandoned (%s)", name, version, r.info.run_id, why)
        failed += 1  # FAILED, KILLED, abandoned
    return live, failed


def unoptimized_versions(
    ctx: StageContext,
    *,
    watch_tag: str = "graphtrim.optimize",
    versions_per_model: int = 1,
    limit: int = 10,
    allow_variant_source: bool = False,
    stale_after: float | None = None,
) -> list[dict[str, Any]]:
    """``{"conf", "run_id"}`` of an optimize run for each of the newest source versions of
    watched models that are not done, at most ``limit``. Versions graphtrim registered (its
    variants) are skipped unless ``allow_variant_source``; a run still RUNNING counts as
    abandoned after ``stale_after`` seconds (default: :func:`stale_after_default`)."""
    stale = stale_after_default() if stale_after is None else float(stale_after)
    registry = ctx.registry()
    client = registry.client
    out: list[dict[str, Any]] = []
    for rm in client.search_registered_models(filter_string=f"tags.`{watch_tag}` = 'true'"):
        tags = dict(rm.tags or {})
        config = _config_for(tags).resolved(ctx)
        sources: list[tuple[Any, bool]] = []  # (version, a graphtrim variant)
        for v in sorted(
            client.search_model_versions(f"name='{rm.name}'"),
            key=lambda v: int(v.version),
            reverse=True,
        ):
            skip = variant_skip_message(
                rm.name, str(v.version), v.tags, switch="allow_variant_source=True"
            )
            if skip is None or allow_variant_source:
                sources.append((v, skip is not None))
            else:
                logger.info(skip)
            if len(sources) >= versions_per_model:
                break
        for v, variant in sources:
            done, attempt = _done(
                client,
                rm.name,
                str(v.version),
                config.config_hash,
                config.experiment,
                stale_after=stale,
                task_state=ctx.task_state,
            )
            if done:
                continue
            if attempt:
                logger.info("retrying %s v%s: attempt %d", rm.name, v.version, attempt + 1)
            found = conf_for(ctx, rm.name, str(v.version), tags, attempt=attempt)
            if variant:  # let through on purpose: the export stage must take it too
                found["conf"]["allow_variant_source"] = True
            out.append(found)
            if len(out) >= limit:
                return out
    return out
