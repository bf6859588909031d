"""The built wheel installed as a user installs it: into a clean virtual environment, with one
extra at a time, each command then run. The core pulls no Airflow, MLflow, torch, matplotlib or
onnxruntime; a command whose extra is missing says which to install; with the extra it runs:
`optimize --verify` (cpu), `trigger` (airflow-client), `pipeline run` against a registry
(pipeline), `kfp compile` (kubeflow), and the Airflow provider and the shipped DAGs (airflow).

The wheel is built from a copy of the checkout's files (as a clean clone has them), and it puts
one package, ``graphtrim``, at the top level. Packages come from the registry pip is configured
with (pinned by ``constraints.txt``), through one pip cache of the module's own inside the run's
temporary folder; the wheel is built once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper

from tests.conftest import REPO
from tests.tiers import require

pytestmark = [pytest.mark.slow, pytest.mark.venv, pytest.mark.timeout(1800)]

HEAVY = ("apache-airflow", "mlflow", "mlflow-skinny", "torch", "matplotlib", "onnxruntime")


def _run(cmd: list[str], env: dict[str, str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200, **kw)  # type: ignore[call-overload]


def _installed(python: Path, env: dict[str, str]) -> set[str]:
    out = _run([str(python), "-m", "pip", "list", "--format=freeze"], env)
    assert out.returncode == 0, out.stderr
    return {line.split("==")[0].lower() for line in out.stdout.splitlines() if "==" in line}


def _model(path: Path) -> Path:
    """x + 0 then an Identity: one node for the optimizer to remove. IR version 10: onnx's own
    default (14) is newer than onnxruntime-gpu 1.31 reads."""
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
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.save(model, path)
    return path


def _env(tmp_path: Path, pip_cache: Path) -> dict[str, str]:
    """The environment of a user's shell: the machine's pip settings (where its registry and its
    local torch wheel are, ``PIP_*`` and the user's pip.conf) kept, a home and an Airflow home
    of the test's own, and this module's pip cache (each package is fetched once, not once per
    venv)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTHON", "VIRTUAL_ENV", "MLFLOW_", "AIRFLOW"))
    }
    user_config = Path.home() / ".config" / "pip" / "pip.conf"
    if user_config.is_file() and "PIP_CONFIG_FILE" not in env:
        env["PIP_CONFIG_FILE"] = str(user_config)
    env.update(
        PIP_CACHE_DIR=str(pip_cache),
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        HOME=str(tmp_path),
        MLFLOW_DISABLE_TELEMETRY="true",
        AIRFLOW_HOME=str(tmp_path / "airflow-home"),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
    )
    return env


@pytest.fixture(scope="module")
def pip_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pip-cache")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory, pip_cache: Path) -> Path:
    """The wheel, built once for the module's venvs."""
    tmp = tmp_path_factory.mktemp("wheel")
    return _wheel(tmp, _env(tmp, pip_cache))


def _wheel(tmp_path: Path, env: dict[str, str]) -> Path:
    """The wheel, built from a copy of the files git has (tracked, or new and not ignored)."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    source = tmp_path / "source"
    for name in filter(None, listed):
        path = REPO / name
        if path.is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, source / name)
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
            str(source),
        ],
        env,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("graphtrim-*.whl")
    return wheel


class Venv:
    """A clean virtual environment and graphtrim's wheel, installed extra by extra."""

    def __init__(self, tmp_path: Path, env: dict[str, str], wheel: Path) -> None:
        self.env, self.wheel, self.root = env, wheel, tmp_path / "venv"
        require("venv")
        assert _run([sys.executable, "-m", "venv", str(self.root)], env).returncode == 0
        self.python = self.root / "bin" / "python"
        self.graphtrim = self.root / "bin" / "graphtrim"

    def install(self, extras: str) -> None:
        spec = f"graphtrim[{extras}] @ {self.wheel.as_uri()}" if extras else str(self.wheel)
        constraints = ["-c", str(REPO / "constraints.txt")]
        # no byte-compiling of every installed module (about a CPU minute per heavy extra here)
        cmd = [str(self.python), "-m", "pip", "install", "-q", "--no-compile", *constraints, spec]
        done = _run(cmd, self.env)
        assert done.returncode == 0, done.stderr[-3000:]

    def installed(self) -> set[str]:
        return _installed(self.python, self.env)

    def run(self, *args: str, **kw: object) -> subprocess.CompletedProcess[str]:
        env = {**self.env, **kw.pop("extra_env", {})}  # type: ignore[dict-item]
        return _run([str(self.graphtrim), *args], env, **kw)


