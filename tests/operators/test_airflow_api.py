"""What CI does: Airflow 3 running for real (``airflow standalone``: API server, scheduler,
DAG processor, triggerer, LocalExecutor) on 127.0.0.1, the optimize DAG triggered over the REST
API v2 with ``conf`` and a bearer token, polled until it succeeds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from optimizer_core.examples.digits import DigitsTask
from tests.conftest import REPO
from tests.servers import free_port

pytestmark = pytest.mark.slow


@pytest.fixture
def standalone(tmp_path: Path, digits_task: DigitsTask) -> Iterator[dict[str, Any]]:
    import mlflow
    import onnx

    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking, tracking)
    exp = client.create_experiment("src", artifact_location=(tmp_path / "mlruns").as_uri())
    mlflow.set_tracking_uri(tracking)
    with mlflow.start_run(experiment_id=exp):
        mlflow.onnx.log_model(
            onnx.load(str(digits_task.model)),
            name="model",
            registered_model_name="digits-api",
            pip_requirements=[],
        )
    port = free_port()
    home = tmp_path / "airflow"
    home.mkdir()
    env = dict(os.environ)
    env.update(
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__DAGS_FOLDER=str(REPO / "dags"),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__API__HOST="127.0.0.1",
        AIRFLOW__API__PORT=str(port),
        AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"http://127.0.0.1:{port}/execution/",
        AIRFLOW__CORE__PARALLELISM="2",
        AIRFLOW__SCHEDULER__MIN_FILE_PROCESS_INTERVAL="5",
        MLFLOW_TRACKING_URI=tracking,
        GRAPHTRIM_ARTIFACTS=str(tmp_path / "artifacts"),
        PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}",
    )
    log = tmp_path / "standalone.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("airflow")), "standalone"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"airflow standalone exited:\n{log.read_text()[-3000:]}")
            try:
                health = requests.get(f"{url}/api/v2/monitor/health", timeout=2).json()
                if all(
                    health.get(k, {}).get("status") == "healthy"
                    for k in ("metadatabase", "scheduler", "dag_processor")
                ):
                    break
            except (requests.RequestException, ValueError):
                pass
            time.sleep(1)
        else:
            raise RuntimeError(f"airflow standalone not healthy:\n{log.read_text()[-3000:]}")
        passwords = home / "simple_auth_manager_passwords.json.generated"
        user, password = next(iter(json.loads(passwords.read_text()).items()))
        yield {"url": url, "user": user, "password": password, "tracking": tracking, "log": log}
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_trigger_optimize_dag_over_rest_api(standalone: dict[str, Any]) -> None:
    import mlflow

    url = standalone["url"]
    token = requests.post(
        f"{url}/auth/token",
        json={"username": standalone["user"], "password": standalone["password"]},
        timeout=10,
    ).json()["access_token"]
    auth = {"Authorization": f"Bearer {token}"}
    assert requests.get(f"{url}/api/v2/dags", timeout=10).status_code == 401  # no token, no API
    dag = "graphtrim_optimize_model"
    deadline = time.monotonic() + 120
    while requests.get(f"{url}/api/v2/dags/{dag}", headers=auth, timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the DAG processor never parsed the DAG"
        time.sleep(2)
    r = requests.patch(
        f"{url}/api/v2/dags/{dag}", json={"is_paused": False}, headers=auth, timeout=10
    )
    assert r.status_code == 200, r.text
    conf = {
        "model_name": "digits-api",
        "version": "1",
        "variants": ["graph"],
        "policy": {"variants": {"graph": {"latency": {"min_speedup": 0.5, "runs": 60}}}},
    }
    r = requests.post(
        f"{url}/api/v2/dags/{dag}/dagRuns",
        json={"logical_date": None, "conf": conf},
        headers=auth,
        timeout=10,
    )
    assert r.status_code == 200, r.text
    run_id = r.json()["dag_run_id"]
    deadline = time.monotonic() + 420
    state = "queued"
    while time.monotonic() < deadline:
        state = requests.get(
            f"{url}/api/v2/dags/{dag}/dagRuns/{run_id}", headers=auth, timeout=10
        ).json()["state"]
        if state in ("success", "failed"):
            break
        time.sleep(3)
    tis = requests.get(
        f"{url}/api/v2/dags/{dag}/dagRuns/{run_id}/taskInstances", headers=auth, timeout=10
    ).json()["task_instances"]
    states = {(t["task_id"], t["map_index"]): t["state"] for t in tis}
    assert state == "success", (states, standalone["log"].read_text()[-3000:])
    assert states[("quantize", 0)] == "success" and states[("gate", 0)] == "success"
    client = mlflow.MlflowClient(standalone["tracking"], standalone["tracking"])
    found = client.search_model_versions("name='digits-api' and tags.`graphtrim.variant` = 'graph'")
    assert len(found) == 1
    assert found[0].tags["graphtrim.orchestrator_run_id"] == f"airflow:{dag}:{run_id}"
