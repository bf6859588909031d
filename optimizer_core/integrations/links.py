"""Where a stage's results are in MLflow's UI: links to its run, the model versions it
registered and its report, made from the stage's record. Orchestrators show them beside their
tasks (Airflow's extra links)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

UI_ENV = "GRAPHTRIM_MLFLOW_UI_URL"
# keys of the links a record can have, and what each opens
LINKS = {
    "run": "MLflow run",
    "model": "MLflow model version",
    "report": "graphtrim report",
}


def ui_base(tracking_uri: str | None, override: str | None = None) -> str | None:
    """The address of MLflow's UI: ``override`` (a connection's ``ui_url``), else
    ``$GRAPHTRIM_MLFLOW_UI_URL`` (a tracking URI inside a cluster is rarely what a browser
    reaches), else the tracking URI when it is a server's. None for a database or folder."""
    for candidate in (override, os.environ.get(UI_ENV), tracking_uri):
        if candidate and candidate.startswith(("http://", "https://")):
            base = candidate.rstrip("/")
            if "@" in base.split("//", 1)[1].split("/", 1)[0]:  # never a credential in a link
                scheme, rest = base.split("//", 1)
                base = f"{scheme}//{rest.split('@', 1)[1]}"
            return base
    return None


def record_links(
    base: str | None, record: Mapping[str, Any], *, experiment_id: str | None = None
) -> dict[str, str]:
    """Key (of :data:`LINKS`) -> URL of what ``record`` points at in the UI at ``base``: its
    run, the version it registered (the registered model's versions when there are several),
    and its report, the run's artifact view of it (needs ``experiment_id``)."""
    if not base:
        return {}
    out: dict[str, str] = {}
    run = record.get("run_id")
    if run:
        out["run"] = f"{base}/#/runs/{run}"
    registered = [r for r in (record.get("registered") or {}).values() if r.get("version")]
    if registered:
        name = quote(str(registered[0]["name"]), safe="")
        versions = sorted({str(r["version"]) for r in registered}, key=lambda v: int(v))
        out["model"] = (
            f"{base}/#/models/{name}/versions/{versions[0]}"
            if len(versions) == 1
            else f"{base}/#/models/{name}"
        )
    html = (record.get("reports") or {}).get("html")
    if run and experiment_id and html:
        name = str(html).rsplit("/", 1)[-1]
        out["report"] = (
            f"{base}/#/experiments/{experiment_id}/runs/{run}/artifacts/graphtrim/reports/{name}"
        )
    return out
