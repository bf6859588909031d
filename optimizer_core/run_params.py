"""The run parameters: one table of what a pipeline run takes.

Every surface that starts a run derives its parameters from :data:`RUN_PARAMS`: the flags of
``graphtrim pipeline run|stage|tune`` (``graphtrim.cli.pipeline_commands``), the Params of the
optimize DAGs (``dags/graphtrim_optimize_model.py``) and the run's config their plan task makes
(``graphtrim.airflow.run_plan.plan_run``), the Kubeflow pipeline's signature and every step's
options (``graphtrim.kubeflow.pipeline``), and which fields of
:class:`~graphtrim.stages.context.PipelineConfig` enter the config hash. The reference page
``docs/reference/run-parameters.md`` is generated from it, and ``tests/test_run_params.py``
fails when a surface lacks a parameter of the table or takes one of its own.

Adding a run parameter is one :class:`RunParam` row here plus the code that reads it (a
``PipelineConfig`` field for ``into="config"``, a ``StageContext`` field for
``into="context"``).

This module imports nothing but the standard library: the DAG file reads it whenever the
scheduler parses it.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Literal

Surface = Literal["cli", "dag", "kfp"]
Type = Literal["string", "integer", "boolean", "array", "object", "duration"]
Hashed = Literal["yes", "when-set", "no"]

SURFACES: tuple[Surface, ...] = ("cli", "dag", "kfp")

REQUIRED = object()
"""The default of a parameter a run must give (the Kubeflow pipeline has no default for it)."""


@dataclasses.dataclass(frozen=True)
class Names:
    """A default or the choices that live in a module's table (its top-level ``name``), read
    by each surface in its own way (the CLI and the DAG without importing the module where
    its source writes the table as a literal)."""

    module: str
    name: str

    def load(self) -> list[str]:
        return [str(n) for n in getattr(importlib.import_module(self.module), self.name)]


VARIANT_NAMES = Names("graphtrim.quantize.kinds", "VARIANTS")
DEFAULT_VARIANT_NAMES = Names("graphtrim.quantize.kinds", "DEFAULT_VARIANTS")
PRESET_NAMES = Names("graphtrim.graph.presets", "PRESETS")


@dataclasses.dataclass(frozen=True)
class RunParam:
    """One parameter of a pipeline run.

    Attributes:
        name: the DAG Param, the Kubeflow pipeline parameter, and the ``PipelineConfig`` or
            ``StageContext`` field it sets.
        type: ``string``, ``integer``, ``boolean``, ``array`` (of strings), ``object`` (a
            JSON document) or ``duration`` (``600``, ``90s``, ``10m``).
        default: what a run that does not give it gets (None: nothing; :data:`REQUIRED`: the
            run must give it; a :class:`Names`: that table of the core).
        help: what it means (the CLI's help, the DAG Param's description, the reference).
        choices: its values, or the table of the core they come from (for an ``array``:
            each item's).
        hashed: whether it enters the config hash: ``yes``; ``when-set``: only when it is set
            (a config without it hashes as before the parameter existed); ``no`` (a location,
            a name, a way of treating earlier results).
        into: what it sets: ``config`` (a ``PipelineConfig`` field), ``context`` (a
            ``StageContext`` field: how a run treats the registry and earlier results, never
            what it builds), ``location`` (where the registry and the artifacts are) or
            ``source`` (the model version to optimize).
        surfaces: the surfaces that take it; the others get it another way (an Airflow
            connection, the DAG chosen, the pipeline compiled) or leave it at its default.
        flag: its ``graphtrim pipeline`` option (default: ``--name-with-dashes``); a
            ``boolean``'s flag takes an optional value (``--rejudge`` or ``--rejudge false``)
            so that an orchestrator can pass it as a parameter.
        env: the environment variable the CLI (and the DAG, for a location) takes its default
            from.
        example: a valid value other than the default: the tests pass it through every surface.
    """

    name: str
    type: Type
    help: str
    default: Any = None
    choices: Names | tuple[str, ...] | None = None
    hashed: Hashed = "no"
    into: Literal["config", "context", "location", "source"] = "config"
    surfaces: frozenset[Surface] = frozenset(SURFACES)
    flag: str = ""
    env: str | None = None
    example: Any = None

    def __post_init__(self) -> None:
        if not self.flag:
            object.__setattr__(self, "flag", "--" + self.name.replace("_", "-"))
        object.__setattr__(self, "surfaces", frozenset(self.surfaces))
        if self.hashed != "no" and self.into != "config":
            raise ValueError(f"{self.name}: only a config field enters the config hash")

    @property
    def dest(self) -> str:
        """The CLI's name for it (``args.<dest>``)."""
        return self.flag.lstrip("-").replace("-", "_")

    def default_value(self) -> Any:
        """The default, a table of the core loaded (:data:`REQUIRED` stays itself)."""
        if isinstance(self.default, Names):
            return self.default.load()
        return self.default


def _only(*surfaces: Surface) -> frozenset[Surface]:
    return frozenset(surfaces)


def _switch(name: str, help: str) -> RunParam:
    """A ``boolean`` context parameter, off unless a run turns it on."""
    return RunParam(name, "boolean", help, default=False, into="context", example=True)


RUN_PARAMS: tuple[RunParam, ...] = (
    # the source: the DAGs' trigger form names it by name and version or alias, the CLI and the
    # Kubeflow pipeline by one URI; each DAG is placed on its device when parsed, the Kubeflow
    # pipeline when compiled
    RunParam(
        "device",
        "string",
        "where quantize and gate run",
        default="cpu",
        choices=("cpu", "gpu"),
        hashed="yes",
        surfaces=_only("cli", "dag"),
        example="gpu",
    ),
    RunParam(
        "model_name",
        "string",
        "registered model to optimize",
        default="",
        into="source",
        surfaces=_only("dag"),
        example="m",
    ),
    RunParam(
        "version",
        "string",
        "version (or use alias)",
        into="source",
        surfaces=_only("dag"),
        example="1",
    ),
    RunParam(
        "alias",
        "string",
        "alias, e.g. champion",
        into="source",
        surfaces=_only("dag"),
        example="champion",
    ),
    RunParam(
        "model_uri",
        "string",
        "source: models:/NAME/VERSION or models:/NAME@ALIAS",
        default=REQUIRED,
        into="source",
        surfaces=_only("cli", "kfp"),
        flag="--model",
        example="models:/m/1",
    ),
    # what a run builds: the config hash's fields (the data files by their content hash)
    RunParam(
        "variants",
        "array",
        "variants to build",
        default=DEFAULT_VARIANT_NAMES,
        choices=VARIANT_NAMES,
        hashed="yes",
        example=["graph"],
    ),
    RunParam(
        "preset",
        "string",
        "graph optimization preset (graphtrim passes --presets lists them)",
        default="default",
        choices=PRESET_NAMES,
        hashed="yes",
        example="safe",
    ),
    RunParam(
        "opset",
        "integer",
        "raise the model's opset to this before the graph passes (23: a language model's "
        "Attention with its KV cache, RotaryEmbedding, RMSNormalization); none: the export's",
        hashed="when-set",
        example=21,
    ),
    RunParam(
        "policy",
        "object",
        "gate policy document (thresholds per variant, promotion); none: the workers' "
        "$GRAPHTRIM_POLICY, else the built-in defaults",
        hashed="yes",
        flag="--policy-json",
        example={"variants": {"graph": {"latency": {"min_speedup": None}}}},
    ),
    RunParam(
        "weights",
        "object",
        "weight-only variants' settings (int4-weight, int8-weight), e.g. "
        '{"weight_form": "ort", "quantize_embeddings": true}; keys: block_size, '
        "weight_symmetric, weight_algorithm, weight_form, accuracy_level, "
        "quantize_embeddings; none: the defaults",
        hashed="when-set",
        flag="--weights-json",
        example={"weight_form": "ort"},
    ),
    RunParam(
        "tune",
        "duration",
        "search each variant's settings for this long (e.g. 10m; graphtrim "
        "tune): a task per trial over the device's workers (task group tune), round by "
        "round, the best judged by each variant's quantize task; none: the fixed recipes",
        hashed="when-set",
        example="10m",
    ),
    RunParam(
        "calibration",
        "string",
        ".npz calibration data",
        example="s3://bucket/calibration.npz",
    ),
    RunParam(
        "eval_data",
        "string",
        ".npz evaluation data",
        example="s3://bucket/eval.npz",
    ),
    RunParam(
        "target_name",
        "string",
        "registered model the variants go to (default: the source's)",
        example="m-optimized",
    ),
    # where the registry and the artifacts are: the DAGs read the registry and S3 from their
    # Airflow connections
    RunParam(
        "tracking_uri",
        "string",
        "MLflow tracking/registry URI",
        default=REQUIRED,
        into="location",
        surfaces=_only("cli", "kfp"),
        env="MLFLOW_TRACKING_URI",
        example="http://mlflow:5000",
    ),
    RunParam(
        "artifacts",
        "string",
        "artifact store: s3://bucket/prefix or a folder",
        default=REQUIRED,
        into="location",
        env="GRAPHTRIM_ARTIFACTS",
        example="s3://bucket/prefix",
    ),
    RunParam(
        "s3_endpoint_url",
        "string",
        "S3-compatible endpoint (AWS when unset)",
        into="location",
        surfaces=_only("cli", "kfp"),
        env="AWS_ENDPOINT_URL_S3",
        example="http://s3:9000",
    ),
    # how a run treats the registry and earlier results (none of it changes what is built)
    _switch("allow_variant_source", "optimize a version graphtrim registered itself (a variant)"),
    _switch("rejudge", "build and measure again the variants judged before under this config"),
    _switch(
        "force_promotion", "move the champion even where a person holds it (promote / rollback)"
    ),
    RunParam(
        "unreached_retries",
        "integer",
        "a variant whose verdict was not reached (its child timed out or was killed from "
        "outside) is measured again by up to this many later runs before that outcome is "
        "reported as recorded; a measured failure is never measured again",
        default=2,
        into="context",
        # the orchestrators' runs keep the default: their context parameters are switches
        surfaces=frozenset({"cli"}),
        example=0,
    ),
    # the command line's alone: settings the orchestrators leave at their defaults
    RunParam(
        "tensorrt",
        "boolean",
        "with --device gpu: TensorRT first",
        default=False,
        hashed="yes",
        surfaces=_only("cli"),
        example=True,
    ),
    RunParam(
        "experiment",
        "string",
        "MLflow experiment of the runs",
        default="graphtrim",
        surfaces=_only("cli"),
        example="other",
    ),
    RunParam(
        "fallback",
        "boolean",
        "keep the most sensitive nodes in float and build again when a variant fails its "
        "accuracy check (--no-fallback: no sensitivity fallback)",
        default=True,
        hashed="yes",
        surfaces=_only("cli"),
        flag="--no-fallback",
        example=False,
    ),
    RunParam(
        "fx_simplify",
        "boolean",
        "PyTorch models: torch.fx dead-code elimination and constant folding before export",
        default=False,
        hashed="when-set",
        surfaces=_only("cli"),
        example=True,
    ),
)
"""Every run parameter, in the order the surfaces list them."""

BY_NAME = {p.name: p for p in RUN_PARAMS}


def on(surface: Surface) -> tuple[RunParam, ...]:
    """The parameters ``surface`` takes, in the table's order."""
    return tuple(p for p in RUN_PARAMS if surface in p.surfaces)


def config_params() -> tuple[RunParam, ...]:
    """The parameters that are :class:`~graphtrim.stages.context.PipelineConfig` fields."""
    return tuple(p for p in RUN_PARAMS if p.into == "config")


def hashed_config(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` (a ``PipelineConfig.to_json()``) less what does not enter the config hash: the
    parameters that are never hashed, and those hashed ``when-set`` that are not set."""
    out = dict(doc)
    for p in config_params():
        if p.hashed == "no" or (p.hashed == "when-set" and not out.get(p.name)):
            out.pop(p.name, None)
    return out


def parse_flag(text: str | bool) -> bool:
    """A boolean flag's optional value (``--rejudge false``: what an orchestrator renders a
    boolean parameter as)."""
    if isinstance(text, bool):
        return text
    value = str(text).strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no", ""):
        return False
    import argparse

    raise argparse.ArgumentTypeError(f"not true or false: {text!r}")
