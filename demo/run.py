"""The demo: the graph optimizer's before/after on an example CNN, then the digits CNN trained on
scikit-learn's digits, registered as a PyTorch model in a local MLflow registry and taken through
``graphtrim_optimize_model`` by Airflow (SQLite metadata database, ``dag.test``): export to ONNX,
optimize, build int8 / fp16 variants, judge them with the accuracy, latency and size gates,
register the ones that pass with their lineage and move the aliases, every stage its own task
instance.

Run with ``make demo`` (or ``python -m graphtrim.demo [OUT_DIR]``). Everything lives in OUT_DIR
(default ``out/demo``): the Airflow home, the MLflow database and artifacts, the graphtrim
artifact store and ``demo.log``, which holds everything the libraries print; the terminal shows
graphtrim's own lines (:mod:`graphtrim.demo.console`). Run twice, the second run registers
nothing new. With ``--without-airflow`` the same pipeline runs through the command line
(``graphtrim pipeline run``) instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graphtrim.demo.console import Console
from graphtrim.demo.watcher import TaskWatcher

if TYPE_CHECKING:
    from graphtrim.examples.digits import DigitsTask

REPO = Path(__file__).resolve().parents[1]
DAG_ID = "graphtrim_optimize_model"


def optimize_example(out_dir: Path, console: Console) -> int:
    """Export the founding document's CNN and optimize it with verification; the table goes
    to the log, its headline to the terminal."""
    import logging

    import torch

    # the exporter warns about optional packages (torchvision) the example does not use
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)

    from graphtrim.cli import main as cli_main
    from graphtrim.examples.models import export, simple_cnn

    src = out_dir / "simple_cnn.onnx"
    dst = out_dir / "simple_cnn.optimized.onnx"
    report = out_dir / "simple_cnn.report.json"
    console.line(f"[1/3] the graph optimizer on an example CNN ({src.name})")
    with console.step("      export to ONNX and optimize, outputs verified") as step:
        export(simple_cnn(), torch.randn(1, 3, 32, 32), src, dynamo=True)
        rc = cli_main(["optimize", str(src), "-o", str(dst), "--verify", "--report", str(report)])
        if rc == 0:
            doc = json.loads(report.read_text())
            before, after = doc["before"]["nodes"], doc["after"]["nodes"]
            step["done"] = f"{before} nodes -> {after}"
        else:
            step["done"] = f"failed (exit {rc})"
    if rc == 0:
        console.line(f"      the table of every op: {report} ({dst.name})")
    return rc


def train_digits(out_dir: Path, console: Console) -> DigitsTask:
    from graphtrim.examples.digits import make_digits_task

    console.line("[2/3] a small CNN trained on scikit-learn's digits (a real accuracy task)")
    with console.step("      training") as step:
        task = make_digits_task(out_dir / "digits")
        step["done"] = f"fp32 accuracy on held-out digits {task.torch_accuracy:.4f}"
    return task


def register_source(
    out_dir: Path, task: DigitsTask, console: Console, name: str = "digits-cnn"
) -> tuple[str, str]:
    """Register the trained CNN as a PyTorch model in an embedded MLflow registry (SQLite,
    local artifacts); returns (tracking URI, model URI). A version registered by an earlier
    demo run from the same weights is reused, so a second run finds its variants."""
    import warnings

    import numpy as np

    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import mlflow

    from graphtrim.hashing import file_sha256

    home = out_dir / "mlflow"
    home.mkdir(parents=True, exist_ok=True)
    tracking = f"sqlite:///{home / 'mlflow.db'}"
    with console.step("      the MLflow registry") as step:
        client = mlflow.MlflowClient(tracking, tracking)
        digest = file_sha256(task.model)
        existing = (
            client.search_model_versions(f"name='{name}' and tags.`demo.onnx_sha256`='{digest}'")
            if client.search_registered_models(f"name='{name}'")
            else []
        )
        if existing:
            version = str(max(int(v.version) for v in existing))
            step["done"] = f"reusing version {version} of '{name}'"
            return tracking, f"models:/{name}/{version}"
        if client.get_experiment_by_name("models") is None:
            client.create_experiment("models", artifact_location=(home / "artifacts").as_uri())
        mlflow.set_tracking_uri(tracking)
        mlflow.set_experiment("models")
        example = np.load(task.eval)["image"][:2]
        with warnings.catch_warnings(), mlflow.start_run(run_name="train-digits-cnn"):
            warnings.simplefilter("ignore")
            info = mlflow.pytorch.log_model(
                task.module,
                name="model",
                input_example=example,
                registered_model_name=name,
                pip_requirements=["torch"],
            )
        version = str(info.registered_model_version)
        client.set_model_version_tag(name, version, "demo.onnx_sha256", digest)
        step["done"] = f"registered as '{name}' version {version} (a PyTorch model)"
    return tracking, f"models:/{name}/{version}"


DEMO_VARIANTS = "graph,int8-dynamic,int8-static,fp16"
# The digits CNN runs in a third of a millisecond: there, timer noise on a shared 2-core machine
# is wider than the built-in 2% bar of the variants that compute (nearly) the same thing, and
# their latency verdict would flip between runs. The demo asks them only not to be 10% slower.
DEMO_POLICY = {
    "variants": {
        "graph": {"latency": {"min_speedup": 0.9}},
        "fp16": {"latency": {"min_speedup": 0.9}},
    }
}


def write_policy(out_dir: Path) -> Path:
    import yaml

    path = out_dir / "gates.yaml"
    path.write_text(yaml.safe_dump(DEMO_POLICY))
    return path


def _airflow_env(home: Path) -> None:
    os.environ["AIRFLOW_HOME"] = str(home)
    os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(REPO / "dags")
    os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
    os.environ["AIRFLOW__LOGGING__LOGGING_LEVEL"] = os.environ.get("GRAPHTRIM_DEMO_LOG", "WARNING")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def _summary(run: Any) -> str | None:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        rows = session.scalars(
            XComModel.get_many(
                run_id=run.run_id, dag_ids=run.dag_id, task_ids="summary", key="return_value"
            )
        ).all()
        values = [XComModel.deserialize_value(r) for r in rows]
    return str(values[0]) if values else None


def run_with_airflow(out_dir: Path, console: Console) -> int:
    """The pipeline as the ``graphtrim_optimize_model`` DAG, run by Airflow's ``dag.test``."""
    _airflow_env(out_dir / "airflow")  # before anything imports airflow

    rc = optimize_example(out_dir, console)
    if rc != 0:
        return rc
    task = train_digits(out_dir, console)
    tracking, model_uri = register_source(out_dir, task, console)
    os.environ["MLFLOW_TRACKING_URI"] = tracking  # the hooks' fallback without a connection
    artifacts = out_dir / "artifacts"
    name, _, version = model_uri.removeprefix("models:/").partition("/")

    console.line(f"[3/3] {DAG_ID} on {name} v{version}, through Airflow (dag.test)")
    with console.step("      preparing Airflow (SQLite metadata database)"):
        subprocess.run(
            [str(Path(sys.executable).with_name("airflow")), "db", "migrate"],
            check=True,
            capture_output=True,
            env=dict(os.environ),
        )
        from airflow.dag_processing.dagbag import DagBag

        bag = DagBag(str(REPO / "dags"))
    if bag.import_errors:
        console.line(f"DAG import errors: {bag.import_errors}")
        return 2
    dag = bag.dags[DAG_ID]
    conf = {
        "model_name": name,
        "version": version,
        "variants": DEMO_VARIANTS.split(","),
        "calibration": str(task.calibration),
        "eval_data": str(task.eval),
        "artifacts": str(artifacts),
        "policy": DEMO_POLICY,
    }
    print(f"running {DAG_ID} through Airflow with conf {json.dumps(conf)}", flush=True)
    watcher = TaskWatcher(console, DAG_ID, DEMO_VARIANTS.split(","))
    with console.step("      the DAG run", watcher.progress) as step, watcher:
        run = dag.test(run_conf=conf)
        ok = str(run.state).lower().endswith("success")
        step["done"] = f"{run.run_id}: {'success' if ok else run.state}"
    states = {}
    for ti in run.get_task_instances():
        label = ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.map_index}]"
        states[label] = str(ti.state).rsplit(".", 1)[-1].lower()
    print("task instances: " + ", ".join(f"{k}={v}" for k, v in states.items()), flush=True)
    text = _summary(run)
    if text:
        console.line()
        console.line(text)
    console.line()
    console.line(f"artifacts: {artifacts}")
    console.line(f"browse the registry: mlflow ui --backend-store-uri {tracking}")
    return 0 if ok else 1


