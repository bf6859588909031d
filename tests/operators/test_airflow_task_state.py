"""Airflow's own state of a task instance, as a stage task asks it through the Task SDK (the
execution API): what closes a pipeline run left RUNNING by a worker on another host. A stage
task records its task instance with its stage (``graphtrim.worker.<stage>``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO

AIRFLOW = str(Path(sys.executable).with_name("airflow"))

DAG_FILE = """
import datetime as dt
import json
import os

from airflow.sdk import DAG
from airflow.providers.standard.operators.python import PythonOperator

from graphtrim.airflow.operators import GraphtrimStageOperator


class Probe(GraphtrimStageOperator):
    def execute(self, context):
        ctx = self.stage_context(context)
        me = dict(ctx.worker["orchestrator"])
        out = {
            "me": me,
            "my_state": ctx.task_state(ctx.worker),
            "first": ctx.task_state({"orchestrator": {**me, "task_id": "first"}}),
            "mapped": [
                ctx.task_state({"orchestrator": {**me, "task_id": "each", "map_index": i}})
                for i in range(3)
            ],
            "absent": ctx.task_state({"orchestrator": {**me, "task_id": "nothing"}}),
        }
        with open(os.environ["PROBE_OUT"], "w") as f:
            json.dump(out, f)


def fail_odd(i):
    if i % 2:
        raise ValueError("odd")


with DAG("task_state_probe", schedule=None, start_date=dt.datetime(2026, 1, 1)) as dag:
    first = PythonOperator(task_id="first", python_callable=lambda: None)
    each = PythonOperator.partial(task_id="each", python_callable=fail_odd, retries=0).expand(
        op_args=[[0], [1], [2]]
    )
    probe = Probe(task_id="probe", artifacts=os.environ["PROBE_ARTIFACTS"], trigger_rule="all_done")
    [first, each] >> probe
"""


@pytest.mark.slow
def test_a_stage_task_reads_airflow_task_states_through_the_task_sdk(tmp_path: Path) -> None:
    home, dags = tmp_path / "home", tmp_path / "dags"
    home.mkdir()
    dags.mkdir()
    (dags / "task_state_probe.py").write_text(textwrap.dedent(DAG_FILE))
    out = tmp_path / "out.json"
    env = dict(os.environ)
    env.update(
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__DAGS_FOLDER=str(dags),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{home / 'airflow.db'}",
        MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}",
        PROBE_OUT=str(out),
        PROBE_ARTIFACTS=str(tmp_path / "artifacts"),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
    )
    subprocess.run([AIRFLOW, "db", "migrate"], check=True, capture_output=True, env=env)
    proc = subprocess.run(
        [AIRFLOW, "dags", "test", "task_state_probe"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["me"]["name"] == "Airflow"
    assert (got["me"]["dag_id"], got["me"]["task_id"]) == ("task_state_probe", "probe")
    assert got["me"]["map_index"] == -1 and got["me"]["try_number"] >= 1
    assert got["me"]["run_id"].startswith("manual__")
    assert got["my_state"] == "running"
    assert got["first"] == "success"
    assert got["mapped"] == ["success", "failed", "success"]
    assert got["absent"] is None
