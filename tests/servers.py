"""Real servers for integration tests: an MLflow tracking server and an S3 endpoint (moto).

Each binds 127.0.0.1 on a free port, keeps its state in a temporary folder, and is stopped by
PID when the fixture ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from tests.tiers import require

# (connect, read) seconds for one answer of a server a test started: a busy machine (the suite,
# the server and what else runs on two cores) can take many seconds for an answer that is
# instant when idle, so a slow answer is waited for and retried, never a test failure by itself
TIMEOUT = (10.0, 120.0)
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "PATCH", "DELETE"})


class _Session(requests.Session):
    """A session whose requests have :data:`TIMEOUT` unless they name their own."""

    def request(self, method: str | bytes, url: str | bytes, *args: Any, **kw: Any) -> Any:
        kw.setdefault("timeout", TIMEOUT)
        return super().request(method, url, *args, **kw)


def http_session(*, attempts: int = 6, backoff: float = 1.0) -> requests.Session:
    """A ``requests`` session for the servers tests start (MLflow, Airflow's API server): a
    refused connection, a read timeout or a 5xx answer is retried ``attempts`` times with
    exponential backoff. Connections refused before the request was sent are retried for every
    method; read timeouts and 5xx only for idempotent ones (a POST that creates something, such
    as a DAG run, is not sent twice)."""
    retry = Retry(
        total=attempts,
        connect=attempts,
        read=attempts,
        status=attempts,
        other=0,
        backoff_factor=backoff,
        backoff_max=30,
        status_forcelist=(500, 502, 503, 504),
        allowed_methods=_IDEMPOTENT,
        raise_on_status=False,
    )
    session = _Session()
    adapter = HTTPAdapter(max_retries=retry)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def _wait(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    """Poll ``url`` until the server answers; ``timeout`` only guards against a hang (a server
    that exits fails at once)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if requests.get(url, timeout=10).status_code < 500:
                return
        except requests.RequestException:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"server at {url} not healthy after {timeout} s:\n{log.read_text()[-3000:]}")


def stop_process_group(proc: subprocess.Popen[Any]) -> None:
    """Stop a server started with ``start_new_session=True``, its children too: SIGTERM to
    the group, SIGKILL if it is still there after 30 s."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


def _env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        MLFLOW_DISABLE_TELEMETRY="true",
        # MLflow's server job runner (huey consumers: GenAI scorers and prompt optimization)
        # starts eight more processes per server; graphtrim submits no jobs
        MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
        HOME=str(home),
        XDG_CACHE_HOME=str(home / "cache"),
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )
    return env


@contextlib.contextmanager
def fake_aws_credentials() -> Iterator[None]:
    """moto's test credentials in this process's environment for the block (boto3 and the
    MLflow client read them there), the previous values restored after it."""
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def mlflow_server(folder: Path, backend: str | None = None) -> Iterator[str]:
    """``mlflow server`` on SQLite (or the ``backend`` store URI, e.g. PostgreSQL) with proxied
    local artifacts; yields its URL."""
    require("server")
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = folder / "mlflow-server.log"
    cmd = [
        _bin("mlflow"),
        "server",
        "--backend-store-uri",
        backend or f"sqlite:///{folder / 'mlflow.db'}",
        "--artifacts-destination",
        str(folder / "artifacts"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(folder), start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(url + "/health", proc, log, timeout=600)
        yield url
    finally:
        stop_process_group(proc)


@contextlib.contextmanager
def moto_server(folder: Path) -> Iterator[str]:
    """An S3 endpoint (moto's server); yields its URL."""
    require("server")
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = folder / "moto.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [_bin("moto_server"), "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_env(folder),
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(url + "/moto-api/", proc, log, timeout=300)
        yield url
    finally:
        stop_process_group(proc)


def register_onnx(
    tracking: str, path: Path, name: str, *, artifact_dir: Path | None = None, **tags: str
) -> str:
    """Log the ONNX file at ``path`` as an MLflow model, register it as a new version of
    ``name`` (with registered-model ``tags``) and return the version. For an embedded
    (database) tracking URI, ``artifact_dir`` keeps the MLflow artifacts out of the cwd."""
    import mlflow
    import onnx

    client = mlflow.MlflowClient(tracking, tracking)
    experiment = None
    if artifact_dir is not None:
        found = client.get_experiment_by_name("sources")
        experiment = (
            found.experiment_id
            if found is not None
            else client.create_experiment("sources", artifact_location=artifact_dir.as_uri())
        )
    mlflow.set_tracking_uri(tracking)
    with mlflow.start_run(experiment_id=experiment):
        info = mlflow.onnx.log_model(
            onnx.load(str(path)), name="model", registered_model_name=name, pip_requirements=[]
        )
    for key, value in tags.items():
        client.set_registered_model_tag(name, key, value)
    return str(info.registered_model_version)


@contextlib.contextmanager
def airflow_api_server(env: dict[str, str], log: Path, *, deadline: float = 300) -> Iterator[str]:
    """``airflow api-server`` (one worker) on 127.0.0.1 with ``env`` (its database, its
    settings), the DAGs of its DAGS_FOLDER serialized first; yields its URL once healthy and
    stops it by PID. ``deadline`` only guards against a hang."""
    require("server")
    airflow = str(Path(sys.executable).with_name("airflow"))
    subprocess.run([airflow, "dags", "reserialize"], check=True, capture_output=True, env=env)
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [airflow, "api-server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + deadline
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < end, log.read_text()[-3000:]
            try:
                if requests.get(f"{url}/api/v2/monitor/health", timeout=10).ok:
                    break
            except requests.RequestException:
                pass
            time.sleep(1)
        yield url
    finally:
        stop_process_group(proc)
