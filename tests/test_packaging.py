"""The built wheel installed as a user installs it: into a clean virtual environment, with one
extra at a time, each command then run. The core pulls no Airflow, MLflow, torch, matplotlib or
onnxruntime; a command whose extra is missing says which to install; with the extra it runs.

Packages come from the registry pip is configured with (pinned by ``constraints.txt``), into
a pip cache inside the test's temporary folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

HEAVY = ("apache-airflow", "mlflow", "mlflow-skinny", "torch", "matplotlib", "onnxruntime")


def _run(cmd: list[str], env: dict[str, str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200, **kw)  # type: ignore[call-overload]


def _installed(python: Path, env: dict[str, str]) -> set[str]:
    out = _run([str(python), "-m", "pip", "list", "--format=freeze"], env)
    assert out.returncode == 0, out.stderr
    return {line.split("==")[0].lower() for line in out.stdout.splitlines() if "==" in line}


def _model(path: Path) -> Path:
    """x + 0 then an Identity: one node for the optimizer to remove."""
    zero = helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["x", "zero"], ["a"]),
            helper.make_node("Identity", ["a"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
        [zero],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_the_wheel_installs_each_extra_into_a_clean_venv(tmp_path: Path) -> None:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_"))
    }
    env.update(
        PIP_CACHE_DIR=str(tmp_path / "pip-cache"),
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        HOME=str(tmp_path),
        MLFLOW_DISABLE_TELEMETRY="true",
    )
    built = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(REPO),
        ],
        env,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("graphtrim-*.whl")
    venv = tmp_path / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)], env).returncode == 0
    python, graphtrim = venv / "bin" / "python", venv / "bin" / "graphtrim"
    constraints = ["-c", str(REPO / "constraints.txt")]

    def install(extras: str) -> None:
        spec = f"graphtrim[{extras}] @ {wheel.as_uri()}" if extras else str(wheel)
        done = _run([str(python), "-m", "pip", "install", "-q", *constraints, spec], env)
        assert done.returncode == 0, done.stderr[-3000:]

    # the core: onnx, onnx-ir, numpy, PyYAML and nothing heavy
    install("")
    assert not set(HEAVY) & _installed(python, env), _installed(python, env)
    version = _run([str(graphtrim), "--version"], env)
    assert version.returncode == 0 and "0.1.0" in version.stdout + version.stderr
    # the DAG files come with the wheel, where `graphtrim dags-folder` says
    folder = _run([str(graphtrim), "dags-folder"], env)
    assert folder.returncode == 0, folder.stderr[-2000:]
    dags = Path(folder.stdout.strip())
    assert dags == venv / "share" / "graphtrim" / "dags", dags
    assert sorted(p.name for p in dags.glob("*.py")) == sorted(
        p.name for p in (REPO / "dags").glob("*.py")
    )
    passes = _run([str(graphtrim), "passes"], env)
    assert passes.returncode == 0 and "dead-code" in passes.stdout, passes.stderr[-2000:]
    model = _model(tmp_path / "m.onnx")
    out = tmp_path / "out.onnx"
    # commands whose extra is missing: one line naming it, exit 2, no traceback
    for cmd, extra in (
        (["optimize", str(model), "-o", str(out), "--verify"], "cpu"),
        (
            ["pipeline", "run", "--model", "models:/m/1", "--tracking-uri", "sqlite:///x.db"],
            "pipeline",
        ),
        (
            ["trigger", "--airflow-url", "http://127.0.0.1:9", "--model", "m", "--version", "1"],
            "airflow-client",
        ),
    ):
        got = _run([str(graphtrim), *cmd], env, cwd=tmp_path)
        assert got.returncode == 2, (cmd, got.stdout, got.stderr[-2000:])
        assert f"pip install 'graphtrim[{extra}]'" in got.stderr, got.stderr[-2000:]
        assert "Traceback" not in got.stderr
    assert not out.exists()

    # cpu: onnxruntime, and the optimizer verifies what it wrote
    install("cpu")
    assert not {"apache-airflow", "mlflow", "torch", "matplotlib"} & _installed(python, env)
    got = _run([str(graphtrim), "optimize", str(model), "-o", str(out), "--verify"], env)
    assert got.returncode == 0, got.stderr[-3000:]
    # the Identity goes; x + 0 stays (it turns -0.0 into +0.0: not the same result)
    assert [n.op_type for n in onnx.load(out).graph.node] == ["Add"]

    # airflow-client: `graphtrim trigger` (the CI example) without Airflow itself
    install("airflow-client")
    assert "apache-airflow" not in _installed(python, env)
    got = _run(
        [
            str(graphtrim),
            "trigger",
            "--airflow-url",
            "http://127.0.0.1:9",
            "--model",
            "m",
            "--version",
            "1",
        ],
        {**env, "GRAPHTRIM_AIRFLOW_TOKEN": "t"},
    )
    # port 9 (discard) is closed: an unreachable API is exit 2 with one line, not an import error
    assert got.returncode == 2 and "Traceback" not in got.stderr, got.stderr[-3000:]
    assert "graphtrim[" not in got.stderr and "127.0.0.1:9" in got.stderr, got.stderr[-3000:]