def test_the_wheel_installs_one_top_level_package(wheel: Path) -> None:
    """Nothing but ``graphtrim`` at the top level of site-packages: no ``operators`` or
    ``optimizer_core`` to collide with another package in a shared Airflow image."""
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"graphtrim"}, tops
    assert {"graphtrim/airflow/operators.py", "graphtrim/kubeflow/pipeline.py"} <= set(names)
    assert "graphtrim/graph/passes/cse.py" in names


def test_the_wheel_installs_each_extra_into_a_clean_venv(
    tmp_path: Path, pip_cache: Path, wheel: Path
) -> None:
    env = _env(tmp_path, pip_cache)
    venv = Venv(tmp_path, env, wheel)
    python, graphtrim, install = venv.python, venv.graphtrim, venv.install

    # the core: onnx, onnx-ir, numpy, PyYAML and nothing heavy
    install("")
    assert not set(HEAVY) & _installed(python, env), _installed(python, env)
    version = _run([str(graphtrim), "--version"], env)
    assert version.returncode == 0 and "0.1.0" in version.stdout + version.stderr
    # the DAG files come with the wheel, where `graphtrim dags-folder` says
    folder = _run([str(graphtrim), "dags-folder"], env)
    assert folder.returncode == 0, folder.stderr[-2000:]
    dags = Path(folder.stdout.strip())
    assert dags == venv.root / "share" / "graphtrim" / "dags", dags
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

    # gpu: onnxruntime's CUDA build, in a venv of its own (the two builds conflict) at the pin
    # the GPU images install; on a machine without a GPU it optimizes on its CPU provider
    gpu = Venv(tmp_path / "gpu", env, venv.wheel)
    gpu.install("gpu")
    assert "onnxruntime-gpu" in gpu.installed() and "onnxruntime" not in gpu.installed()
    got = gpu.run("optimize", str(model), "-o", str(tmp_path / "gpu.onnx"), "--verify")
    assert got.returncode == 0, got.stderr[-3000:]
    assert [n.op_type for n in onnx.load(tmp_path / "gpu.onnx").graph.node] == ["Add"]


