"""The promote stage: move aliases by the policy's ``promotion`` section (the policy itself:
:mod:`graphtrim.promotion`) and close the pipeline's MLflow run."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from graphtrim.stages.context import PipelineConfig, StageContext
from graphtrim.stages.records import PromoteRecord, RegisterRecord, ValidateRecord
from graphtrim.stages.tracking import T, stage_run, worker


def promote(
    ctx: StageContext,
    config: PipelineConfig,
    validated: ValidateRecord | Mapping[str, Any],
    registered: RegisterRecord | Mapping[str, Any],
) -> PromoteRecord:
    """Move aliases by the policy's ``promotion`` section (see :mod:`graphtrim.promotion`)."""
    from graphtrim.promotion import apply_policy

    reg = RegisterRecord.take(registered, ("run_id", "target", "registered"), "promote")
    val = ValidateRecord.from_json(validated)
    run_id = reg.run_id
    with stage_run(ctx, run_id, "promote", last=True) as client:
        result = apply_policy(
            ctx.registry(),
            config.gate_policy().promotion,
            target=reg.target,
            source=reg.source,
            validated=val.to_json(),
            registered=reg.registered,
            why=f"graphtrim pipeline run {run_id}",
            force=ctx.force_promotion,
        )
        client.log_dict(run_id, result, "graphtrim/promotion.json")
        champion = result.get("champion") or {}
        client.set_tag(run_id, T + "champion", json.dumps(champion, sort_keys=True)[:5000])
    return PromoteRecord(run_id=run_id, worker=worker(ctx), **result)
