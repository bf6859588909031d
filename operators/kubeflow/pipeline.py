"""graphtrim on Kubeflow Pipelines (KFP v2): one container component per stage of
``graphtrim.stages.STAGES``, each running ``graphtrim pipeline stage`` in the graphtrim image,
and a pipeline mirroring the Airflow DAG ``graphtrim_optimize_model``: export -> optimize -> one
quantize / gate pair per variant (``ParallelFor``) -> register -> promote.

Every step is derived from its :class:`~graphtrim.stages.Stage`: the records it reads become
``--input NAME=RECORD`` arguments and the edges of the DAG; a per-variant stage runs inside a
``ParallelFor`` over the run's variants (the first of a run of them takes the loop's variant as
``--only``; the ones after it read that variant's records), and a later stage reads all of the
loop's records as one list (``dsl.Collected``). Adding a stage to ``STAGES`` adds its step.

Records travel as KFP output parameters (small JSON: URIs, versions, verdicts); models stay in
the artifact store (S3) under their content-addressed keys. A stage whose record carries reports
(the gates, the registration) also outputs a ``report`` (``HTML``: the variant's evaluation, the
run's comparison) and a ``metrics`` artifact (``Metrics``: the gate numbers, the versions
registered) for the KFP UI: its step runs ``graphtrim kfp step``, which writes them from the
record (:mod:`graphtrim.kubeflow.outputs`). Every step gets the MLflow and S3 credentials from a
Kubernetes Secret as environment variables (``CREDENTIALS``), each key optional.

The build steps are cached (their inputs, config included, are the cache key: same source, same
config, same result); the steps that write to the registry (register, promote) are never cached.
With ``device="gpu"`` the on-device steps (quantize, gate) ask for an NVIDIA GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import os
from collections.abc import Sequence
from typing import Any

from kfp import compiler, dsl, kubernetes

import graphtrim.stages
from graphtrim.kubeflow.outputs import METRICS, REPORT
from graphtrim.kubeflow.parameters import (
    CONFIG,
    MODEL,
    ONLY,
    TUNED,
    VARIANTS,
    RunParameter,
)
from graphtrim.stages import Stage, record_arg, variant_loops

DEFAULT_IMAGE = os.environ.get("GRAPHTRIM_IMAGE", "ghcr.io/graphtrim/graphtrim:0.1.0")

DEFAULT_SECRET = "graphtrim-credentials"
"""The Kubernetes Secret every step reads its credentials from, unless compiled with another."""

CREDENTIALS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
)
"""The Secret's keys a step gets as the environment variables of the same names (S3 through
boto3's chain, the tracking server through MLflow's): each optional, so a Secret holds those its
deployment needs and a step without the Secret runs with the pod's own identity."""

EXECUTOR_INPUT = "{{$}}"
"""KFP's placeholder for a step's executor input (where its outputs go, its output file)."""

# the names the KFP UI and run history show for a stage's step, where they differ from the stage's
STEP_NAMES = {"validate": "gate"}


TUNE_ROUNDS = 5
"""The rounds of the settings search the pipeline lays out (:data:`graphtrim.tune.rounds.ROUNDS`)."""

RECORD = "record"


def step_name(stage: Stage) -> str:
    """The name of ``stage``'s step: its component, task and display name."""
    return STEP_NAMES.get(stage.name, stage.name)


def collects(stages: Sequence[Stage], stage: Stage, name: str) -> bool:
    """Whether ``stage`` reads the records of all variants of the per-variant stage ``name`` as
    one list: it reads it from outside that stage's loop."""
    loop = variant_loops(stages)
    return name in loop and loop.get(stage.name) != loop[name]


def takes_variant(stages: Sequence[Stage], stage: Stage) -> bool:
    """Whether ``stage``'s step is given its variant (``--only``): a per-variant stage that reads
    no record of the same loop, which would carry just that variant already."""
    loop = variant_loops(stages)
    return stage.per_variant and not any(
        n in loop and loop[n] == loop[stage.name] for n in stage.inputs
    )


@functools.cache
def reports(stage: Stage) -> bool:
    """Whether ``stage``'s record carries reports: its step outputs them for the KFP UI."""
    if not stage.record:
        return False
    return any(f.name == "reports" for f in dataclasses.fields(stage.record_type()))


def _run_args(given: dict[str, Any], device: str) -> list[Any]:
    """The arguments every step ends with: the run's configuration, the device, the run id."""
    args: list[Any] = []
    for c in CONFIG:
        args += [c.flag, given[c.name]]
    return [
        *args,
        "--device",
        device,
        "--orchestrator-run-id",
        f"kfp:{dsl.PIPELINE_JOB_ID_PLACEHOLDER}",
        "-q",
    ]


