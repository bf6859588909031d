"""What CI does: Airflow 3 running for real (``airflow standalone``: API server, scheduler,
DAG processor, triggerer, LocalExecutor) on 127.0.0.1, the optimize DAG triggered over the REST
API v2 with ``conf`` and a bearer token, polled until it succeeds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from graphtrim.examples.digits import DigitsTask
from tests.conftest import REPO
from tests.servers import free_port, http_session, register_onnx, stop_process_group

# the deadlines below only guard against a hang; the test limit is above their sum
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]


@pytest.fixture(scope="module")
def standalone(
    tmp_path_factory: pytest.TempPathFactory, digits_task: DigitsTask
) -> Iterator[dict[str, Any]]:
    tmp_path = tmp_path_factory.mktemp("standalone")
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    register_onnx(tracking, digits_task.model, "digits-api", artifact_dir=tmp_path / "mlruns")
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
        deadline = time.monotonic() + 900  # only against a hang: a busy machine starts slowly
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"airflow standalone exited:\n{log.read_text()[-3000:]}")
            try:
                health = requests.get(f"{url}/api/v2/monitor/health", timeout=30).json()
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
        yield {
            "url": url,
            "user": user,
            "password": password,
            "tracking": tracking,
            "log": log,
            "http": http_session(),
        }
    finally:
        stop_process_group(proc)


def test_trigger_optimize_dag_over_rest_api(standalone: dict[str, Any]) -> None:
    import mlflow

    url, http = standalone["url"], standalone["http"]
    token = http.post(
        f"{url}/auth/token",
        json={"username": standalone["user"], "password": standalone["password"]},
    ).json()["access_token"]
    auth = {"Authorization": f"Bearer {token}"}
    assert http.get(f"{url}/api/v2/dags").status_code == 401  # no token, no API
    dag = "graphtrim_optimize_model"
    deadline = time.monotonic() + 600  # only against a hang
    while http.get(f"{url}/api/v2/dags/{dag}", headers=auth).status_code != 200:
        assert time.monotonic() < deadline, "the DAG processor never parsed the DAG"
        time.sleep(2)
    r = http.patch(f"{url}/api/v2/dags/{dag}", json={"is_paused": False}, headers=auth)
    assert r.status_code == 200, r.text
    conf = {
        "model_name": "digits-api",
        "version": "1",
        "variants": ["graph"],
        "policy": {"variants": {"graph": {"latency": {"min_speedup": None, "runs": 60}}}},
    }
    r = http.post(
        f"{url}/api/v2/dags/{dag}/dagRuns", json={"logical_date": None, "conf": conf}, headers=auth
    )
    assert r.status_code == 200, r.text
    run_id = r.json()["dag_run_id"]
    deadline = time.monotonic() + 1800  # only against a hang
    state = "queued"
    while time.monotonic() < deadline:
        state = http.get(f"{url}/api/v2/dags/{dag}/dagRuns/{run_id}", headers=auth).json()["state"]
        if state in ("success", "failed"):
            break
        time.sleep(3)
    tis = http.get(f"{url}/api/v2/dags/{dag}/dagRuns/{run_id}/taskInstances", headers=auth).json()[
        "task_instances"
    ]
    states = {(t["task_id"], t["map_index"]): t["state"] for t in tis}
    assert state == "success", (states, standalone["log"].read_text()[-3000:])
    assert states[("quantize", 0)] == "success" and states[("gate", 0)] == "success"
    client = mlflow.MlflowClient(standalone["tracking"], standalone["tracking"])
    found = client.search_model_versions("name='digits-api' and tags.`graphtrim.variant` = 'graph'")
    assert len(found) == 1
    assert found[0].tags["graphtrim.orchestrator_run_id"] == f"airflow:{dag}:{run_id}"


# ---------------------------------------------------------------------------- graphtrim trigger


def _trigger(
    standalone: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    *args: str,
    user: str | None = None,
    password: str | None = None,
) -> tuple[int, str, str]:
    from graphtrim.cli import main

    for key in (
        "GRAPHTRIM_AIRFLOW_TOKEN",
        "GRAPHTRIM_AIRFLOW_USERNAME",
        "GRAPHTRIM_AIRFLOW_PASSWORD",
    ):
        monkeypatch.delenv(key, raising=False)
    if user is not None:
        monkeypatch.setenv("GRAPHTRIM_AIRFLOW_USERNAME", user)
    if password is not None:
        monkeypatch.setenv("GRAPHTRIM_AIRFLOW_PASSWORD", password)
    monkeypatch.setenv("GRAPHTRIM_AIRFLOW_URL", standalone["url"])
    code = main(["trigger", "--model", "digits-api", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_trigger_waits_and_reports_success(
    standalone: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = standalone["log"].parent / "gates.yaml"
    policy.write_text(
        "variants:\n  graph: {latency: {min_speedup: null, runs: 60}}\n"
        "  int8-dynamic: {latency: {min_speedup: null, runs: 60}}\n"
    )
    code, out, err = _trigger(
        standalone,
        monkeypatch,
        capsys,
        "--version",
        "1",
        "--variants",
        "graph,int8-dynamic",
        "--policy",
        str(policy),
        "--wait",
        "--poll",
        "2",
        "--timeout",
        "1800",  # only against a hang
        user=standalone["user"],
        password=standalone["password"],
    )
    assert code == 0, out + err
    assert "triggered graphtrim_optimize_model run " in out
    assert "int8-dynamic" in out and "PASS" in out  # the summary table
    assert "register=success" in out


def test_cli_trigger_failed_run_exits_1_without_retries(
    standalone: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _trigger(
        standalone,
        monkeypatch,
        capsys,
        "--version",
        "99",
        "--variants",
        "graph",
        "--wait",
        "--poll",
        "2",
        "--timeout",
        "1800",  # only against a hang
        user=standalone["user"],
        password=standalone["password"],
    )
    assert code == 1, out + err
    assert "failed" in err and "export" in err
    assert "export=failed" in out
    # a missing version is not retried: the export task failed on its first try, without
    # waiting out the retry delays
    run_id = out.split("triggered graphtrim_optimize_model run ", 1)[1].split()[0]
    url, http = standalone["url"], standalone["http"]
    token = http.post(
        f"{url}/auth/token",
        json={"username": standalone["user"], "password": standalone["password"]},
    ).json()["access_token"]
    export = http.get(
        f"{url}/api/v2/dags/graphtrim_optimize_model/dagRuns/{run_id}/taskInstances/export",
        headers={"Authorization": f"Bearer {token}"},
    ).json()
    assert (export["state"], export["try_number"]) == ("failed", 1), export


def test_cli_trigger_refused_credentials_are_a_clear_error(
    standalone: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _trigger(
        standalone, monkeypatch, capsys, "--version", "1", user="admin", password="wrong"
    )
    assert code == 2
    assert "refused the credentials of user 'admin'" in err
    code, _, err = _trigger(standalone, monkeypatch, capsys, "--version", "1")
    assert code == 2
    assert "needs credentials" in err and "GRAPHTRIM_AIRFLOW_USERNAME" in err
    monkeypatch.setenv("GRAPHTRIM_AIRFLOW_URL", f"http://127.0.0.1:{free_port()}")
    from graphtrim.cli import main

    assert main(["trigger", "--model", "m", "--version", "1"]) == 2
    assert "cannot reach the Airflow API" in capsys.readouterr().err


# ---------------------------------------------------------------------------- the client alone


def test_client_retries_gateway_answers_and_masks_credentials_in_refusals() -> None:
    """Behind a gateway that answers 503 while the API server restarts, a read is tried again;
    an error of the API itself is not, and its message masks the token and the URL's
    userinfo. The gateway is a local HTTP server."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from graphtrim.airflow.rest import AirflowApiError, AirflowClient

    token = "tok-" + os.urandom(8).hex()
    run = {
        "dag_display_name": "d",
        "dag_id": "d",
        "dag_run_id": "r",
        "dag_versions": [],
        "run_after": "2026-01-01T00:00:00Z",
        "run_type": "manual",
        "state": "success",
        "conf": {"model_name": "m"},
    }
    answers = [503, 503, 200, 500]
    seen: list[tuple[str, str | None]] = []

    class Gateway(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append((self.path, self.headers.get("Authorization")))
            status = answers.pop(0) if answers else 500
            doc = run if status == 200 else {"detail": f"cannot use token {token}"}
            body = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = AirflowClient(f"http://127.0.0.1:{server.server_port}", token=token, retries=3)
        got = client.run("d", "r")
        assert (got.state, got.conf) == ("success", {"model_name": "m"})
        assert seen == [("/api/v2/dags/d/dagRuns/r", f"Bearer {token}")] * 3
        with pytest.raises(AirflowApiError) as info:
            client.run("d", "r")
        assert len(seen) == 4  # a 500 is the API's answer, not a gateway's: not tried again
        assert "GET /api/v2/dags/d/dagRuns/r: 500" in str(info.value)
        assert token not in str(info.value)
    finally:
        server.shutdown()
        server.server_close()
    secret = "pw-" + os.urandom(8).hex()
    client = AirflowClient(f"http://user:{secret}@127.0.0.1:{free_port()}", retries=0)
    with pytest.raises(AirflowApiError, match="cannot reach the Airflow API") as info:
        client.run("d", "r")
    assert secret not in str(info.value)
