"""Faults in the middle of a run: the database restarts, the tracking server dies or loses an
answer, S3 answers 503 SlowDown or drops a connection, the worker is killed, the disk is full.

Each case runs the pipeline's stages the way an orchestrator does (the stage that meets the
fault in a process of its own, retried as the DAGs' ``retries`` say) and compares what the run
leaves in the registry, the tracking server, the artifact store and the staging folder with
what a run without a fault leaves (:mod:`tests.faults.state`). A fault that cannot be survived
ends the stage with one clear line, and the next run completes it.

``make test`` runs the short form (one point per fault); ``make faults`` (``GRAPHTRIM_FAULTS=
full``) runs every fault at every point and writes the outcome table that the documentation
shows (``docs/operations/data/faults.json``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.faults import state
from tests.faults.conftest import FaultEnv
from tests.faults.runner import (
    CELERY_CASES,
    PIPELINE_CASES,
    UPLOAD_CASES,
    Case,
    DagRun,
    Outcomes,
    PipelineRun,
    compare_dag_runs,
    run_upload_case,
)

# a guard against a hang only: the servers, the reference run and each case on a busy machine
pytestmark = [
    pytest.mark.faults,
    pytest.mark.server,
    pytest.mark.slow,
    pytest.mark.timeout(3600),
]

FULL = os.environ.get("GRAPHTRIM_FAULTS", "") == "full"


def _cases(cases: list[Case]) -> list[Any]:
    chosen = [c for c in cases if FULL or c.short]
    # the short form's cells first: a full run cut short has one point per fault
    return [pytest.param(c, id=c.id) for c in sorted(chosen, key=lambda c: not c.short)]


@pytest.fixture(scope="module")
def outcomes() -> Any:
    table = Outcomes(full=FULL)
    yield table
    table.write()


@pytest.fixture(scope="module")
def reference(
    fault_env: FaultEnv, digits_task: Any, tmp_path_factory: Any
) -> tuple[PipelineRun, dict[str, Any]]:
    """A run without a fault, and what it leaves."""
    run = PipelineRun(fault_env, digits_task, "reference", tmp_path_factory.mktemp("reference"))
    run.run(Case("none", "none"))
    return run, run.snapshot()


@pytest.mark.parametrize("case", _cases(PIPELINE_CASES))
def test_a_fault_mid_run_ends_in_the_state_of_a_run_without_it(
    case: Case,
    fault_env: FaultEnv,
    digits_task: Any,
    reference: tuple[PipelineRun, dict[str, Any]],
    outcomes: Outcomes,
    tmp_path: Path,
) -> None:
    base, expected = reference
    run = PipelineRun(fault_env, digits_task, case.slug, tmp_path, base=base)
    result = run.run(case)
    diffs = run.compare(expected)
    outcomes.add(case, result, diffs)
    assert result.reached, f"the fault point {case.point} was never reached: {result.log}"
    assert not diffs, "\n".join(diffs)
    if case.fatal:
        assert result.line and "\n" not in result.line, result.log
        assert "Traceback" not in result.log, result.log
        assert any(word in result.line for word in case.names), result.line


@pytest.mark.parametrize("case", _cases(UPLOAD_CASES))
def test_an_s3_fault_mid_upload_stores_the_model_once_and_whole(
    case: Case, fault_env: FaultEnv, outcomes: Outcomes, tmp_path: Path
) -> None:
    result, diffs = run_upload_case(fault_env, case, tmp_path)
    outcomes.add(case, result, diffs)
    assert result.reached, f"the fault was never met: {result.log}"
    assert not diffs, "\n".join(diffs)
    if case.fatal:
        assert result.line and "\n" not in result.line, result.log
        assert any(word in result.line for word in case.names), result.line


# (a lost answer to create_model_version is not here: MLflow's client sends the create again
# in the same process, and the register stage's race check removes the second version)
BROKEN_KEY = [
    Case("pg-restart", "register.create_version.after", short=True),
    Case("mlflow-kill", "register.create_version.after"),
    Case("worker-kill", "register.create_version.after"),
]


@pytest.mark.parametrize("case", _cases(BROKEN_KEY))
def test_the_suite_sees_a_broken_idempotency_key(
    case: Case,
    fault_env: FaultEnv,
    digits_task: Any,
    reference: tuple[PipelineRun, dict[str, Any]],
    tmp_path: Path,
) -> None:
    """The same fault with a lineage key that differs on every attempt (what a key built from
    a run id or a clock would do) leaves a second version: the comparison catches it."""
    run = PipelineRun(
        fault_env,
        digits_task,
        f"broken-{case.slug}",
        tmp_path,
        base=reference[0],
        broken="key",
    )
    result = run.run(case)
    assert result.reached
    snap = run.snapshot()
    assert snap["duplicates"], snap


# the S3 outage in the full form only: its attempts wait out the store's backoff
@pytest.mark.parametrize(
    "point", ["upload.part.2.kill", *(["upload.complete.outage"] if FULL else [])]
)
def test_an_upload_cell_sees_a_broken_entry_key(
    point: str, fault_env: FaultEnv, tmp_path: Path
) -> None:
    """The upload killed mid-way, or cut off by an S3 outage before it could complete or abort,
    with an entry key that differs on every attempt: the upload the failed attempt left open is
    under a key the retry never looks at, so nothing aborts it, and the cell reports it."""
    case = next(c for c in UPLOAD_CASES if c.point == point)
    result, diffs = run_upload_case(fault_env, case, tmp_path, broken="key")
    assert result.reached
    assert any(d.startswith("unfinished multipart upload") for d in diffs), diffs


# the message in the full form only: the short form shows the cell sees the state
@pytest.mark.parametrize("broken", ["scratch", *(["message"] if FULL else [])])
def test_a_disk_full_cell_sees_a_staging_folder_left_or_an_unclear_line(
    broken: str, fault_env: FaultEnv, tmp_path: Path
) -> None:
    """The upload's staging copy meeting a full disk, with what the store does on that path
    broken on purpose: a staging folder removed only when the upload succeeds (the failed
    attempts leave theirs), or the file system's error passed on as it came (the line names
    no full disk). The cell reports the first as a difference of state and refuses the second's
    line."""
    case = next(c for c in UPLOAD_CASES if c.fault == "disk-full")
    result, diffs = run_upload_case(fault_env, case, tmp_path, broken=broken)
    assert result.reached
    if broken == "scratch":
        assert any(d.startswith("staging left") for d in diffs), diffs
    else:
        assert result.line and not any(word in result.line for word in case.names), result.line


@pytest.mark.skipif(not FULL, reason="the full form only (make faults): two runs of register")
def test_a_clock_cell_sees_a_lookup_that_trusts_the_workers_clock(
    fault_env: FaultEnv,
    digits_task: Any,
    reference: tuple[PipelineRun, dict[str, Any]],
    tmp_path: Path,
) -> None:
    """The register stage killed after its create and retried, with a lookup of the version an
    earlier attempt registered that takes only versions created in the last 5 minutes by the
    worker's clock (MLflow stamps them with the server's). Retried on a worker with the
    servers' clock, the retry finds the version (the same state as the reference); retried on
    a worker 10 minutes ahead, it registers the variant a second time, and the cell sees it."""
    snaps = {}
    for case in (
        Case("worker-kill", "register.create_version.after"),
        Case("clock", "register.retry.ahead"),
    ):
        run = PipelineRun(
            fault_env,
            digits_task,
            f"recent-{case.slug}",
            tmp_path / case.slug,
            base=reference[0],
            broken="recent-only",
        )
        assert run.run(case).reached
        snaps[case.fault] = run.snapshot()
    assert not state.compare(reference[1], snaps["worker-kill"])
    assert snaps["clock"]["duplicates"], snaps["clock"]


# ---------------------------------------------------------------- the same faults as Celery tasks


@pytest.fixture(scope="module")
def celery(tmp_path_factory: Any, digits_task: Any) -> Any:
    """A Celery deployment (tests/deployment.py) with the digits model registered, and a run of
    the DAG without a fault (what it leaves): the full form only."""
    import boto3

    from tests.conftest import BUCKET
    from tests.deployment import deployment
    from tests.servers import fake_aws_credentials, moto_server, register_onnx

    root = tmp_path_factory.mktemp("celery")
    with fake_aws_credentials(), moto_server(root / "s3") as s3:
        boto3.client("s3", endpoint_url=s3, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        with deployment(root, s3=s3, bucket=BUCKET) as d:
            d["version"] = register_onnx(d["mlflow"], digits_task.model, "digits")
            run = DagRun(d, digits_task, "reference", root / "reference")
            run.run(Case("none", "none"))
            yield d, run.snapshot()


@pytest.mark.skipif(not FULL, reason="the full form only (make faults): a Celery deployment")
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CELERY_CASES])
def test_a_celery_worker_killed_mid_task_ends_in_the_state_of_a_run_without_it(
    case: Case, celery: Any, digits_task: Any, outcomes: Outcomes, tmp_path: Path
) -> None:
    """The DAG on a Celery deployment, its worker SIGKILLed (the task's process with it) while
    the task of the case's stage stands at the point, a new worker started: Airflow declares
    the task dead and retries it, and the run leaves what a run without the fault leaves."""
    d, expected = celery
    run = DagRun(d, digits_task, case.slug, tmp_path)
    result = run.run(case)
    diffs = compare_dag_runs(expected, run.snapshot())
    outcomes.add(case, result, diffs)
    assert result.reached, f"the fault point {case.point} was never reached: {result.log}"
    assert result.attempts >= 2, result.log  # the killed try was retried
    assert not diffs, "\n".join(diffs)
