"""``graphtrim quantize`` at its edges: a model the converters cannot take is passed through as
``optimize`` passes it (same line, exit 0), and onnxruntime's own temporary folder of
``quantize_static`` lives in a staging folder beside the output, so a killed run leaves nothing in
the system's temporary folder and the next write beside the output removes what it left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from graphtrim.cli import main
from graphtrim.graph.opset import MIN_OPSET
from tests.conftest import REPO
from tests.optimizer_core.graph.test_node_test_sweep import (
    _assert_expected_outputs,
    _opset5_matmul_with_external_weight,
    _save_case,
)

ML_ONLY = "passed through: the model imports no default-domain opset (ai.onnx.ml 1)"
OPSET5 = f"passed through: opset 5 is below the lowest opset the passes support ({MIN_OPSET})"


@pytest.mark.parametrize("variant", ["fp16", "int8-dynamic"])
def test_quantize_passes_an_ml_only_model_through(
    variant: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    case, src = _save_case("test_ai_onnx_ml_binarizer", tmp_path)
    out = tmp_path / "out" / f"m.{variant}.onnx"
    report = tmp_path / "r.json"

    rc = main(["quantize", str(src), "-o", str(out), "--variant", variant, "--report", str(report)])

    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert ML_ONLY in captured.out.splitlines()[0]
    # optimize says the same of it
    assert main(["optimize", str(src), "-o", str(tmp_path / "o.onnx")]) == 0
    assert ML_ONLY in capsys.readouterr().out
    assert out.read_bytes() == src.read_bytes()
    _assert_expected_outputs(str(out), case)
    doc = json.loads(report.read_text())
    assert doc["variant"] == variant
    assert doc["passed_through"].startswith(ML_ONLY.removeprefix("passed through: "))


@pytest.mark.parametrize("variant", ["fp16", "int8-dynamic"])
def test_quantize_passes_an_opset_5_model_through(
    variant: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, w = _opset5_matmul_with_external_weight(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    out = tmp_path / "out" / "o.onnx"

    rc = main(["quantize", str(src), "-o", str(out), "--variant", variant])

    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert OPSET5 in captured.out
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
    x = np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32)
    (y,) = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(y, x @ w, rtol=1e-5, atol=1e-5)


def test_quantize_still_refuses_a_corrupt_model_it_would_pass_through(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, _ = _opset5_matmul_with_external_weight(tmp_path)
    (tmp_path / "weights.bin").unlink()
    out = tmp_path / "out" / "o.onnx"
    assert main(["quantize", str(src), "-o", str(out), "--variant", "fp16"]) == 2
    assert "weights.bin" in capsys.readouterr().err
    assert not out.exists()


# a ``graphtrim quantize --variant int8-static`` that is killed while onnxruntime calibrates
# (inside quantize_static, its temporary folder made)
_KILLED = """
import os, signal, sys
from graphtrim.data import CalibrationReader

def killed(self):
    os.kill(os.getpid(), signal.SIGKILL)

CalibrationReader.get_next = killed
from graphtrim.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_killed_static_quantization_leaves_nothing_in_the_system_temp(
    tmp_path: Path, digits_task: object
) -> None:
    from graphtrim.modelio import remove_stale_staging

    system_tmp = tmp_path / "system-tmp"
    system_tmp.mkdir()
    out = tmp_path / "out" / "digits.int8-static.onnx"
    env = dict(os.environ, TMPDIR=str(system_tmp))
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _KILLED,
            "quantize",
            str(digits_task.model),  # type: ignore[attr-defined]
            "-o",
            str(out),
            "--variant",
            "int8-static",
            "--calibration",
            str(digits_task.calibration),  # type: ignore[attr-defined]
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-2000:]
    # no folder: neither onnxruntime's ort.quant.* nor graphtrim's own (a native library keeps
    # a small session file, .ses, there on every run, killed or not)
    assert sorted(p.name for p in system_tmp.iterdir() if p.is_dir()) == []
    # what it left is a staging folder beside the output, which the next write there removes
    left = sorted(p.name for p in out.parent.iterdir())
    assert left and all(n.startswith(f".{out.name}.staging.") for n in left), left
    assert any(
        p.name.startswith("ort.quant.") for s in out.parent.iterdir() for p in s.iterdir()
    ), [list(s.iterdir()) for s in out.parent.iterdir()]
    for folder in out.parent.iterdir():
        os.utime(folder, (1, 1))  # past the grace period
    remove_stale_staging(out)
    assert list(out.parent.iterdir()) == []
