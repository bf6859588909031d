"""Fixtures shared by the variant, gate and report tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from graphtrim.examples.digits import DigitsTask


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
