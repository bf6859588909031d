"""The pipeline's stages as Airflow operators, derived from ``graphtrim.stages.STAGES``: one
generic operator (:class:`GraphtrimStageOperator`) templates a stage's inputs, places itself on
a CPU or GPU worker and calls the stage function the list names; its XCom is the stage's small
JSON record (URIs, versions, verdicts), never a model. The operator per stage
(:class:`MlflowModelExportOperator`, ...) is that operator with its stage and inputs named.

Placement: ``device="gpu"`` sends the task to the Celery queue ``gpu_queue`` (default ``gpu``)
and, for the KubernetesExecutor, adds a ``pod_override`` asking for ``gpus`` ``nvidia.com/gpu``
on the ``base`` container; ``device="cpu"`` uses ``cpu_queue`` when given, else the default
queue (:func:`graphtrim.airflow.placement.placement`). The stage itself runs on the device its
pipeline config names.

A crash inside a stage (a segmentation fault in onnxruntime, an abort in a native library) ends
the task process at once, with the Python stack of every thread in the task log, so that
Airflow marks the task failed: see :func:`fatal_signals_end_the_process`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from airflow.sdk import BaseOperator
from graphtrim.airflow.context import (
    airflow_task_state,
    artifact_store,
    stage_context,
    task_instance,
)
from graphtrim.airflow.hooks import ArtifactStoreHook, MlflowRegistryHook
from graphtrim.airflow.links import EXTRA_LINKS
from graphtrim.airflow.params import as_flag
from graphtrim.airflow.placement import (
    placement,
)
from graphtrim.airflow.signals import fatal_signals_end_the_process
from graphtrim.errors import GraphtrimError
from graphtrim.lazy import lazy_attributes
from graphtrim.redact import redact
from graphtrim.stages import record_arg

logger = logging.getLogger(__name__)


class GraphtrimStageOperator(BaseOperator):
    """Run the pipeline stage ``stage`` (a name in ``graphtrim.stages.STAGES``; the
    operator per stage sets it): its inputs are the records of the stages the list names, given
    as ``exported``, ``optimized``, ``quantized``, ``validated`` (one record, or the records of
    a mapped task, merged) and ``registered``, or the argument :func:`record_arg` names for the
    record of a stage added since; the first stage takes ``model_uri``. XCom: the stage's record
    as JSON.

    Shared plumbing: connections, artifact location, config, placement.
    ``allow_variant_source`` lets the export stage take a version graphtrim registered itself
    (a variant) as its source; it is refused otherwise. ``rejudge`` builds and measures again
    the variants earlier runs judged under the same config (by default they are reported as
    recorded); ``force_promotion`` moves the champion even where a person holds it."""

    template_fields: Sequence[str] = (
        "config",
        "artifacts",
        "allow_variant_source",
        "rejudge",
        "force_promotion",
    )
    ui_color = "#e8f4ea"
    stage_name: ClassVar[str | None] = None
    operator_extra_links = EXTRA_LINKS

    def __init__(
        self,
        *,
        stage: str | None = None,
        model_uri: str | None = None,
        exported: Any = None,
        optimized: Any = None,
        quantized: Any = None,
        validated: Any = None,
        registered: Any = None,
        config: Mapping[str, Any] | None = None,
        artifacts: str | None = None,
        mlflow_conn_id: str = MlflowRegistryHook.default_conn_name,
        aws_conn_id: str | None = ArtifactStoreHook.default_conn_name,
        device: str = "cpu",
        gpu_queue: str = "gpu",
        cpu_queue: str | None = None,
        gpus: int = 1,
        workdir: str | None = None,
        allow_variant_source: Any = False,
        rejudge: Any = False,
        force_promotion: Any = False,
        **kwargs: Any,
    ):
        for key, value in placement(
            device, gpu_queue=gpu_queue, cpu_queue=cpu_queue, gpus=gpus
        ).items():
            kwargs.setdefault(key, value)
        # the records of the stages that have no argument above, by their name (record_arg)
        records = {k: kwargs.pop(k) for k in list(kwargs) if k in _record_args()}
        super().__init__(**kwargs)
        for key, value in records.items():
            setattr(self, key, value)
        self.stage = stage or self.stage_name
        self.model_uri = model_uri
        self.exported = exported
        self.optimized = optimized
        self.quantized = quantized
        self.validated = validated
        self.registered = registered
        self.config = config
        self.artifacts = artifacts
        self.mlflow_conn_id = mlflow_conn_id
        self.aws_conn_id = aws_conn_id
        self.device = device
        self.workdir = workdir
        self.allow_variant_source = allow_variant_source
        self.rejudge = rejudge
        self.force_promotion = force_promotion

    def stage_context(self, context: Any) -> Any:
        dag_run = context.get("dag_run")
        run_id = getattr(dag_run, "run_id", None) or context.get("run_id")
        return stage_context(
            artifact_store(self.artifacts, self.task_id),
            mlflow_conn_id=self.mlflow_conn_id,
            aws_conn_id=self.aws_conn_id,
            workdir=self.workdir,
            orchestrator_run_id=f"airflow:{self.dag_id}:{run_id}" if run_id else None,
            progress=self.log.info,
            worker={
                "queue": self.queue,
                "task": self.task_id,
                "device": self.device,
                "orchestrator": task_instance(context),
            },
            task_state=airflow_task_state,
            allow_variant_source=as_flag(self.allow_variant_source),
            rejudge=as_flag(self.rejudge),
            force_promotion=as_flag(self.force_promotion),
        )

    def delegate(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a stage; an error that a retry cannot fix (a missing model version, a bad
        config, an unusable model) fails the task at once instead of using up its retries. A
        crash (a fatal signal) ends the task process, so Airflow fails the task (see
        :func:`fatal_signals_end_the_process`)."""
        from airflow.sdk.exceptions import AirflowFailException

        try:
            with fatal_signals_end_the_process():
                return fn(*args, **kwargs)
        except GraphtrimError as exc:
            if exc.transient:
                raise
            raise AirflowFailException(redact(f"{type(exc).__name__}: {exc}")) from exc

    def pipeline_config(self) -> Any:
        from graphtrim.stages.context import PipelineConfig

        return PipelineConfig.from_json(dict(self.config or {}))

    def stage_input(self, name: str) -> Any:
        """The record of the stage ``name`` this task was given (the validate records of a
        mapped task merged into one)."""
        value: Any = getattr(self, record_arg(name), None)
        if name == "validate":
            from graphtrim.stages.records import ValidateRecord

            return ValidateRecord.merge(_records(value))
        return dict(value)

    def stage_options(self) -> dict[str, Any]:
        """Keyword arguments of the stage function beyond its records."""
        return {}

    def execute(self, context: Any) -> dict[str, Any]:
        from graphtrim.stages import stage

        if self.stage is None:
            raise GraphtrimError(f"{self.task_id}: no stage: pass stage= (a pipeline stage name)")
        step = stage(self.stage)
        args = [self.model_uri] if not step.inputs else [self.stage_input(n) for n in step.args]
        record = self.delegate(
            step.load(),
            self.stage_context(context),
            self.pipeline_config(),
            *args,
            **self.stage_options(),
        )
        doc = dict(record.to_json())
        self.graphtrim_links = self.links(doc)
        for alias, asset, extra in self.asset_events(doc):
            context["outlet_events"][alias].add(asset, extra=extra)
        return doc

    def asset_events(self, record: Mapping[str, Any]) -> list[tuple[Any, Any, dict[str, Any]]]:
        """(asset alias among this task's outlets, asset, extra) per event the stage's record
        calls for (:mod:`.assets`); none by default."""
        return []

    def links(self, record: Mapping[str, Any]) -> dict[str, str]:
        """The MLflow UI addresses of what the stage made (:mod:`.links`); never fails the
        task: a link that cannot be worked out is left disabled."""
        from graphtrim.integrations.links import record_links

        try:
            hook = MlflowRegistryHook(self.mlflow_conn_id)
            base = hook.ui_url()
            experiment = None
            if base and (record.get("reports") or {}).get("html") and record.get("run_id"):
                run = hook.get_client().get_run(record["run_id"])
                experiment = run.info.experiment_id
            return record_links(base, record, experiment_id=experiment)
        except Exception as exc:
            self.log.warning("graphtrim: no MLflow links for this task: %s", redact(exc))
            return {}


