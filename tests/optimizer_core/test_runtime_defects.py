"""onnxruntime 1.32's CPU provider segfaults at ORT_ENABLE_ALL on an fp16 Transpose read by a
float MatMul (see tests/crashers.py): the crash is caught in a child process, and graphtrim's
fp16 variant of a model with that pattern is built in the form that avoids it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from graphtrim.isolation import ChildFailed, map_isolated
from graphtrim.quantize import build as qv
from tests.crashers import crashing_model, reference_output, safe_model

torch = pytest.importorskip("torch")


def test_the_crash_is_a_failed_item_with_signal_and_step(tmp_path: Path) -> None:
    crash = crashing_model(tmp_path / "crash.onnx")
    safe = safe_model(tmp_path / "safe.onnx")
    x = np.random.default_rng(0).standard_normal((2, 8, 8)).astype(np.float16)
    out = map_isolated(
        "graphtrim.runtime:load_probe", [str(crash), str(safe)], common={"feeds": {"x": x}}
    )
    assert isinstance(out[0], ChildFailed)
    assert out[0].signal_name == "SIGSEGV"
    assert out[0].step == "opening an onnxruntime session (ORT_ENABLE_ALL, CPUExecutionProvider)"
    assert out[1]["outputs"] == [list(reference_output(x).shape)]


@pytest.fixture(scope="module")
def kws_onnx(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    from graphtrim.examples.kws import kws_net, make_kws_data
    from graphtrim.examples.models import export
    from graphtrim.optimize_file import optimize_file

    x, _ = make_kws_data(16, seed=0)
    folder = tmp_path_factory.mktemp("kws")
    raw = export(kws_net(seed=0).eval(), torch.from_numpy(x[:2]), folder / "raw.onnx", dynamo=True)
    opt = folder / "kws.onnx"
    optimize_file(raw, opt, check=True)
    return opt, x


def test_fp16_of_attention_is_built_in_the_form_that_loads(
    kws_onnx: tuple[Path, np.ndarray], tmp_path: Path
) -> None:
    model, x = kws_onnx
    out = tmp_path / "kws.fp16.onnx"
    build = qv.build_variant(model, out, "fp16", calibration=[{"input": x[:8]}])
    assert [d["name"] for d in build.runtime_defects] == ["ort-fp16-transpose-matmul"]
    assert "SIGSEGV" in build.runtime_defects[0]["seen"]
    assert "Transpose" in build.config.fp16_keep_float
    (probe,) = map_isolated("graphtrim.runtime:load_probe", [str(out)])
    assert not isinstance(probe, BaseException), probe
    assert probe["level"] == "ORT_ENABLE_ALL"


def test_without_a_known_form_the_crash_is_a_clear_error_and_nothing_is_written(
    kws_onnx: tuple[Path, np.ndarray], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, x = kws_onnx
    monkeypatch.setattr(qv, "RUNTIME_DEFECTS", {})
    out = tmp_path / "kws.fp16.onnx"
    with pytest.raises(qv.QuantizeError, match=r"fp16 model cannot be served.*SIGSEGV"):
        qv.build_variant(model, out, "fp16", calibration=[{"input": x[:8]}])
    assert list(tmp_path.iterdir()) == []
