"""A real, distributed graphtrim deployment on 127.0.0.1, for tests and for
``python -m tests.deployment`` (which brings it up and waits):

- PostgreSQL: a fresh database for Airflow's metadata and one for MLflow (created here, dropped
  on the way out);
- MLflow's tracking server on its PostgreSQL database, artifacts proxied to S3 (moto's server);
- Airflow 3 with ``CeleryExecutor`` (broker: Redis, a database number of its own; result
  backend: PostgreSQL), its API server, scheduler and DAG processor;
- two Celery workers: ``cpu-worker`` consuming the ``default`` and ``cpu`` queues and
  ``gpu-worker`` consuming ``gpu``. This machine has no GPU: the gpu worker alone is started with
  ``GRAPHTRIM_TEST_GPU_ON_CPU=1``, so the stages routed to it say in their logs that they run on
  the CPU provider. It proves routing, not GPU speed.

Every process is started in its own session and stopped by its process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests

from tests.servers import free_port
from tests.tiers import require

REPO = Path(__file__).resolve().parents[1]
PG = os.environ.get("GRAPHTRIM_TEST_PG", "postgresql://postgres@127.0.0.1:5432")
REDIS = os.environ.get("GRAPHTRIM_TEST_REDIS", "redis://127.0.0.1:6379")


def _psql(sql: str) -> None:
    host = PG.split("@", 1)[1].split(":")[0]
    user = PG.split("//", 1)[1].split("@")[0]
    subprocess.run(
        ["psql", "-h", host, "-U", user, "-d", "postgres", "-v", "ON_ERROR_STOP=1", "-c", sql],
        check=True,
        capture_output=True,
    )


@contextlib.contextmanager
def database(prefix: str) -> Iterator[str]:
    require("server")
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    _psql(f"CREATE DATABASE {name}")
    try:
        yield f"{PG}/{name}"
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            _psql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


class Processes:
    """Started processes, each in its own session; stopped by process group, last first."""

    def __init__(self, logs: Path):
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}.log", "wb") as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.procs[name] = proc
        return proc

    def log(self, name: str, tail: int = 3000) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace")[-tail:] if path.exists() else ""

    def check(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log(name)}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Kill a process on purpose: it is no longer watched by ``check`` (start it again
        under the same name to watch the new one)."""
        proc = self.procs.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        proc.wait(timeout=30)

    def stop_all(self) -> None:
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def _wait_http(url: str, procs: Processes, timeout: float, ok: Any = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs.check()
        try:
            r = requests.get(url, timeout=10)
            if r.status_code < 500 and (ok is None or ok(r)):
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not ready after {timeout} s")


@contextlib.contextmanager
def redis_database() -> Iterator[int]:
    """A Redis database number (1-15) no other deployment on this machine uses meanwhile.

    Two deployments on one broker database would take each other's tasks: a worker would run
    a task of the other deployment and call its own API server with the other scheduler's
    token ("Invalid auth token"), and both runs would hang. A lock file per number, held for
    the deployment's lifetime, keeps concurrent test processes apart; a database that already
    holds keys (someone else's) is never taken, since the deployment flushes it."""
    require("server")
    import fcntl
    import tempfile

    numbers = list(range(1, 16))
    random.shuffle(numbers)
    for n in numbers:
        lock = open(Path(tempfile.gettempdir()) / f"graphtrim-redis-db-{n}.lock", "w")  # noqa: SIM115
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            continue
        size = subprocess.run(
            ["redis-cli", "-u", f"{REDIS}/{n}", "DBSIZE"], capture_output=True, text=True
        ).stdout.strip()
        if size not in ("0", ""):
            lock.close()  # someone else's data: leave it alone
            continue
        try:
            yield n
        finally:
            lock.close()  # closing the file releases the lock
        return
    raise RuntimeError("no free Redis database (1-15) on this machine")


@contextlib.contextmanager
def deployment(
    root: Path, *, s3: str, bucket: str, executor: str = "CeleryExecutor"
) -> Iterator[dict[str, Any]]:
    """Bring the deployment up under ``root`` (logs, Airflow home); yields its coordinates.
    ``executor="LocalExecutor"`` runs the tasks in the scheduler's own processes instead (no
    broker, no workers): the baseline that the Celery overhead is measured against."""
    root.mkdir(parents=True, exist_ok=True)
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    procs = Processes(logs)
    with (
        redis_database() as redis_db,
        database("graphtrim_airflow") as airflow_db,
        database("graphtrim_mlflow") as mlflow_db,
    ):
        try:
            base = dict(os.environ)
            base.update(
                MLFLOW_DISABLE_TELEMETRY="true",
                AWS_ACCESS_KEY_ID="testing",
                AWS_SECRET_ACCESS_KEY="testing",
                AWS_DEFAULT_REGION="us-east-1",
                PATH=f"{Path(sys.executable).parent}:{base.get('PATH', '')}",
            )
            mlflow_port = free_port()
            # no job runner: graphtrim submits no MLflow server jobs (see tests/servers.py)
            mlflow_env = dict(
                base,
                MLFLOW_S3_ENDPOINT_URL=s3,
                MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
                HOME=str(root),
            )
            procs.start(
                "mlflow",
                [
                    _bin("mlflow"),
                    "server",
                    "--backend-store-uri",
                    mlflow_db.replace("postgresql://", "postgresql+psycopg2://"),
                    "--artifacts-destination",
                    f"s3://{bucket}/mlflow",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(mlflow_port),
                    "--workers",
                    "1",
                ],
                mlflow_env,
            )
            mlflow_url = f"http://127.0.0.1:{mlflow_port}"
            api_port = free_port()
            home = root / "airflow"
            home.mkdir(exist_ok=True)
            airflow_env = dict(base)
            airflow_env.update(
                AIRFLOW_HOME=str(home),
                AIRFLOW__CORE__DAGS_FOLDER=str(REPO / "dags"),
                AIRFLOW__CORE__LOAD_EXAMPLES="False",
                AIRFLOW__CORE__EXECUTOR=executor,
                AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=airflow_db.replace(
                    "postgresql://", "postgresql+psycopg2://"
                ),
                AIRFLOW__CELERY__BROKER_URL=f"{REDIS}/{redis_db}",
                AIRFLOW__CELERY__RESULT_BACKEND="db+"
                + airflow_db.replace("postgresql://", "postgresql+psycopg2://"),
                AIRFLOW__API__HOST="127.0.0.1",
                AIRFLOW__API__PORT=str(api_port),
                AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"http://127.0.0.1:{api_port}/execution/",
                AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS="True",
                AIRFLOW__CORE__PARALLELISM="4",
                AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT="600",
                # a killed worker's task is declared dead (and retried) within half a minute
                AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT="20",
                AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL="5",
                # the task supervisor waits up to this long (default 5 s) in one poll: when the
                # task process closes its pipes just before it exits, the exit is noticed a
                # whole interval late and the worker slot stays taken. Measured (N = 20, Celery):
                # with 5, 38 of 180 tasks held their slot 5 s past their end, 114 versions/h;
                # with 1, 29 held it 1 s, none longer, 167 versions/h (the price: one heartbeat
                # a second per running task to the API server)
                AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL="1",
                # workers import graphtrim's stage modules (MLflow, onnx, boto3) once at start;
                # each task process they fork inherits them instead of importing them again
                AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS="graphtrim.airflow.celery_config.CELERY_CONFIG",
                AIRFLOW_CONN_MLFLOW_DEFAULT=json.dumps(
                    {"conn_type": "graphtrim_mlflow", "host": mlflow_url}
                ),
                AIRFLOW_CONN_AWS_DEFAULT=json.dumps(
                    {
                        "conn_type": "aws",
                        "login": "testing",
                        "password": "testing",
                        "extra": {"endpoint_url": s3, "region_name": "us-east-1"},
                    }
                ),
                GRAPHTRIM_ARTIFACTS=f"s3://{bucket}/pipeline",
            )
            subprocess.run(
                ["redis-cli", "-u", f"{REDIS}/{redis_db}", "FLUSHDB"], capture_output=True
            )
            migrated = subprocess.run(
                [_bin("airflow"), "db", "migrate"], env=airflow_env, capture_output=True, text=True
            )
            if migrated.returncode != 0:
                raise RuntimeError(f"airflow db migrate failed:\n{migrated.stderr[-3000:]}")
            subprocess.run(
                [_bin("airflow"), "pools", "set", "graphtrim_gpu", "1", "GPU stages"],
                env=airflow_env,
                check=True,
                capture_output=True,
            )
            procs.start("api-server", [_bin("airflow"), "api-server"], airflow_env)
            # no log server (it binds every interface); the task logs are local files here
            procs.start(
                "scheduler", [_bin("airflow"), "scheduler", "--skip-serve-logs"], airflow_env
            )
            procs.start("dag-processor", [_bin("airflow"), "dag-processor"], airflow_env)
            workers = {
                "cpu-worker": (["default", "cpu"], {}),
                "gpu-worker": (["gpu"], {"GRAPHTRIM_TEST_GPU_ON_CPU": "1"}),
                # a second worker on the gpu queue, started by the tests that need two
                "gpu-worker-2": (["gpu"], {"GRAPHTRIM_TEST_GPU_ON_CPU": "1"}),
            }

            def start_worker(name: str, **env: str) -> None:
                """Start worker ``name``; ``env``: more environment for it (a fault point)."""
                queues, extra = workers[name]
                procs.start(
                    name,
                    [
                        _bin("airflow"),
                        "celery",
                        "worker",
                        "--concurrency",
                        "1",
                        # no log server: it binds every interface, and the logs are local files
                        "--skip-serve-logs",
                        "--queues",
                        ",".join(queues),
                        "--celery-hostname",
                        f"{name}@%h",
                    ],
                    dict(airflow_env, GRAPHTRIM_WORKER_NAME=name, **extra, **env),
                )

            if executor == "CeleryExecutor":
                for name in ("cpu-worker", "gpu-worker"):
                    start_worker(name)
            api = f"http://127.0.0.1:{api_port}"
            _wait_http(mlflow_url + "/health", procs, 600)
            _wait_http(
                api + "/api/v2/monitor/health",
                procs,
                600,  # only against a hang: a busy machine starts the scheduler slowly
                ok=lambda r: r.json().get("scheduler", {}).get("status") == "healthy",
            )
            yield {
                "api": api,
                "mlflow": mlflow_url,
                "s3": s3,
                "bucket": bucket,
                "procs": procs,
                "env": airflow_env,
                "airflow_db": airflow_db,
                "start_worker": start_worker,
            }
        finally:
            procs.stop_all()
            subprocess.run(
                ["redis-cli", "-u", f"{REDIS}/{redis_db}", "FLUSHDB"], capture_output=True
            )


def run_dag(
    d: dict[str, Any], dag: str, conf: dict[str, Any], timeout: float = 1800
) -> dict[str, Any]:
    """Trigger ``dag`` on deployment ``d`` and wait for its run to end; returns its run id,
    state and task instances. ``timeout`` only guards against a hang."""
    from tests.servers import http_session

    # a call retried while the API server is too busy to answer (a POST only while it refuses
    # the connection: a DAG run is never triggered twice)
    http = http_session()
    api = d["api"]
    deadline = time.monotonic() + 600
    while http.get(f"{api}/api/v2/dags/{dag}").status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{dag} not parsed:\n{d['procs'].log('dag-processor')}")
        time.sleep(2)
    http.patch(f"{api}/api/v2/dags/{dag}", json={"is_paused": False})
    r = http.post(f"{api}/api/v2/dags/{dag}/dagRuns", json={"logical_date": None, "conf": conf})
    if r.status_code != 200:
        raise RuntimeError(f"triggering {dag}: {r.status_code} {r.text}")
    run_id = r.json()["dag_run_id"]
    deadline = time.monotonic() + timeout
    while True:
        d["procs"].check()
        state = http.get(f"{api}/api/v2/dags/{dag}/dagRuns/{run_id}").json()["state"]
        if state in ("success", "failed") or time.monotonic() > deadline:
            break
        time.sleep(3)
    tis = http.get(f"{api}/api/v2/dags/{dag}/dagRuns/{run_id}/taskInstances").json()
    return {"run_id": run_id, "state": state, "tis": tis["task_instances"]}


def main() -> int:
    """Bring a deployment up and keep it until Ctrl-C, printing its URLs."""
    import tempfile

    import boto3

    from tests.servers import moto_server

    root = Path(tempfile.mkdtemp(prefix="graphtrim-deployment-"))
    # SIGTERM unwinds like Ctrl-C: every process stopped, the databases dropped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    with moto_server(root / "s3") as s3:
        boto3.client("s3", endpoint_url=s3, region_name="us-east-1").create_bucket(
            Bucket="graphtrim"
        )
        with deployment(root, s3=s3, bucket="graphtrim") as d:
            print(f"Airflow API  {d['api']}  (all users admin)")
            print(f"MLflow       {d['mlflow']}")
            print(f"S3 (moto)    {s3}  bucket graphtrim")
            print(f"logs         {root / 'logs'}")
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    d["procs"].check()
                    time.sleep(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
