"""The pipeline: the stages of :data:`~graphtrim.stages.STAGES`, composed in their order.

``export`` -> ``optimize`` -> ``quantize`` -> ``validate`` -> ``register`` -> ``promote``. Each
stage fetches what it needs from the artifact store, writes what it makes back under a
content-addressed key, logs into the pipeline's MLflow run and returns a small record
(:mod:`.records`). Any orchestrator can place each stage on its own worker; :func:`run_pipeline`
chains them in one process (the CLI, CI and the demo). :func:`build_and_evaluate` is the
quantize and validate stages' work on local files, in this process, with no registry or
tracking (``graphtrim variants``).

Retrying a stage is safe: the artifact keys are content hashes, the MLflow run is found again
by the orchestrator's run id, and a variant is registered at most once per source version and
config (its lineage key is looked up before anything is logged).

``pipeline.<stage>`` is the stage function of that name (``pipeline.export``, ...).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graphtrim.quantize.kinds import DEFAULT_VARIANTS
from graphtrim.stages import STAGE_NAMES, STAGES, stage
from graphtrim.stages.context import PipelineConfig, StageContext
from graphtrim.stages.records import Record

if TYPE_CHECKING:
    from graphtrim.gates.policy import GatePolicy
    from graphtrim.gates.verdicts import Evaluation
    from graphtrim.quantize.build import QuantizeConfig


def run_pipeline(ctx: StageContext, config: PipelineConfig, model_uri: str) -> dict[str, Record]:
    """All stages in order, in this process; returns every stage's record by stage name."""
    records: dict[str, Record] = {}
    for i, s in enumerate(STAGES, 1):
        args = [records[name] for name in s.args] if s.inputs else [model_uri]
        ctx.say(f"stage {i}/{len(STAGES)} {s.name}")
        started = time.perf_counter()
        records[s.name] = s.load()(ctx, config, *args)
        ctx.say(f"stage {i}/{len(STAGES)} {s.name} done in {time.perf_counter() - started:.1f} s")
        if not s.inputs:
            # the first stage resolved the config (its data files' hashes): the others take
            # it from its record, as when each stage runs apart
            config = PipelineConfig.from_json(records[s.name]["config"])
    return records


def __getattr__(name: str) -> Any:
    """``pipeline.<stage>``: the stage function of that name, as listed in ``STAGES``."""
    if name in STAGE_NAMES:
        return stage(name).load()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclasses.dataclass
class VariantsResult:
    """What :func:`build_and_evaluate` made: the evaluation, each built variant's file and the
    reports' files."""

    evaluation: Evaluation
    outputs: dict[str, Path]
    reports: dict[str, Path]

    @property
    def passed(self) -> list[str]:
        return self.evaluation.passed


def build_and_evaluate(
    source: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    variants: Sequence[str] = DEFAULT_VARIANTS,
    *,
    config: QuantizeConfig | None = None,
    calibration: str | os.PathLike[str] | None = None,
    eval_data: str | os.PathLike[str] | None = None,
    policy: GatePolicy | None = None,
    device: str = "cpu",
    tensorrt: bool = False,
    batch_size: int = 32,
    label_key: str = "labels",
    fallback: bool = True,
    progress: Callable[[str], None] | None = None,
) -> VariantsResult:
    """Build the requested variants of the local model ``source`` into ``out_dir`` and judge
    them all against it, in this process: the quantize stage's build (int8 and fp16 variants
    that fail their accuracy gate rebuilt with their most sensitive nodes in float) and the
    validate stage's gates, then the JSON, Markdown and HTML reports beside the variants."""
    from graphtrim.data import input_specs, load_npz, random_data
    from graphtrim.gates.policy import GatePolicy
    from graphtrim.quantize.build import VARIANTS, QuantizeError
    from graphtrim.runtime import providers_for
    from graphtrim.stages.quantize import build_variants
    from graphtrim.stages.validate import judge_variants

    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise QuantizeError(f"unknown variant(s) {', '.join(unknown)}: use {', '.join(VARIANTS)}")
    src = Path(source)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    policy = policy or GatePolicy()
    providers_for(device, tensorrt=tensorrt)  # a missing GPU is an error before any work
    specs = input_specs(src)
    calib = (
        load_npz(calibration, specs, batch_size=batch_size, label_key=label_key)
        if calibration is not None
        else None
    )
    if eval_data is not None:
        data = load_npz(eval_data, specs, batch_size=batch_size, label_key=label_key)
    elif calib is not None:
        data = calib
    else:
        data = random_data(specs, batches=8)
    builds, outputs, failed = build_variants(
        src,
        out,
        variants,
        config=config,
        calibration=calib,
        data=data,
        policy=policy,
        device=device,
        tensorrt=tensorrt,
        fallback=fallback,
        progress=progress,
    )
    evaluation = judge_variants(
        src,
        outputs,
        failed,
        variants,
        policy=policy,
        data=data,
        builds=builds,
        device=device,
        tensorrt=tensorrt,
        progress=progress,
    )
    reports = evaluation.write(out, stem=f"{src.stem}.evaluation")
    return VariantsResult(evaluation, outputs, reports)
