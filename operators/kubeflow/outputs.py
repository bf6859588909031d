"""What a Kubeflow step leaves for the KFP UI besides its record: the stage's report as an
``HTML`` artifact and its numbers as a ``Metrics`` artifact.

KFP's launcher runs a step's container with the executor input (``{{$}}``: where each output
artifact goes, and the *output file*), and after the container exits uploads each output
artifact from its local path (``s3://b/k`` is ``/s3/b/k``, ``gs://`` ``/gcs/``, ``minio://``
``/minio/``) and reads the output file, an ``ExecutorOutput`` JSON whose artifacts' ``metadata``
it records (a ``system.Metrics`` artifact's metadata are the run's scalar metrics in the UI).
Run locally (``kfp.local``), an artifact's URI is a path on this machine.

This module writes both from a stage record: no KFP import (the step's image needs none), and
the report comes from the artifact store the stage published it to, so the KFP artifact is a
copy of the very file MLflow and the store hold.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from graphtrim.errors import GraphtrimError
from graphtrim.integrations.artifacts import fetch_file

REPORT = "report"
"""The output artifact of a step's report (``system.HTML``)."""

METRICS = "metrics"
"""The output artifact of a step's numbers (``system.Metrics``)."""

# where KFP's launcher mounts each object store in the step's container
MOUNTS = {"gs://": "gcs", "minio://": "minio", "s3://": "s3"}
MOUNT_ROOT = Path("/")


def local_path(uri: str) -> Path:
    """The path in the step's container of the artifact at ``uri``, as KFP's launcher maps it;
    a local path (what ``kfp.local``'s runners hand a step) is itself."""
    if uri.startswith("/"):
        return Path(uri)
    for scheme, mount in MOUNTS.items():
        if uri.startswith(scheme):
            return MOUNT_ROOT / mount / uri[len(scheme) :]
    raise GraphtrimError(f"KFP artifact URI {uri!r}: not on an object store KFP mounts")


def metrics_of(record: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a stage record, flat: per judged variant whether it passed and each of
    its gate numbers (``int8-static.speedup``); per registration run the counts of variants
    registered and failed and each registered version."""
    out: dict[str, float] = {}
    for name, verdict in sorted((record.get("variants") or {}).items()):
        if not isinstance(verdict, Mapping) or "passed" not in verdict:
            continue
        out[f"{name}.passed"] = 1.0 if verdict["passed"] else 0.0
        for key, value in sorted((verdict.get("metrics") or {}).items()):
            if isinstance(value, int | float) and not isinstance(value, bool):
                if math.isfinite(value):
                    out[f"{name}.{key}"] = float(value)
    if "registered" in record:
        registered = record.get("registered") or {}
        out["registered"] = float(len(registered))
        out["failed"] = float(len(record.get("failed") or {}))
        for name, entry in sorted(registered.items()):
            version = str((entry or {}).get("version", ""))
            if version.isdigit():
                out[f"{name}.version"] = float(version)
    return out


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_outputs(
    record: Mapping[str, Any],
    executor_input: Mapping[str, Any],
    *,
    endpoint_url: str | None = None,
) -> dict[str, str]:
    """Write the step's ``report`` and ``metrics`` artifacts from ``record`` where the executor
    input asks for them, and the output file that carries the metrics to KFP. Returns the local
    path written per artifact. A record without a report (a run that judged nothing new) leaves
    the report artifact unwritten."""
    outputs = executor_input.get("outputs") or {}
    wanted = outputs.get("artifacts") or {}
    written: dict[str, str] = {}
    executor_output: dict[str, Any] = {"artifacts": {}}

    def slot(name: str) -> dict[str, Any] | None:
        entries = (wanted.get(name) or {}).get("artifacts") or []
        return dict(entries[0]) if entries else None

    report = slot(REPORT)
    html = (record.get("reports") or {}).get("html")
    if report is not None and html:
        dest = local_path(report["uri"])
        with tempfile.TemporaryDirectory(prefix="graphtrim-kfp-") as tmp:
            source = fetch_file(html, Path(tmp) / "report.html", endpoint_url=endpoint_url)
            _atomic_write(dest, source.read_bytes())
        written[REPORT] = str(dest)
        executor_output["artifacts"][REPORT] = {"artifacts": [report]}

    metrics = slot(METRICS)
    if metrics is not None:
        numbers = metrics_of(record)
        dest = local_path(metrics["uri"])
        _atomic_write(dest, json.dumps(numbers, indent=2, sort_keys=True).encode())
        written[METRICS] = str(dest)
        metrics["metadata"] = {**(metrics.get("metadata") or {}), **numbers}
        executor_output["artifacts"][METRICS] = {"artifacts": [metrics]}

    output_file = outputs.get("outputFile")
    if output_file and executor_output["artifacts"]:
        _atomic_write(Path(output_file), json.dumps(executor_output).encode())
    return written
