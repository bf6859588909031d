"""The README's main command: the Airflow demo, twice in one folder, its console a page a
person reads (graphtrim's own lines; everything else in the log file it names)."""

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
            [sys.executable, "-m", "graphtrim.demo", str(out)],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=RUN_LIMIT_S,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    first = run()
    lines = first.splitlines()
    assert len(lines) <= 40, first
    log = out / "demo.log"
    assert str(log) in lines[0] and str(log) in lines[-1]
    assert "the DAG run: manual__" in first and ": success" in first
    assert "int8-static" in first and "@int8-static-candidate" in first
    # what other programs print is in the log, none of it on the console
    for noise in ("Emitting event for inactive", "already registered", "Warning", "alembic"):
        assert noise not in first, noise
    assert "task instances: " in log.read_text()
    tracking = f"sqlite:///{out / 'mlflow' / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking, tracking)
    versions = {v.version for v in client.search_model_versions("name='digits-cnn'")}
    second = run()
    assert len(second.splitlines()) <= 40, second
    assert "reusing version 1 of 'digits-cnn'" in second
    assert "(existing)" in second
    assert {v.version for v in client.search_model_versions("name='digits-cnn'")} == versions
    # each stage was its own task instance (the log has them all)
    text = log.read_text()
    for task in ("export=success", "optimize=success", "quantize[0]=success", "gate[3]=success"):
        assert task in text
    # the console named each stage as it ended, the mapped ones with their variants
    for stage in ("export", "optimize", "quantize", "gate", "register", "promote"):
        assert any(line.split()[:1] == [stage] for line in lines), stage


def test_the_airflow_adapter_imports_no_examples() -> None:
    from tests.test_layering import import_graph

    edges = import_graph()
    adapter = {m: e for m, e in edges.items() if m.startswith("graphtrim.airflow")}
    assert adapter
    bad = {
        m: sorted(t for t in e if t.startswith("graphtrim.examples")) for m, e in adapter.items()
    }
    assert not {m: t for m, t in bad.items() if t}, bad