def _record_args() -> set[str]:
    """The operator arguments of the records of every stage in the list."""
    from graphtrim.stages import STAGES

    return {record_arg(s.name) for s in STAGES}


def _records(value: Any) -> list[dict[str, Any]]:
    """A record, or the records of a mapped upstream (a lazy XCom sequence), as a list."""
    if isinstance(value, Mapping):
        return [dict(value)]
    # index, not iterate: iterating a lazy XCom sequence probes one past its end
    return [dict(value[i]) for i in range(len(value)) if value[i]]


class MlflowModelExportOperator(GraphtrimStageOperator):
    """Resolve ``model_uri`` (``models:/NAME/VERSION`` or ``models:/NAME@ALIAS``) and store it as
    ONNX. XCom: the export record (source, run id, model URI, exporter, resolved config)."""

    stage_name = "export"
    template_fields = (*GraphtrimStageOperator.template_fields, "model_uri")

    def __init__(self, *, model_uri: str, **kwargs: Any):
        super().__init__(model_uri=model_uri, **kwargs)


class GraphOptimizeOperator(GraphtrimStageOperator):
    """Optimize the exported model's graph (verified). XCom: the optimize record."""

    stage_name = "optimize"
    template_fields = (*GraphtrimStageOperator.template_fields, "exported")

    def __init__(self, *, exported: Any, **kwargs: Any):
        super().__init__(exported=exported, **kwargs)


