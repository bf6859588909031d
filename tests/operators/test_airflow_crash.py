"""A stage task whose process crashes (a segmentation fault in native code, as onnxruntime can
have) ends FAILED within seconds under Airflow's real supervisor, instead of hanging for ever.

Airflow's DAG parser leaves a Python-level SIGSEGV handler installed in the task process; a
real fault in native code then repeats for ever (the process spins at full CPU, keeps
heartbeating, ignores SIGTERM, and its ``execution_timeout`` never fires). The stage operators
restore the default disposition around the stage (``fatal_signals_end_the_process``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import secrets
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.conftest import REPO
from tests.servers import free_port

AIRFLOW = str(Path(sys.executable).with_name("airflow"))


# ------------------------------------------------------------------ the context manager alone

_CHILD = """
import ctypes, signal, sys
from graphtrim.airflow.signals import fatal_signals_end_the_process

def python_handler(signum, frame):  # what Airflow's DAG parser installs
    print("python handler", flush=True)

signal.signal(signal.SIGSEGV, python_handler)
with fatal_signals_end_the_process():
    assert signal.getsignal(signal.SIGSEGV) == signal.SIG_DFL
    if sys.argv[1] == "crash":
        ctypes.string_at(0)
assert signal.getsignal(signal.SIGSEGV) is python_handler, signal.getsignal(signal.SIGSEGV)
print("restored", flush=True)
"""


def _child(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _CHILD, mode],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,  # only against a hang: a crash must end the process
    )


def test_a_fault_inside_the_block_ends_the_process_with_the_python_stack() -> None:
    done = _child("crash")
    assert done.returncode == -signal.SIGSEGV, (done.returncode, done.stderr[-2000:])
    assert "Fatal Python error: Segmentation fault" in done.stderr
    assert "string_at" in done.stderr  # the Python stack of the faulting thread


def test_the_block_puts_the_previous_handlers_back() -> None:
    done = _child("no-crash")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "restored"


# ------------------------------------------------------------------ a real task process

DAG_FILE = '''
"""Two tasks that segfault in native code: one a graphtrim stage, one a bare operator."""

from __future__ import annotations

import ctypes
import datetime as dt
import os
import pathlib
import time

from airflow.sdk import DAG, BaseOperator

from graphtrim.airflow.operators import GraphtrimStageOperator

MARKS = pathlib.Path(os.environ["GRAPHTRIM_CRASH_MARKS"])
BARE_TIMEOUT_S = 2


def segfault(name: str) -> None:
    (MARKS / name).write_text(str(os.getpid()))
    ctypes.string_at(0)  # reads address 0: SIGSEGV in native code


class BareCrash(BaseOperator):
    def execute(self, context):
        segfault("bare")


class StageCrash(GraphtrimStageOperator):
    def execute(self, context):
        # crash only once the bare task has crashed and outlived its execution_timeout
        deadline = time.monotonic() + 600  # only against a hang
        while not (MARKS / "bare").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(BARE_TIMEOUT_S + 1)
        self.delegate(segfault, "stage")


with DAG(
    "graphtrim_crash_probe",
    schedule=None,
    start_date=dt.datetime(2026, 1, 1),
    catchup=False,
    default_args={"retries": 0},
) as dag:
    BareCrash(task_id="bare", execution_timeout=dt.timedelta(seconds=BARE_TIMEOUT_S))
    StageCrash(task_id="stage", execution_timeout=dt.timedelta(minutes=10))
'''


def _states(db: Path) -> dict[str, tuple[str | None, str | None]]:
    """task id -> (state, end date) of the probe DAG's task instances."""
    try:
        with contextlib.closing(sqlite3.connect(db, timeout=10)) as con:
            rows = con.execute(
                "select task_id, state, end_date from task_instance "
                "where dag_id = 'graphtrim_crash_probe'"
            ).fetchall()
    except sqlite3.OperationalError:  # not created yet, or locked for a moment
        return {}
    return {r[0]: (r[1], r[2]) for r in rows}


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill_task_process(pid: int) -> None:
    """SIGKILL a task process this test started (checked by its command line)."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        if "airflow" in " ".join(psutil.Process(pid).cmdline()):
            os.kill(pid, signal.SIGKILL)


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """Stop a process started in its own session and everything left in its process group
    (LocalExecutor's workers outlive the ``dags test`` that forked them)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        proc.poll()
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


@pytest.fixture
def airflow_env(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A migrated Airflow home with the probe DAG, and an execution API server on 127.0.0.1
    (what LocalExecutor's supervisors talk to)."""
    home, dags, marks = tmp_path / "home", tmp_path / "dags", tmp_path / "marks"
    for d in (home, dags, marks):
        d.mkdir()
    (dags / "crash_probe.py").write_text(textwrap.dedent(DAG_FILE))
    port = free_port()
    env = dict(os.environ)
    env.update(
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__DAGS_FOLDER=str(dags),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{home / 'airflow.db'}",
        AIRFLOW__CORE__EXECUTOR="LocalExecutor",
        AIRFLOW__CORE__PARALLELISM="2",
        AIRFLOW__API__HOST="127.0.0.1",
        AIRFLOW__API__PORT=str(port),
        AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"http://127.0.0.1:{port}/execution/",
        AIRFLOW__API_AUTH__JWT_SECRET=secrets.token_hex(64),
        GRAPHTRIM_CRASH_MARKS=str(marks),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}",
    )
    subprocess.run([AIRFLOW, "db", "migrate"], check=True, capture_output=True, env=env)
    log = tmp_path / "api-server.log"
    serve = [AIRFLOW, "api-server", "--apps", "execution", "--workers", "1"]
    with open(log, "wb") as out:
        api = subprocess.Popen(
            [*serve, "--host", "127.0.0.1", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 300  # only against a hang
        while True:
            assert api.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"http://127.0.0.1:{port}/execution/health", timeout=10).ok:
                    break
            time.sleep(0.3)
        yield {"env": env, "home": home, "marks": marks, "tmp": tmp_path}
    finally:
        _stop_group(api)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # above the sum of the hang guards below
def test_a_crashing_stage_task_fails_instead_of_hanging(airflow_env: dict[str, Any]) -> None:
    env, home, marks = airflow_env["env"], airflow_env["home"], airflow_env["marks"]
    db = home / "airflow.db"
    log = airflow_env["tmp"] / "dags-test.log"
    # the DAG run with LocalExecutor: each task in its own supervised process, as in production
    with open(log, "wb") as out:
        run = subprocess.Popen(
            [AIRFLOW, "dags", "test", "graphtrim_crash_probe", "--use-executor"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 900  # only against a hang
        while _states(db).get("stage", (None,))[0] not in ("failed", "success"):
            assert run.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, (_states(db), log.read_text()[-4000:])
            time.sleep(0.2)
        seen_failed = time.time()
        states = _states(db)
        stage_pid = int((marks / "stage").read_text())
        bare_pid = int((marks / "bare").read_text())

        # the graphtrim stage: failed, its process gone
        assert states["stage"][0] == "failed", states
        assert not _alive(stage_pid)
        crashed = (marks / "stage").stat().st_mtime
        ended = dt.datetime.fromisoformat(str(states["stage"][1])).replace(tzinfo=dt.timezone.utc)
        print(
            f"stage task: crash -> end_date {ended.timestamp() - crashed:.1f} s, "
            f"failed seen {seen_failed - crashed:.1f} s"
        )

        # the bare operator crashed before it, and past its execution_timeout it still spins:
        # what every stage did before (a task that never ends, only SIGKILL stops it)
        assert states["bare"][0] == "running", states
        assert _alive(bare_pid)
        _kill_task_process(bare_pid)
        assert run.wait(timeout=120) in (0, 1), log.read_text()[-4000:]
        assert _states(db)["bare"][0] == "failed"

        # the task log holds the Python stack of the crash
        logs = list((home / "logs").rglob("*task_id=stage*/*.log"))
        text = "\n".join(p.read_text(errors="replace") for p in logs)
        assert "Segmentation fault" in text, [str(p) for p in logs]
        assert "segfault" in text and "crash_probe.py" in text
    finally:
        for name in ("bare", "stage"):
            with contextlib.suppress(FileNotFoundError, ValueError):
                _kill_task_process(int((marks / name).read_text()))
        _stop_group(run)
        print(json.dumps(_states(db)))
