"""The optimize DAG's stage tasks, derived from ``graphtrim.stages.STAGES``, as the Kubeflow
pipeline's steps are (``graphtrim.kubeflow.pipeline``): adding a stage to the list adds its task.

Each stage becomes one task of its operator (:func:`stage_operator`), in the list's order. The
first stage takes the run's model URI; every other one takes the records its stage function
reads (``Stage.args``) as the outputs of those stages' tasks, which are also its upstreams. A
run of consecutive per-variant stages is one mapped chain: its first stage is mapped over the
run's variants (``.expand(variant=...)``), each one after it over the record of the stage before
it in the run, so one task instance per variant follows another; a later stage reads the records
of all of a mapped task's instances at once. The on-device stages are placed on the run's worker
class (queue, pool, GPU pod).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from graphtrim.airflow import operators
from graphtrim.airflow.operators import GraphtrimStageOperator
from graphtrim.airflow.placement import placement
from graphtrim.airflow.timeouts import task_timeout
from graphtrim.stages import record_arg, variant_loops

# the task ids that differ from their stage's name (the ones the UIs and run histories show)
TASK_IDS = {"validate": "gate"}


def task_id(stage_name: str) -> str:
    """The id of the task that runs the stage ``stage_name``."""
    return TASK_IDS.get(stage_name, stage_name)


def stage_operator(stage: Any) -> type[GraphtrimStageOperator]:
    """The operator class of ``stage`` (a :class:`~graphtrim.stages.Stage`): the named one
    in :mod:`graphtrim.airflow.operators` whose ``stage_name`` it is, else the generic operator
    with the stage named and its records (or the model URI) templated and taken by name."""
    for cls in vars(operators).values():
        if (
            isinstance(cls, type)
            and issubclass(cls, GraphtrimStageOperator)
            and cls.stage_name == stage.name
        ):
            return cls
    inputs = tuple(record_arg(n) for n in stage.args) if stage.inputs else ("model_uri",)
    # Airflow maps (partial / expand) over named arguments of __init__ only: the records that
    # the generic operator has no argument for are named in this one's signature
    taken = inspect.signature(GraphtrimStageOperator.__init__).parameters
    added = [a for a in inputs if a not in taken]

    def __init__(self: GraphtrimStageOperator, **kwargs: Any) -> None:
        GraphtrimStageOperator.__init__(self, **kwargs)

    __init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            *(inspect.Parameter(a, inspect.Parameter.KEYWORD_ONLY, default=None) for a in added),
            inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
        ]
    )
    name = "".join(part.title() for part in stage.name.split("_")) + "StageOperator"
    namespace = {
        "__doc__": f"The stage {stage.name!r}: {stage.summary}.",
        "__module__": __name__,
        "__init__": __init__,
        "stage_name": stage.name,
        "template_fields": (*GraphtrimStageOperator.template_fields, *inputs),
    }
    return type(name, (GraphtrimStageOperator,), namespace)


def stage_tasks(
    *,
    model_uri: Any,
    variants: Any,
    common: Mapping[str, Any],
    device: str = "cpu",
    pool: str | None = None,
    tune_pool: str | None = None,
    stages: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """Add a task per stage of ``stages`` (by default ``graphtrim.stages.STAGES``) to the
    DAG being defined, and return them by stage name.

    Args:
        model_uri: the source model's URI (the plan task's output), for the first stage.
        variants: the variants to map the first per-variant stage of a run over.
        common: the arguments every stage task takes (config, artifacts, flags).
        device: the worker class of the on-device stages (``cpu`` or ``gpu``).
        pool: the pool of the on-device stages, if any.
        tune_pool: the pool of the settings search's trial tasks (default: ``pool``).
        stages: the stages, in order.
    """
    if stages is None:
        from graphtrim.stages import STAGES

        stages = STAGES
    # spelled out for the mapped tasks: their queue and pod are read before any operator exists
    placed: dict[str, Any] = {"device": device, **placement(device)}
    if pool:
        placed["pool"] = pool
    tune_pool = tune_pool or pool
    loop = variant_loops(stages)
    tasks: dict[str, Any] = {}
    for s in stages:
        cls = stage_operator(s)
        tid = task_id(s.name)
        kwargs: dict[str, Any] = {"task_id": tid, "execution_timeout": task_timeout(tid)}
        if not s.inputs:
            kwargs["model_uri"] = model_uri
        # a record of the same mapped chain is mapped over, one instance per variant
        chained = [n for n in s.args if s.name in loop and loop.get(n) == loop[s.name]]
        if len(chained) > 1:
            raise ValueError(
                f"stage {s.name!r} reads more than one record of its mapped chain "
                f"({', '.join(chained)}): one task instance can be mapped over one only"
            )
        for n in s.args:
            if n not in chained:
                kwargs[record_arg(n)] = tasks[n].output
        kwargs.update(common)
        if s.on_device:
            kwargs.update(placed)
        if s.searched:
            kwargs["tuned"] = tune_tasks(
                records={n: tasks[n].output for n in s.inputs},
                common=common,
                placed=placed,
                pool=tune_pool,
            )
        if not s.per_variant:
            tasks[s.name] = cls(**kwargs)
        elif chained:
            (n,) = chained
            tasks[s.name] = cls.partial(**kwargs).expand(**{record_arg(n): tasks[n].output})
        else:
            tasks[s.name] = cls.partial(**kwargs).expand(variant=variants)
    return tasks


def tune_tasks(
    *,
    records: Mapping[str, Any],
    common: Mapping[str, Any],
    placed: Mapping[str, Any],
    pool: str | None = None,
    rounds: int | None = None,
) -> Any:
    """The settings search over the worker pool, as a task group ``tune``
    (:mod:`graphtrim.stages.tune`): ``plan``, then per round ``trial_<r>``, one task per trial
    of the round on the device's workers (under ``pool``), and ``select_<r>``, which chooses
    the next round. A round with no trial is skipped and its select passes the search on;
    without ``tune`` in the config every task after the plan ends at once. Returns the search
    the last select ends with, for the searched stage's ``tuned``."""
    from airflow.sdk import TaskGroup
    from graphtrim.airflow.tune_operators import (
        TunePlanOperator,
        TuneSelectOperator,
        TuneTrialOperator,
    )
    from graphtrim.tune.rounds import ROUNDS

    layers = rounds or ROUNDS
    inputs = {record_arg(n): v for n, v in records.items()}
    on_device = dict(placed)
    if pool:
        on_device["pool"] = pool
    with TaskGroup("tune", tooltip="the settings search, a task per trial"):
        step: Any = TunePlanOperator(
            task_id="plan",
            execution_timeout=task_timeout("tune"),
            rounds=layers,
            **inputs,
            **common,
        )
        for r in range(layers):
            trial = TuneTrialOperator.partial(
                task_id=f"trial_{r}",
                execution_timeout=task_timeout("tune"),
                map_index_template="{{ task.trial['number'] }} {{ task.trial['candidate']['key'] }}",
                **inputs,
                **common,
                **on_device,
            ).expand(trial=step.output)
            step = TuneSelectOperator(
                task_id=f"select_{r}",
                execution_timeout=task_timeout("tune"),
                search=step.output["search"],
                trials=trial.output,
                **common,
            )
    return step.output["search"]