class ModelQuantizeOperator(GraphtrimStageOperator):
    """Build one variant (``variant``; map it over the config's variants) or all of them;
    ``tuned``: the settings search the tune tasks ran over the worker pool (the last select
    task's ``search`` XCom), whose best trials this task judges."""

    stage_name = "quantize"
    template_fields = (
        *GraphtrimStageOperator.template_fields,
        "exported",
        "optimized",
        "variant",
        "tuned",
    )

    def __init__(
        self,
        *,
        exported: Any,
        optimized: Any,
        variant: str | None = None,
        tuned: Any = None,
        **kwargs: Any,
    ):
        super().__init__(exported=exported, optimized=optimized, **kwargs)
        self.variant = variant
        self.tuned = tuned

    def stage_options(self) -> dict[str, Any]:
        return {
            "only": [self.variant] if self.variant else None,
            "tuned": dict(self.tuned) if self.tuned else None,
        }


class ModelGateOperator(GraphtrimStageOperator):
    """Run the accuracy, latency and size gates on the variant(s) of a quantize record, on the
    worker class this task is placed on. XCom: the validate record."""

    stage_name = "validate"
    template_fields = (*GraphtrimStageOperator.template_fields, "exported", "quantized")

    def __init__(self, *, exported: Any, quantized: Any, **kwargs: Any):
        super().__init__(exported=exported, quantized=quantized, **kwargs)


class MlflowVariantRegisterOperator(GraphtrimStageOperator):
    """Register every variant that passed its gates (one or many validate records) with lineage;
    a variant registered before for the same source and config is reported, not registered
    again; an Asset event per version created. XCom: the register record."""

    stage_name = "register"
    template_fields = (*GraphtrimStageOperator.template_fields, "optimized", "validated")

    def __init__(self, *, optimized: Any, validated: Any, **kwargs: Any):
        from graphtrim.airflow.assets import REGISTERED

        kwargs.setdefault("outlets", [REGISTERED])
        super().__init__(optimized=optimized, validated=validated, **kwargs)

    def asset_events(self, record: Mapping[str, Any]) -> list[tuple[Any, Any, dict[str, Any]]]:
        """An event on the registered model's asset per version created, through
        ``graphtrim-registered``."""
        from graphtrim.airflow.assets import REGISTERED, registered_events

        return [(REGISTERED, asset, extra) for asset, extra in registered_events(record)]


class MlflowAliasPromoteOperator(GraphtrimStageOperator):
    """Move aliases by the policy's promotion section; an Asset event per alias moved. XCom:
    the promote record."""

    stage_name = "promote"
    template_fields = (*GraphtrimStageOperator.template_fields, "validated", "registered")

    def __init__(self, *, validated: Any, registered: Any, **kwargs: Any):
        from graphtrim.airflow.assets import PROMOTED

        kwargs.setdefault("outlets", [PROMOTED])
        super().__init__(validated=validated, registered=registered, **kwargs)

    def asset_events(self, record: Mapping[str, Any]) -> list[tuple[Any, Any, dict[str, Any]]]:
        """An event on the registered model's asset per alias moved, through
        ``graphtrim-promoted``."""
        from graphtrim.airflow.assets import PROMOTED, promoted_events

        target = str(self.stage_input("register").get("target") or "")
        return [(PROMOTED, asset, extra) for asset, extra in promoted_events(record, target)]


# names that lived here before the tune operators and the run plan got modules of their own:
# DAGs that import them from here keep working
_MOVED = {
    "TunePlanOperator": "graphtrim.airflow.tune_operators",
    "TuneTrialOperator": "graphtrim.airflow.tune_operators",
    "TuneSelectOperator": "graphtrim.airflow.tune_operators",
    "plan_run": "graphtrim.airflow.run_plan",
    "variant_table": "graphtrim.airflow.run_plan",
}


__getattr__ = lazy_attributes(__name__, _MOVED)