def _container(
    name: str,
    params: Sequence[RunParameter],
    outputs: Sequence[tuple[str, Any]],
    args: Any,
) -> Any:
    """A container component called ``name`` with ``params`` (then ``CONFIG``) and
    ``outputs`` (name, KFP type); ``args(given)`` builds its command line."""
    names = [p.name for p in (*params, *CONFIG)] + [n for n, _ in outputs]

    def component(*values: Any) -> dsl.ContainerSpec:
        return args(dict(zip(names, values, strict=True)))

    component.__name__ = component.__qualname__ = name
    signature = inspect.Signature(
        [
            *(p.parameter(with_default=False) for p in (*params, *CONFIG)),
            *(
                inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=kind)
                for n, kind in outputs
            ),
        ],
        return_annotation=dsl.ContainerSpec,
    )
    setattr(component, "__signature__", signature)  # noqa: B010
    return dsl.container_component(component)


SEARCH, BATCH = "search", "batch"


def tune_components(image: str, device: str, rounds: int = TUNE_ROUNDS) -> dict[str, Any]:
    """The settings search's steps (``graphtrim pipeline tune plan|trial|select``): ``plan``
    and ``select`` output the search's state (``search``) and the next round (``batch``, a
    list of trials as JSON strings, what a ``ParallelFor`` maps ``trial`` over); ``trial``
    outputs its result (``record``)."""
    records = [RunParameter(record_arg(n), "--input", str) for n in ("export", "optimize")]

    def inputs(given: dict[str, Any]) -> list[Any]:
        out: list[Any] = []
        for p, n in zip(records, ("export", "optimize"), strict=True):
            out += ["--input", dsl.ConcatPlaceholder([f"{n}=", given[p.name]])]
        return out

    def run(step: str, given: dict[str, Any], *extra: Any) -> dsl.ContainerSpec:
        args = ["pipeline", "tune", step, *extra, *_run_args(given, device)]
        return dsl.ContainerSpec(image=image, command=["graphtrim"], args=args)

    state = [(SEARCH, dsl.OutputPath(str)), (BATCH, dsl.OutputPath(list))]
    trial = RunParameter("trial", "--trial", str)
    previous = RunParameter("previous", "--search", str)  # the state the round started from
    trials = RunParameter("trials", "--trials", list)
    return {
        "plan": _container(
            "tune-plan",
            records,
            state,
            lambda g: run(
                "plan",
                g,
                *inputs(g),
                "--rounds",
                str(rounds),
                "--search-output",
                g[SEARCH],
                "--batch",
                g[BATCH],
            ),
        ),
        "trial": _container(
            "tune-trial",
            [*records, trial],
            [(RECORD, dsl.OutputPath(str))],
            lambda g: run("trial", g, *inputs(g), "--trial", g["trial"], "--output", g[RECORD]),
        ),
        "select": _container(
            "tune-select",
            [previous, trials],
            state,
            lambda g: run(
                "select",
                g,
                "--search",
                g["previous"],
                "--trials",
                g["trials"],
                "--search-output",
                g[SEARCH],
                "--batch",
                g[BATCH],
            ),
        ),
    }


def stage_component(stages: Sequence[Stage], stage: Stage, image: str, device: str) -> Any:
    """The container component of ``stage``'s step in a pipeline of ``stages``: ``graphtrim
    pipeline stage NAME`` in ``image``, with the model (for the stage without inputs), a
    ``--input STAGE=RECORD`` per record it reads, its variant (``--only``), its output record
    and the run's configuration (``CONFIG``) with ``--device device``. A stage whose record
    carries reports runs as ``graphtrim kfp step --executor-input {{$}} NAME ...`` and outputs
    them as its ``report`` and ``metrics``."""
    inputs = {record_arg(n): n for n in stage.inputs}
    reporting = reports(stage)
    variant = takes_variant(stages, stage)
    params: list[RunParameter] = [MODEL] if not stage.inputs else []
    params += [
        RunParameter(p, "--input", list if collects(stages, stage, n) else str)
        for p, n in inputs.items()
    ]
    if variant:
        params.append(ONLY)
    if stage.searched:
        params.append(TUNED)
    params += CONFIG
    names = [p.name for p in params] + [RECORD] + ([REPORT, METRICS] if reporting else [])

    def component(*values: Any) -> dsl.ContainerSpec:
        given = dict(zip(names, values, strict=True))
        args: list[Any] = ["pipeline", "stage", stage.name]
        if reporting:
            args = ["kfp", "step", "--executor-input", EXECUTOR_INPUT, stage.name]
        if not stage.inputs:
            args += [MODEL.flag, given[MODEL.name]]
        for p, n in inputs.items():
            args += ["--input", dsl.ConcatPlaceholder([f"{n}=", given[p]])]
        if variant:
            args += [ONLY.flag, given[ONLY.name]]
        if stage.searched:
            args += [TUNED.flag, given[TUNED.name]]
        args += ["--output", given[RECORD]]
        return dsl.ContainerSpec(
            image=image, command=["graphtrim"], args=args + _run_args(given, device)
        )

    # KFP reads the component's name and parameters from the function
    component.__name__ = component.__qualname__ = step_name(stage)
    output = inspect.Parameter(
        RECORD, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=dsl.OutputPath(str)
    )
    outputs = [output]
    if reporting:
        outputs += [
            inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=kind)
            for n, kind in ((REPORT, dsl.Output[dsl.HTML]), (METRICS, dsl.Output[dsl.Metrics]))
        ]
    signature = inspect.Signature(
        [*(p.parameter(with_default=False) for p in params), *outputs],
        return_annotation=dsl.ContainerSpec,
    )
    setattr(component, "__signature__", signature)  # noqa: B010
    return dsl.container_component(component)


