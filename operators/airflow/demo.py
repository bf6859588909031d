"""The main job, embedded: the graph optimizer's before/after table, then the digits CNN
registered in a local MLflow registry and taken through ``graphtrim_optimize_model`` by Airflow
(SQLite metadata database, ``dag.test``): every stage its own task instance.

Run with ``make demo`` (or ``python -m operators.airflow.demo [OUT_DIR]``). Everything lives in
OUT_DIR (default ``out/demo``): the Airflow home, the MLflow database and artifacts, the
graphtrim artifact store. Run twice, the second run registers nothing new.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out_dir = Path(argv[0] if argv else "out/demo").resolve()
    _airflow_env(out_dir / "airflow")  # before anything imports airflow

    from optimizer_core.examples import demo

    rc = demo.optimize_example(out_dir)
    if rc != 0:
        return rc
    task = demo.train_digits(out_dir)
    tracking, model_uri = demo.register_source(out_dir, task)
    os.environ["MLFLOW_TRACKING_URI"] = tracking  # the hooks' fallback without a connection
    artifacts = out_dir / "artifacts"

    print(f"\npreparing Airflow (SQLite metadata database in {out_dir / 'airflow'})")
    subprocess.run(
        [str(Path(sys.executable).with_name("airflow")), "db", "migrate"],
        check=True,
        capture_output=True,
        env=dict(os.environ),
    )
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(str(REPO / "dags"))
    if bag.import_errors:
        print(f"DAG import errors: {bag.import_errors}", file=sys.stderr)
        return 2
    dag = bag.dags["graphtrim_optimize_model"]
    name, _, version = model_uri.removeprefix("models:/").partition("/")
    conf = {
        "model_name": name,
        "version": version,
        "variants": demo.DEMO_VARIANTS.split(","),
        "calibration": str(task.calibration),
        "eval_data": str(task.eval),
        "artifacts": str(artifacts),
        "policy": demo.DEMO_POLICY,
    }
    print(f"running graphtrim_optimize_model through Airflow with conf {json.dumps(conf)}\n")
    run = dag.test(run_conf=conf)
    states = {}
    for ti in run.get_task_instances():
        label = ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.map_index}]"
        states[label] = str(ti.state).rsplit(".", 1)[-1].lower()
    print("task instances: " + ", ".join(f"{k}={v}" for k, v in states.items()))
    text = _summary(run)
    if text:
        print("\n" + text)
    print(f"\nartifacts: {artifacts}")
    print(f"browse the registry: mlflow ui --backend-store-uri {tracking}")
    ok = str(run.state).lower().endswith("success")
    print(f"DAG run {run.run_id}: {'success' if ok else run.state}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
