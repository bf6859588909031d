"""The README's main command: the Airflow demo, twice in one folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

# Each demo run takes minutes, and many more on a busy machine: the limits below only guard
# against a hang (two runs of at most RUN_LIMIT_S each, inside the test's own limit)
RUN_LIMIT_S = 1800


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_LIMIT_S + 300)
def test_airflow_demo_runs_and_a_second_run_registers_nothing_new(tmp_path: Path) -> None:
    import mlflow

    out = tmp_path / "demo"

    def run() -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "graphtrim.airflow.demo", str(out)],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=RUN_LIMIT_S,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    first = run()
    assert "DAG run manual__" in first and ": success" in first
    assert "int8-static" in first and "@int8-static-candidate" in first
    tracking = f"sqlite:///{out / 'mlflow' / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking, tracking)
    versions = {v.version for v in client.search_model_versions("name='digits-cnn'")}
    second = run()
    assert "reusing version 1 of 'digits-cnn'" in second
    assert "(existing)" in second
    assert {v.version for v in client.search_model_versions("name='digits-cnn'")} == versions
    # each stage was its own task instance
    for task in ("export=success", "optimize=success", "quantize[0]=success", "gate[3]=success"):
        assert task in second
