"""What the optimize DAGs need of the core around the operators: a run's plan (its source and
pipeline config from the DAG run's params, checked before any work) and the variant table of a
finished run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from graphtrim import run_params
from graphtrim.errors import GraphtrimError


def _budget(value: Any) -> float | None:
    """The ``tune`` param (``"10m"``, ``"600"``, a number, or none) in seconds."""
    import argparse

    from airflow.sdk.exceptions import AirflowFailException
    from graphtrim.cli.argtypes import tune_budget

    try:
        return tune_budget(value)
    except argparse.ArgumentTypeError as exc:
        raise AirflowFailException(f"tune: {exc}") from exc


def plan_run(params: Mapping[str, Any] | None, device: str) -> dict[str, Any]:
    """A run's source URI and pipeline config from the DAG run's params, checked here, so a
    bad request fails (with no retry) before any work."""
    from airflow.sdk.exceptions import AirflowFailException
    from graphtrim.stages.context import PipelineConfig

    p = params or {}
    name = p.get("model_name")
    if not name:  # a bad request: no retry will mend it
        raise AirflowFailException("conf needs model_name")
    if bool(p.get("version")) == bool(p.get("alias")):
        raise AirflowFailException("conf needs exactly one of version or alias")
    uri = f"models:/{name}/{p['version']}" if p.get("version") else f"models:/{name}@{p['alias']}"
    try:
        config = PipelineConfig(device=device, **_config_values(p))
    except GraphtrimError as exc:
        raise AirflowFailException(str(exc)) from exc
    planned: dict[str, Any] = {
        "model_uri": uri,
        "config": config.to_json(),
        "variants": list(config.variants),
        "artifacts": p.get("artifacts") or None,
    }
    for row in run_params.on("dag"):
        if row.into == "context":  # how the stages treat the registry and earlier results
            planned[row.name] = bool(p.get(row.name))
    return planned


def _config_values(params: Mapping[str, Any]) -> dict[str, Any]:
    """The ``PipelineConfig`` fields a DAG run's params give (the run-parameter table's config
    parameters the DAGs take; the device is the DAG's own)."""
    values: dict[str, Any] = {}
    for row in run_params.on("dag"):
        if row.into != "config" or row.name == "device":
            continue
        value = params.get(row.name)
        if row.type == "duration":
            value = _budget(value)
        elif value is None:
            continue  # the config's default
        elif row.type == "array":
            value = tuple(value)
        values[row.name] = value
    return values


def variant_table(validated: Any, registered: Any, promoted: Any) -> str:
    """The variant table of a run (gate verdicts, registered versions, aliases), as
    ``graphtrim pipeline run`` prints it, from the gate tasks' records (merged), the register
    record and the promote record."""
    from graphtrim.stages.records import ValidateRecord
    from graphtrim.stages.summary import table

    merged = ValidateRecord.merge([dict(validated[i]) for i in range(len(validated))])
    return table(
        {"validate": merged.to_json(), "register": dict(registered), "promote": dict(promoted)}
    )
