"""A pipeline run left RUNNING by a worker that died on another host is closed from the
orchestrator's own state of the task instance its stage recorded, not from a pid (which means
nothing off the host that started it)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import pytest

from graphtrim.stages import tracking

mlflow = pytest.importorskip("mlflow")


def _task(task_id: str, map_index: int = -1) -> dict[str, Any]:
    return {
        "name": "Airflow",
        "dag_id": "graphtrim_optimize_model",
        "run_id": "manual__2026-12-07",
        "task_id": task_id,
        "map_index": map_index,
        "try_number": 1,
    }


def test_a_run_whose_task_ended_in_airflow_is_closed_wherever_it_ran(
    servers: dict[str, str],
) -> None:
    client = mlflow.MlflowClient(servers["mlflow"], servers["mlflow"])
    exp = tracking.experiment_id(client, "dead-runs-elsewhere")
    # pid 1 exists here: on this host the pid check would call each of these alive
    elsewhere = {"host": "worker-on-another-host", "pid": 1}

    def run_with(**stages: Mapping[str, Any]) -> Any:
        tags = {"graphtrim.pipeline": "1"}
        for label, ti in stages.items():
            tags[f"graphtrim.worker.{label}"] = json.dumps({**elsewhere, "orchestrator": ti})
        return client.create_run(exp, tags=tags)

    states = {"quantize": "failed", "gate_0": "up_for_retry", "gate_1": "running"}
    asked: list[str] = []

    def task_state(worker: Mapping[str, Any]) -> str | None:
        ti = worker["orchestrator"]
        key = ti["task_id"] + (f"_{ti['map_index']}" if ti["map_index"] >= 0 else "")
        asked.append(key)
        return states.get(key)

    failed = run_with(quantize=_task("quantize"))
    retrying = run_with(**{"gate.fp16": _task("gate", 0)})
    running = run_with(**{"gate.fp16": _task("gate", 0), "gate.graph": _task("gate", 1)})
    unknown = run_with(export=_task("export"))  # Airflow has no such task instance

    # without the orchestrator's state nothing is known about another host's worker
    assert tracking.close_dead_runs(client, exp) == []
    closed = tracking.close_dead_runs(client, exp, task_state)
    assert sorted(closed) == sorted([failed.info.run_id, retrying.info.run_id])
    got = client.get_run(failed.info.run_id)
    assert got.info.status == "KILLED"
    error = got.data.tags["graphtrim.error"]
    assert "graphtrim_optimize_model/manual__2026-12-07/quantize is failed in Airflow" in error
    assert (
        "[0] is up_for_retry" in client.get_run(retrying.info.run_id).data.tags["graphtrim.error"]
    )
    for alive in (running, unknown):
        assert client.get_run(alive.info.run_id).info.status == "RUNNING"
    assert "export" in asked


def test_an_orchestrator_that_cannot_answer_leaves_the_pid_check(servers: dict[str, str]) -> None:
    import socket
    import subprocess
    import sys

    client = mlflow.MlflowClient(servers["mlflow"], servers["mlflow"])
    exp = tracking.experiment_id(client, "dead-runs-unanswered")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    worker = {"host": socket.gethostname(), "pid": dead.pid, "orchestrator": _task("export")}
    run = client.create_run(
        exp,
        tags={"graphtrim.pipeline": "1", "graphtrim.worker.export": json.dumps(worker)},
    )

    def unreachable(_worker: Mapping[str, Any]) -> str | None:
        raise ConnectionError("the API server is down")

    assert tracking.close_dead_runs(client, exp, unreachable) == [run.info.run_id]
    got = client.get_run(run.info.run_id)
    assert f"({dead.pid} on {socket.gethostname()}) is gone" in got.data.tags["graphtrim.error"]
    assert os.getpid() != dead.pid
