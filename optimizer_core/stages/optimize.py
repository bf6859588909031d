"""The optimize stage: the graph optimizer on the exported model, verified against it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from graphtrim.stages.context import DataFiles, PipelineConfig, StageContext
from graphtrim.stages.records import ExportRecord, OptimizeRecord
from graphtrim.stages.tracking import log_metrics, stage_run, worker


def optimize(
    ctx: StageContext, config: PipelineConfig, exported: ExportRecord | Any
) -> OptimizeRecord:
    """Run the graph optimizer (verified against the export) and store the result.

    The verification runs on the config's evaluation data (else its calibration data) where
    it names a file: three batches of up to four samples, of the inputs the model will be
    judged on. Without either it runs on seeded random inputs."""
    with ctx.scratch("optimize") as tmp:
        return _optimize(ctx, config, exported, tmp)


def _optimize(
    ctx: StageContext, config: PipelineConfig, exported: ExportRecord | Any, tmp: Path
) -> OptimizeRecord:
    from graphtrim.data import load_feeds
    from graphtrim.graph.framework import OptimizeOptions
    from graphtrim.graph.presets import PRESETS
    from graphtrim.optimize_file import optimize_file
    from graphtrim.verify import declared_input_specs

    data = DataFiles(ctx, config, tmp / "data")  # fetched once: hashed, then loaded
    config = config.resolved(ctx, data)
    exp = ExportRecord.take(exported, ("run_id", "source", "model"), "optimize")
    run_id = exp.run_id
    source = exp.source
    if exp.model is None:  # every variant judged before: nothing to optimize
        return OptimizeRecord(
            worker=worker(ctx),
            run_id=run_id,
            source=source,
            model=None,
            preset=config.preset,
            passes=[],
            changed=[],
            nodes_before=None,
            nodes_after=None,
        )
    store = ctx.store()
    with stage_run(ctx, run_id, "optimize") as mlflow:
        src = ctx.fetch(exp.model["uri"], tmp / "in")
        dst = tmp / "out" / "model.onnx"
        key = next((k for k in ("eval_data", "calibration") if data.has(k)), None)
        feeds = (
            None
            if key is None
            else load_feeds(data.path(key), declared_input_specs(src), limit=3, batch_size=4)
        )
        report = optimize_file(
            src,
            dst,
            preset=config.preset,
            options=OptimizeOptions(target_opset=config.opset),
            check=True,
            inputs=feeds,
            progress=ctx.progress,
        )
        stored = store.put_model(
            dst,
            model=source["name"],
            version=source["version"],
            stage="optimize",
            parents=[exp.model["sha256"]],
            config_hash=config.hash_for("preset", "opset"),
            extra={"preset": config.preset, **({"opset": config.opset} if config.opset else {})},
        )
        doc = report.to_json()
        mlflow.log_dict(run_id, doc, "graphtrim/optimize.json")
        changed = [
            name
            for name, agg in report.log.per_pass().items()
            if agg["nodes_removed"] or agg["nodes_added"] or agg["rules"]
        ]
        log_metrics(
            mlflow,
            run_id,
            {
                "nodes_before": report.before.nodes,
                "nodes_after": report.after.nodes,
                "optimize.seconds": report.seconds,
                "optimize.bytes": report.after.file_bytes,
            },
        )
    return OptimizeRecord(
        worker=worker(ctx),
        run_id=run_id,
        source=source,
        model=stored.to_json(),
        preset=config.preset,
        passes=list(report.log.passes or PRESETS[config.preset]),
        changed=changed,
        nodes_before=report.before.nodes,
        nodes_after=report.after.nodes,
    )
