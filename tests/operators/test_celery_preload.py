"""The Celery worker configuration that preloads graphtrim's stage modules (the task processes a
worker forks inherit them). The distributed tests run real Celery workers with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CONFIG = "graphtrim.airflow.celery_config.CELERY_CONFIG"


def _fresh(code: str, tmp_path: Path, **env: str) -> str:
    """Run ``code`` in a fresh interpreter with its own AIRFLOW_HOME; its stdout."""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=540,  # only against a hang (inside the test's own limit)
        cwd=REPO,
        env={
            **os.environ,
            "AIRFLOW_HOME": str(tmp_path / "airflow"),
            "MLFLOW_DISABLE_TELEMETRY": "true",
            **env,
        },
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_airflow_reads_the_config_and_celery_imports_the_preload(tmp_path):
    code = (
        "import json\n"
        "from airflow.providers.celery.executors.celery_executor_utils import "
        "get_celery_configuration\n"
        "from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG\n"
        "from celery import Celery\n"
        "conf = get_celery_configuration()\n"
        "app = Celery('t', config_source=conf)\n"
        "missing = sorted(set(DEFAULT_CELERY_CONFIG) - set(conf))\n"
        "print(json.dumps({'imports': list(app.conf.imports), 'missing': missing}))\n"
    )
    out = json.loads(_fresh(code, tmp_path, AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS=CONFIG))
    assert "graphtrim.airflow.preload" in out["imports"]
    assert out["missing"] == []  # Airflow's own settings (broker, serializers ...) all kept


def test_preload_imports_the_stage_modules_and_starts_no_thread(tmp_path):
    """What a worker does once at start: every module imported, and nothing running that a
    fork would copy half-way (a thread holding a lock)."""
    code = (
        "import json, sys, threading\n"
        "import graphtrim.airflow.preload as p\n"
        "print(json.dumps({'seconds': p.SECONDS, 'threads': threading.active_count(),\n"
        "                  'mlflow': 'mlflow' in sys.modules, 'torch': 'torch' in sys.modules}))\n"
    )
    out = json.loads(_fresh(code, tmp_path))
    failed = [m for m, s in out["seconds"].items() if s < 0]
    assert failed == [], failed
    assert out["mlflow"] and not out["torch"]
    assert out["threads"] == 1


def test_a_module_that_fails_to_import_does_not_stop_the_worker():
    from graphtrim.airflow.preload import preload

    took = preload(("json", "graphtrim_no_such_module"))
    assert took["graphtrim_no_such_module"] == -1.0 and took["json"] >= 0


def test_helm_overlay_sets_the_config_on_the_workers():
    overlay = yaml.safe_load((REPO / "helm" / "airflow-values.yaml").read_text())
    assert overlay["config"]["celery"]["celery_config_options"] == CONFIG
