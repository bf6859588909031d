"""graphtrim's Apache Airflow provider: hooks, operators, a deferrable sensor, triggers and a
plugin receiving MLflow webhooks (the ``airflow.plugins`` entry point). Each
operator is one pipeline stage of ``optimizer_core``."""

from __future__ import annotations

from typing import Any


def get_provider_info() -> dict[str, Any]:
    return {
        "package-name": "graphtrim",
        "name": "graphtrim",
        "description": "Optimize, quantize, gate and register ONNX variants of MLflow models.",
        "connection-types": [
            {
                "connection-type": "graphtrim_mlflow",
                "hook-class-name": "operators.airflow.hooks.MlflowRegistryHook",
            }
        ],
    }