def build_pipeline(
    image: str = DEFAULT_IMAGE,
    device: str = "cpu",
    retries: int = 2,
    credentials_secret: str | None = DEFAULT_SECRET,
) -> Any:
    """The pipeline function for ``image``: a step per stage of ``STAGES``, its on-device steps on
    ``device``, each with the keys of ``credentials_secret`` (none: no Secret) as its
    environment."""
    if device not in ("cpu", "gpu"):
        raise ValueError(f"device must be 'cpu' or 'gpu', not {device!r}")
    stages = graphtrim.stages.STAGES
    components = {s.name: stage_component(stages, s, image, device) for s in stages}
    tuning = tune_components(image, device)
    loop = variant_loops(stages)
    params = [MODEL, *CONFIG]

    def add_step(stage: Stage, run: dict[str, Any], tasks: dict[str, Any], variant: Any) -> None:
        kwargs: dict[str, Any] = {p.name: run[p.name] for p in CONFIG}
        if not stage.inputs:
            kwargs[MODEL.name] = run[MODEL.name]
        for n in stage.inputs:
            record = tasks[n].outputs[RECORD]
            kwargs[record_arg(n)] = dsl.Collected(record) if collects(stages, stage, n) else record
        if takes_variant(stages, stage):
            kwargs[ONLY.name] = variant
        if stage.searched:
            kwargs[TUNED.name] = tasks[TUNED.name].outputs[SEARCH]
        task = components[stage.name](**kwargs).set_display_name(step_name(stage))
        # the build steps' inputs (the config included) are their cache key; the steps that
        # write to the registry are never served from a cache
        place(task, on_device=stage.on_device, cached=not stage.writes_registry)
        tasks[stage.name] = task

    def place(task: Any, *, on_device: bool, cached: bool) -> None:
        if on_device:
            if device == "gpu":
                task.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(1)
            task.set_cpu_request("2").set_memory_request("8G")
        task.set_caching_options(cached)
        task.set_retry(num_retries=retries, backoff_duration="30s")
        if credentials_secret:
            kubernetes.use_secret_as_env(
                task, credentials_secret, {k: k for k in CREDENTIALS}, optional=True
            )

    def add_search(run: dict[str, Any], tasks: dict[str, Any]) -> None:
        """The settings search before a searched stage: a plan, then per round a trial step
        per trial (``ParallelFor``) and a select on their records (``dsl.Collected``). Never
        cached: a search's rounds run against its own clock."""
        config = {p.name: run[p.name] for p in CONFIG}
        records = {record_arg(n): tasks[n].outputs[RECORD] for n in ("export", "optimize")}
        step = tuning["plan"](**records, **config).set_display_name("tune-plan")
        place(step, on_device=False, cached=False)
        for r in range(TUNE_ROUNDS):
            with dsl.ParallelFor(step.outputs[BATCH]) as trial:
                one = tuning["trial"](**records, trial=trial, **config)
                one.set_display_name(f"tune-trial-{r}")
                place(one, on_device=True, cached=False)
            nxt = tuning["select"](
                previous=step.outputs[SEARCH],
                trials=dsl.Collected(one.outputs[RECORD]),
                **config,
            ).set_display_name(f"tune-select-{r}")
            place(nxt, on_device=False, cached=False)
            step = nxt
        tasks[TUNED.name] = step

    def optimize_model(*values: Any) -> None:
        run = dict(zip([p.name for p in params], values, strict=True))
        tasks: dict[str, Any] = {}
        for in_loop, group in itertools.groupby(stages, key=lambda s: loop.get(s.name)):
            if in_loop is None:
                for s in group:
                    add_step(s, run, tasks, None)
                continue
            members = list(group)
            if any(s.searched for s in members):
                add_search(run, tasks)
            with dsl.ParallelFor(run[VARIANTS.name]) as variant:
                for s in members:
                    add_step(s, run, tasks, variant)

    signature = inspect.Signature([p.parameter() for p in params], return_annotation=None)
    setattr(optimize_model, "__signature__", signature)  # noqa: B010
    return dsl.pipeline(
        name=f"graphtrim-optimize-model{'-gpu' if device == 'gpu' else ''}",
        description="graphtrim: export, optimize, build and gate variants, register, promote",
    )(optimize_model)


def compile_pipeline(
    output: str | os.PathLike[str],
    *,
    image: str = DEFAULT_IMAGE,
    device: str = "cpu",
    credentials_secret: str | None = DEFAULT_SECRET,
) -> str:
    """Compile the pipeline to a KFP v2 YAML file, offline."""
    pipeline = build_pipeline(image, device, credentials_secret=credentials_secret)
    compiler.Compiler().compile(pipeline, str(output))
    return str(output)
