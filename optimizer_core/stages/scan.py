"""Which registered versions still need a pipeline run under the current config.

A version is done when a pipeline run for it with the same config hash finished (whatever its
gates decided: a version whose variants all failed is not retried every scan) or is running
now, or when a variant of it with that config hash is registered.
"""

from __future__ import annotations

import re
from typing import Any

from optimizer_core.stages.context import DEFAULT_VARIANTS, PipelineConfig, StageContext

T = "graphtrim."


def _config_for(tags: dict[str, str]) -> PipelineConfig:
    variants = tuple(v.strip() for v in tags.get(T + "variants", "").split(",") if v.strip())
    return PipelineConfig(
        variants=variants or DEFAULT_VARIANTS,
        calibration=tags.get(T + "calibration") or None,
        eval_data=tags.get(T + "eval_data") or None,
    )


def run_key(name: str, version: str, config_hash: str) -> str:
    """The orchestrator run id for optimizing ``name`` v``version`` under a config: the same
    for every scan and every event, so a second trigger of the same work is refused by the
    orchestrator's own uniqueness (Airflow: one run id per DAG) instead of running twice."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-")[:120]
    return f"graphtrim__{safe}__v{version}__{config_hash[:16]}"


def conf_for(
    ctx: StageContext, name: str, version: str, tags: dict[str, str] | None = None
) -> dict[str, Any]:
    """The optimize run's conf for a version, from its registered model's ``graphtrim.*`` tags,
    with its ``run_key`` under ``run_id``."""
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
    return {"conf": conf, "run_id": run_key(name, str(version), config.config_hash)}


def _done(client: Any, name: str, version: str, config_hash: str, experiment: str) -> bool:
    registered = client.search_model_versions(
        f"tags.`{T}source.name` = '{name}' and tags.`{T}source.version` = '{version}' and "
        f"tags.`{T}config_hash` = '{config_hash}'"
    )
    if registered:
        return True
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return False
    runs = client.search_runs(
        [exp.experiment_id],
        f"tags.`{T}source.name` = '{name}' and tags.`{T}source.version` = '{version}' and "
        f"tags.`{T}config_hash` = '{config_hash}'",
    )
    return any(r.info.status in ("FINISHED", "RUNNING") for r in runs)


def unoptimized_versions(
    ctx: StageContext,
    *,
    watch_tag: str = "graphtrim.optimize",
    versions_per_model: int = 1,
    limit: int = 10,
) -> list[dict[str, Any]]:
    """``{"conf", "run_id"}`` of an optimize run for each of the newest source versions of
    watched models that are not done, at most ``limit``."""
    registry = ctx.registry()
    client = registry.client
    out: list[dict[str, Any]] = []
    for rm in client.search_registered_models(filter_string=f"tags.`{watch_tag}` = 'true'"):
        tags = dict(rm.tags or {})
        config = _config_for(tags).resolved(ctx)
        sources = sorted(
            (
                v
                for v in client.search_model_versions(f"name='{rm.name}'")
                if T + "variant" not in (v.tags or {})
            ),
            key=lambda v: int(v.version),
            reverse=True,
        )[:versions_per_model]
        for v in sources:
            if _done(client, rm.name, str(v.version), config.config_hash, config.experiment):
                continue
            out.append(conf_for(ctx, rm.name, str(v.version), tags))
            if len(out) >= limit:
                return out
    return out
