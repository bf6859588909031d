"""Imported once by a Celery worker at start (see :mod:`graphtrim.airflow.celery_config`): the
modules graphtrim's stage tasks need, so that the task processes the worker forks inherit them.

Only imports: no thread, session or connection is opened here, so forking stays safe. torch is
left out (only the export of PyTorch models needs it, and it would triple the worker's memory).
A module that fails to import is logged and skipped: the worker still starts, and the task that
needs it reports the error itself.
"""

from __future__ import annotations

import importlib
import logging
import time

from graphtrim.stages import STAGES

logger = logging.getLogger("graphtrim.preload")

MODULES = (
    "numpy",
    "onnx",
    "onnx_ir",
    "onnxruntime",
    "boto3",
    "mlflow",
    "mlflow.tracking",
    "mlflow.onnx",
    "graphtrim.stages.pipeline",
    *(stage.function.partition(":")[0] for stage in STAGES),
    "graphtrim.integrations.registry",
    "graphtrim.integrations.artifacts",
    "graphtrim.gates",
    "graphtrim.quantize.build",
    "graphtrim.airflow.operators",
    "graphtrim.airflow.tune_operators",
)


def preload(modules: tuple[str, ...] = MODULES) -> dict[str, float]:
    """Import ``modules``; seconds per module (``-1`` for one that failed)."""
    took: dict[str, float] = {}
    for name in modules:
        start = time.perf_counter()
        try:
            importlib.import_module(name)
        except Exception as exc:  # a worker must start even if an optional module is missing
            logger.warning("graphtrim preload: %s not imported: %s", name, exc)
            took[name] = -1.0
            continue
        took[name] = time.perf_counter() - start
    logger.info(
        "graphtrim preload: %d modules in %.2f s", len(took), sum(max(t, 0) for t in took.values())
    )
    return took


SECONDS = preload()
