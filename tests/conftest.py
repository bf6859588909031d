from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from graphtrim.examples.digits import DigitsTask, make_digits_task
from tests.tiers import SERVER_FIXTURES, require

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# Airflow reads its home on import and would otherwise create ~/airflow: every test process
# (each xdist worker) gets its own, with the repository's DAGs and no examples.
os.environ["AIRFLOW_HOME"] = tempfile.mkdtemp(prefix="graphtrim-airflow-")
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(REPO / "dags")
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ.setdefault("AIRFLOW__CORE__DAGBAG_IMPORT_ERROR_TRACEBACKS", "True")
# the settings search's per-worker input cache: one per test process, never the user's
os.environ.setdefault("GRAPHTRIM_INPUT_CACHE", tempfile.mkdtemp(prefix="graphtrim-inputs-"))

# Airflow configures logging when it is first imported (a dictConfig that replaces the root
# logger's handlers, pytest's log capture among them): imported once here, before any test
# captures logs, where it is installed
with contextlib.suppress(ImportError):
    import airflow  # noqa: F401

BUCKET = "graphtrim-models"


@pytest.fixture(scope="session")
def digits_task(tmp_path_factory: pytest.TempPathFactory) -> DigitsTask:
    """The digits CNN (trained in seconds) with its calibration and evaluation data.

    Trained once per test run: the first xdist worker to get here trains into a folder shared
    by all workers (under a file lock); the others reuse it.
    """
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    # under xdist every worker has its own base temp inside the run's folder
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "digits-task"
    shared.mkdir(parents=True, exist_ok=True)
    done = shared / "done"
    with FileLock(str(shared / ".lock")):
        if not done.exists():
            task = make_digits_task(shared)
            done.write_text(str(task.torch_accuracy))
    return DigitsTask(
        model=shared / "digits_cnn.onnx",
        calibration=shared / "calibration.npz",
        eval=shared / "eval.npz",
        torch_accuracy=float(done.read_text()),
    )


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real MLflow tracking server (SQLite) and a real S3 endpoint (moto) on 127.0.0.1, with
    the bucket ``graphtrim-models``; stopped by PID at the end of the session."""
    import boto3

    from tests.servers import fake_aws_credentials, mlflow_server, moto_server

    root = tmp_path_factory.mktemp("servers")
    with (
        fake_aws_credentials(),
        mlflow_server(root / "mlflow") as url,
        moto_server(root / "s3") as s3,
    ):
        boto3.client("s3", endpoint_url=s3).create_bucket(Bucket=BUCKET)
        yield {"mlflow": url, "s3": s3}


@pytest.fixture(scope="session")
def airflow_db() -> str:
    """This process's Airflow metadata database (SQLite), migrated."""
    import subprocess
    import sys

    require("server")
    home = os.environ["AIRFLOW_HOME"]
    if not (Path(home) / ".migrated").exists():
        subprocess.run(
            [str(Path(sys.executable).with_name("airflow")), "db", "migrate"],
            check=True,
            capture_output=True,
            env=dict(os.environ),
        )
        (Path(home) / ".migrated").write_text("ok")
    return home


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by the markers added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules marked ``early`` first, the longest (``early(minutes)``) before the others.

    ``make test`` hands each worker whole files (``--dist loadfile``, in this order), so a
    module's fixtures are built once, and the long modules run side by side from the start
    instead of one of them trailing the run on one worker. The order is otherwise the
    collection's. A test asking for a server fixture is marked ``server`` (:mod:`tests.tiers`).
    """
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)

    def order(item: pytest.Item) -> tuple[bool, float]:
        early = item.get_closest_marker("early")
        if early is None:
            return (True, 0.0)
        return (False, -float(early.args[0]) if early.args else 0.0)

    items.sort(key=order)


# counts that tests append here (one JSON object a line, under .test-artifacts/), printed as
# tables at the end of the run: ``{file name: title}``
SUMMARIES = {"element-types.jsonl": "element types checked by test_element_types"}


def _summary_path(config: pytest.Config, name: str) -> Path:
    return Path(config.rootpath) / ".test-artifacts" / name


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the controller (or a run without xdist)
        for name in SUMMARIES:
            _summary_path(session.config, name).unlink(missing_ok=True)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    import json

    for name, title in SUMMARIES.items():
        path = _summary_path(config, name)
        if not path.exists():
            continue
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if not rows:
            continue
        keys = [k for k in rows[0] if k != "type"]
        terminalreporter.section(title)
        terminalreporter.write_line(f"{'type':<16}" + "".join(f"{k:>10}" for k in keys))
        for row in sorted(rows, key=lambda r: r["type"]):
            terminalreporter.write_line(
                f"{row['type']:<16}" + "".join(f"{row[k]:>10}" for k in keys)
            )
