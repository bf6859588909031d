"""graphtrim's Apache Airflow provider: hooks, operators, a deferrable sensor, triggers and a
plugin receiving MLflow webhooks (the ``airflow.plugins`` entry point). Each
operator is one pipeline stage of ``optimizer_core``."""

from __future__ import annotations

from typing import Any


def get_provider_info() -> dict[str, Any]:
    """What ``airflow providers`` lists of graphtrim: its connection type, hooks, operators,
    sensor, triggers, extra links and plugin."""
    integration = "graphtrim"
    modules = {
        "hooks": ["graphtrim.airflow.hooks"],
        "operators": ["graphtrim.airflow.operators"],
        "sensors": ["graphtrim.airflow.sensors"],
        "triggers": ["graphtrim.airflow.triggers"],
    }
    return {
        "package-name": "graphtrim",
        "name": "graphtrim",
        "description": "Optimize, quantize, gate and register ONNX variants of MLflow models.",
        "integrations": [{"integration-name": integration, "tags": ["software"]}],
        **{
            kind: [{"integration-name": integration, "python-modules": names}]
            for kind, names in modules.items()
        },
        "connection-types": [
            {
                "connection-type": "graphtrim_mlflow",
                "hook-class-name": "graphtrim.airflow.hooks.MlflowRegistryHook",
                "hook-name": "MLflow (graphtrim)",
            }
        ],
        "extra-links": [
            "graphtrim.airflow.links.MlflowRunLink",
            "graphtrim.airflow.links.MlflowModelVersionLink",
            "graphtrim.airflow.links.GraphtrimReportLink",
        ],
        "plugins": [
            {"name": "graphtrim", "plugin-class": "graphtrim.airflow.plugin.GraphtrimPlugin"}
        ],
    }
