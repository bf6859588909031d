"""Celery configuration for graphtrim's Airflow workers.

Airflow's default Celery configuration plus one import at worker start,
:mod:`graphtrim.airflow.preload`: the modules every graphtrim stage needs (MLflow alone takes
about 1.7 s to import on a 2-core machine). A Celery worker forks each task process from itself,
so its tasks inherit those modules instead of importing them again, task after task. Set on the
workers (the Helm overlay and the test deployment do)::

    AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS=graphtrim.airflow.celery_config.CELERY_CONFIG

The scheduler reads the same configuration to send tasks; the preload runs in workers only.
"""

from __future__ import annotations

from typing import Any

from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG

PRELOAD = "graphtrim.airflow.preload"

CELERY_CONFIG: dict[str, Any] = {
    **DEFAULT_CELERY_CONFIG,
    "imports": (*tuple(DEFAULT_CELERY_CONFIG.get("imports") or ()), PRELOAD),
}
