"""How long each task of the graphtrim DAGs may run (its ``execution_timeout``).

Airflow fixes ``execution_timeout`` when it parses a DAG file, so the values are read from the
environment of the process that parses the DAGs (the DAG processor) and of the workers that
parse them again to run a task; set them alike on both:

- ``GRAPHTRIM_TASK_TIMEOUT_MINUTES``: every task;
- ``GRAPHTRIM_TASK_TIMEOUT_MINUTES_<STAGE>`` (``_EXPORT``, ``_QUANTIZE``, ...): one stage, over
  the first.

Values are minutes (a decimal is fine), greater than zero. Without them each stage has the
default below: long for the stages whose time grows with the model (export, optimize,
quantize, gate), short for the bookkeeping ones; a stage not listed gets the long default.
"""

from __future__ import annotations

import datetime as dt
import os

ENV = "GRAPHTRIM_TASK_TIMEOUT_MINUTES"

DEFAULT_MINUTES: dict[str, float] = {
    # optimize DAGs
    "plan": 5,
    "variants": 5,
    "export": 120,
    "optimize": 120,
    "quantize": 180,
    "tune": 60,  # one step of the settings search: a plan, a trial, a select
    "gate": 120,
    "register": 15,
    "promote": 10,
    "summary": 5,
    # registry DAGs: list the versions to optimize, trigger one optimize run each
    "versions": 10,
    "candidates": 15,
    "trigger": 10,
}
# a task not listed above (a stage added to ``graphtrim.stages.STAGES``)
UNLISTED_MINUTES: float = 120


def _minutes(name: str, value: str) -> float:
    try:
        minutes = float(value)
    except ValueError:
        minutes = float("nan")
    if not minutes > 0 or minutes == float("inf"):
        raise ValueError(f"${name} must be a number of minutes greater than 0, not {value!r}")
    return minutes


def task_timeout(stage: str) -> dt.timedelta:
    """The ``execution_timeout`` of a graphtrim task doing ``stage`` (a key of
    :data:`DEFAULT_MINUTES`), with the environment's overrides."""
    # a stage added to the pipeline's list without an entry here gets the long default
    minutes = DEFAULT_MINUTES.get(stage, UNLISTED_MINUTES)
    for name in (ENV, f"{ENV}_{stage.upper()}"):
        value = os.environ.get(name, "").strip()
        if value:
            minutes = _minutes(name, value)
    return dt.timedelta(minutes=minutes)
