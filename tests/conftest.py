from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from graphtrim.examples.digits import DigitsTask, make_digits_task
from tests.tiers import MODEL_FIXTURES, SERVER_FIXTURES, require

REPO = Path(__file__).resolve().parents[1]


def _own_temp_dir(prefix: str) -> str:
    """A folder of this test process's, removed when the process ends."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# Airflow reads its home on import and would otherwise create ~/airflow: every test process
# (each xdist worker) gets its own, with the repository's DAGs and no examples.
os.environ["AIRFLOW_HOME"] = _own_temp_dir("graphtrim-airflow-")
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(REPO / "dags")
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ.setdefault("AIRFLOW__CORE__DAGBAG_IMPORT_ERROR_TRACEBACKS", "True")
# the settings search's per-worker input cache: one per test process, never the user's
if "GRAPHTRIM_INPUT_CACHE" not in os.environ:
    os.environ["GRAPHTRIM_INPUT_CACHE"] = _own_temp_dir("graphtrim-inputs-")

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


# Each test's seconds (setup, call and teardown) in a full run on the 2-core machine, written by
# every run to .test-artifacts/durations.json; copy that file here after adding long tests
# (`make test-durations`). A test over SLOW_S is `slow` (left to `make test`), and the files run
# longest first, so that the long ones overlap instead of one trailing the run on one worker.
DURATIONS = REPO / "tests" / "durations.json"
SLOW_S = 1.0


def _known_durations() -> dict[str, float]:
    import json

    try:
        return dict(json.loads(DURATIONS.read_text())["tests"])
    except FileNotFoundError:
        return {}


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by the markers added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Markers from what a test uses and how long it took; the files longest first.

    A test asking for a server fixture is marked ``server`` (:mod:`tests.tiers`); one that took
    over :data:`SLOW_S` in the recorded run (:data:`DURATIONS`), or asks for a fixture that
    exports a language model, is marked ``slow``. ``make test``
    hands each worker whole files (``--dist loadfile``) in this order, so a module's fixtures
    are built once and the long files start side by side; within a file, and among files with
    no record, the order is the collection's.
    """
    known = _known_durations()
    per_file: dict[str, float] = {}
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if SERVER_FIXTURES & fixtures:
            item.add_marker(pytest.mark.server)
        took = known.get(item.nodeid, 0.0)
        if took > SLOW_S or MODEL_FIXTURES & fixtures:
            item.add_marker(pytest.mark.slow)
        path = item.nodeid.split("::", 1)[0]
        per_file[path] = per_file.get(path, 0.0) + took
    items.sort(key=lambda item: -per_file[item.nodeid.split("::", 1)[0]])


_took: dict[str, float] = {}
_deselected: list[int] = []


def pytest_deselected(items: list[pytest.Item]) -> None:
    _deselected.append(len(items))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # on the controller under xdist (the workers' reports arrive there) or in a plain run
    _took[report.nodeid] = _took.get(report.nodeid, 0.0) + report.duration


def _write_durations(config: pytest.Config) -> None:
    import json
    import platform
    import subprocess
    from datetime import datetime, timezone

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()
    out = _summary_path(config, "durations.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "machine": f"{os.cpu_count()} cores, {platform.machine()}",
        "date": datetime.now(timezone.utc).date().isoformat(),
        "commit": commit,
        "tests": {k: round(v, 2) for k, v in sorted(_took.items()) if v >= 0.05},
    }
    out.write_text(json.dumps(record, indent=0) + "\n")


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

    # a record of the whole suite only: not of a tier, a -k selection or named files
    whole = (
        config.args_source != pytest.Config.ArgsSource.ARGS
        and not (config.option.markexpr or config.option.keyword)
        and not any(_deselected)
    )
    if _took and whole and not hasattr(config, "workerinput"):
        _write_durations(config)

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