def _pipeline_model(path: Path) -> Path:
    """A dense layer with an Identity and an ``x * 1`` for the graph variant to remove; its
    weights (64 KB) outweigh the lineage the variant's file gains, which the size gate counts."""
    rng = np.random.default_rng(0)
    weights = helper.make_tensor(
        "w",
        TensorProto.FLOAT,
        [128, 128],
        rng.standard_normal((128, 128)).astype(np.float32).ravel(),
    )
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"]),
            helper.make_node("Identity", ["h"], ["i"]),
            helper.make_node("Mul", ["i", "one"], ["m"]),
            helper.make_node("Relu", ["m"], ["y"]),
        ],
        "dense",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 128])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 128])],
        [weights, one],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_the_pipeline_and_kubeflow_extras_serve_their_commands(
    tmp_path: Path, pip_cache: Path, wheel: Path
) -> None:
    """``graphtrim[pipeline,cpu]`` runs the registry-to-registry pipeline; ``kubeflow`` adds the
    KFP compiler (and its Kubernetes extension); neither pulls Airflow."""
    import mlflow

    from tests.servers import register_onnx

    env = _env(tmp_path, pip_cache)
    venv = Venv(tmp_path, env, wheel)
    venv.install("pipeline,cpu")
    have = venv.installed()
    assert {"mlflow", "torch", "boto3", "onnxruntime", "matplotlib", "onnxscript"} <= have
    assert "apache-airflow" not in have and "kfp" not in have

    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    model = _pipeline_model(tmp_path / "dense.onnx")
    version = register_onnx(tracking, model, "dense", artifact_dir=tmp_path / "mlruns")
    policy = {"variants": {"graph": {"latency": {"min_speedup": None, "runs": 10, "warmup": 2}}}}
    got = venv.run(
        "pipeline",
        "run",
        "--model",
        f"models:/dense/{version}",
        "--tracking-uri",
        tracking,
        "--artifacts",
        str(tmp_path / "store"),
        "--variants",
        "graph",
        "--policy-json",
        json.dumps(policy),
        "--json",
        str(tmp_path / "records.json"),
        cwd=tmp_path,
    )
    assert got.returncode == 0, got.stderr[-3000:]
    records = json.loads((tmp_path / "records.json").read_text())
    registered = records["register"]["registered"]
    assert set(registered) == {"graph"}
    # the comparison report has its plots (matplotlib, the `reports` part of the extra)
    html = Path(records["register"]["reports"]["html"].removeprefix("file://")).read_text()
    assert 'src="data:image/png;base64,' in html
    client = mlflow.MlflowClient(tracking, tracking)
    made = client.get_model_version("dense", registered["graph"]["version"])
    assert made.tags["graphtrim.variant"] == "graph"

    venv.install("kubeflow")
    assert {"kfp", "kfp-kubernetes"} <= venv.installed()
    compiled = tmp_path / "pipeline.yaml"
    got = venv.run("kfp", "compile", "-o", str(compiled))
    assert got.returncode == 0, got.stderr[-3000:]
    spec, platform = yaml.safe_load_all(compiled.read_text())
    assert "exec-gate" in spec["deploymentSpec"]["executors"]
    assert (
        "secretAsEnv"
        in platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-gate"]
    )


def test_the_airflow_extra_serves_the_provider_and_the_dags(
    tmp_path: Path, pip_cache: Path, wheel: Path
) -> None:
    """``graphtrim[airflow]``: Airflow lists graphtrim's provider (its hooks, extra links and
    plugin), and the DAG files the wheel ships parse with no import error."""
    env = _env(tmp_path, pip_cache)
    venv = Venv(tmp_path, env, wheel)
    venv.install("airflow")
    have = venv.installed()
    assert {"apache-airflow", "mlflow", "boto3"} <= have
    assert "torch" not in have and "kfp" not in have
    airflow = venv.root / "bin" / "airflow"
    listed = _run([str(airflow), "providers", "get", "graphtrim", "--full", "-o", "json"], env)
    assert listed.returncode == 0, listed.stderr[-3000:]
    info = json.loads(listed.stdout)
    info = info[0] if isinstance(info, list) else info
    text = json.dumps(info)
    assert "graphtrim.airflow.hooks.MlflowRegistryHook" in text, text[:2000]
    assert "graphtrim.airflow.plugin.GraphtrimPlugin" in text, text[:2000]
    folder = venv.run("dags-folder")
    assert folder.returncode == 0, folder.stderr[-2000:]
    parse = (
        "import json, sys; from airflow.dag_processing.dagbag import DagBag; "
        "bag = DagBag(sys.argv[1]); "
        "print(json.dumps({'errors': bag.import_errors, 'dags': sorted(bag.dag_ids)}))"
    )
    got = _run([str(venv.python), "-c", parse, folder.stdout.strip()], env)
    assert got.returncode == 0, got.stderr[-3000:]
    bag = json.loads(got.stdout.strip().splitlines()[-1])
    assert bag["errors"] == {}, bag["errors"]
    assert "graphtrim_optimize_model" in bag["dags"], bag["dags"]