def run_without_airflow(out_dir: Path, console: Console) -> int:
    """The same pipeline through the command line (``graphtrim pipeline run``), no Airflow."""
    rc = optimize_example(out_dir, console)
    if rc != 0:
        return rc
    task = train_digits(out_dir, console)
    tracking, model_uri = register_source(out_dir, task, console)

    from graphtrim.cli import main as cli_main

    console.line(f"[3/3] graphtrim pipeline run on {model_uri}")
    records = out_dir / "pipeline.json"
    with console.step("      every stage in this process") as step:
        rc = cli_main(
            [
                "pipeline",
                "run",
                "--model",
                model_uri,
                "--tracking-uri",
                tracking,
                "--artifacts",
                str(out_dir / "artifacts"),
                "--variants",
                DEMO_VARIANTS,
                "--calibration",
                str(task.calibration),
                "--eval-data",
                str(task.eval),
                "--policy",
                str(write_policy(out_dir)),
                "--json",
                str(records),
            ]
        )
        step["done"] = f"exit {rc}"
    if records.is_file():
        from graphtrim.stages.summary import table

        console.line()
        console.line(table(json.loads(records.read_text())))
    console.line()
    console.line(f"records of every stage: {records}")
    console.line(f"browse the registry: mlflow ui --backend-store-uri {tracking}")
    # no variant passing its gates is the gates working, not a failed demo
    return 0 if rc in (0, 1) else rc


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    without_airflow = "--without-airflow" in argv
    args = [a for a in argv if a != "--without-airflow"]
    out_dir = Path(args[0] if args else "out/demo").resolve()
    log = out_dir / "demo.log"
    started = time.perf_counter()
    with Console(log) as console:
        console.line(f"graphtrim demo in {out_dir}; everything else it prints goes to {log}")
        try:
            rc = (run_without_airflow if without_airflow else run_with_airflow)(out_dir, console)
        except BaseException as exc:
            import traceback

            traceback.print_exc()  # into the log
            console.line(f"the demo failed: {type(exc).__name__}: {exc} (the log has the rest)")
            raise SystemExit(2) from None
        console.line(f"demo done in {time.perf_counter() - started:.0f} s, log: {log}")
    return rc
