"""Fixtures shared by the variant, gate and report tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from optimizer_core.examples.digits import DigitsTask, make_digits_task


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


@pytest.fixture
def digits_copy(digits_task: DigitsTask, tmp_path: Path) -> DigitsTask:
    """A private copy of the digits files, for tests that write beside the model."""
    import shutil

    for p in (digits_task.model, digits_task.calibration, digits_task.eval):
        shutil.copy(p, tmp_path / p.name)
    return DigitsTask(
        tmp_path / digits_task.model.name,
        tmp_path / digits_task.calibration.name,
        tmp_path / digits_task.eval.name,
        digits_task.torch_accuracy,
    )


os.environ.setdefault("MPLBACKEND", "Agg")
