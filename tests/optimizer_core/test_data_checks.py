"""Data files are checked early and cleanly: every problem is one line naming the file (and its
role), found before any heavy work; ``load_npz`` runs the same checks. A dynamic batch dim keeps
the last partial batch. Model inputs can come from an MLflow signature before export."""

from __future__ import annotations

import io
import json
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnxruntime as ort
import pytest

from graphtrim import npz
from graphtrim.data import (
    CalibrationReader,
    input_specs,
    load_npz,
    specs_from_signature,
)
from graphtrim.data_check import DataError, InputSpec, check_data
from graphtrim.gates.accuracy import labels_of, run_outputs

FLOAT, INT64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64


def _save(model_graph: onnx.GraphProto, path: Path) -> Path:
    model = oh.make_model(model_graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.fixture
def two_inputs(tmp_path: Path) -> list[InputSpec]:
    """x: float32[N, 4, 5] and lengths: int64[N] (a dynamic batch)."""
    graph = oh.make_graph(
        [oh.make_node("Relu", ["x"], ["y"]), oh.make_node("Identity", ["lengths"], ["n"])],
        "two",
        [
            oh.make_tensor_value_info("x", FLOAT, ["N", 4, 5]),
            oh.make_tensor_value_info("lengths", INT64, ["N"]),
        ],
        [
            oh.make_tensor_value_info("y", FLOAT, ["N", 4, 5]),
            oh.make_tensor_value_info("n", INT64, ["N"]),
        ],
    )
    specs = input_specs(_save(graph, tmp_path / "two.onnx"))
    assert [s[0] for s in specs] == ["x", "lengths"]
    return specs


def classifier(path: Path) -> Path:
    """logits = x @ W: float32[N, 3] -> [N, 4] (a dynamic batch)."""
    w = onh.from_array(np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32), "W")
    graph = oh.make_graph(
        [oh.make_node("MatMul", ["x", "W"], ["logits"])],
        "clf",
        [oh.make_tensor_value_info("x", FLOAT, ["N", 3])],
        [oh.make_tensor_value_info("logits", FLOAT, ["N", 4])],
        [w],
    )
    return _save(graph, path)


def _x(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((n, 4, 5)).astype(np.float32)


def _good(n: int = 8) -> dict[str, np.ndarray]:
    return {"x": _x(n), "lengths": np.arange(n, dtype=np.int64), "labels": np.arange(n) % 3}


def _npz(path: Path, arrays: dict[str, Any]) -> Path:
    np.savez(path, **arrays)
    return path


def _write(content: bytes) -> Callable[[Path], Path]:
    def make(path: Path) -> Path:
        path.write_bytes(content)
        return path

    return make


def _with(**changes: Any) -> Callable[[Path], Path]:
    def make(path: Path) -> Path:
        arrays = {**_good(), **changes}
        return _npz(path, {k: v for k, v in arrays.items() if v is not None})

    return make


def _zip(members: dict[str, bytes]) -> Callable[[Path], Path]:
    def make(path: Path) -> Path:
        with zipfile.ZipFile(path, "w") as zf:
            for name, payload in members.items():
                zf.writestr(name, payload)
        return path

    return make


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def _nan_x() -> np.ndarray:
    x = _x(8)
    x[1, 2, 3] = np.nan
    x[5, 0, 0] = np.inf
    x[7, 3, 4] = -np.inf
    return x


# (builder of the bad file, what the message must say); each is checked for both functions
BAD_FILES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "text-file": (_write(b"x,lengths\n0.1,3\n"), r"not an \.npz archive of arrays \(write it"),
    "pickle": (
        _write(pickle.dumps({"x": [1.0, 2.0]})),
        r"not an \.npz archive of arrays \(write it with numpy\.savez",
    ),
    "single-npy": (_write(_npy_bytes(_x(8))), r"a single \.npy array, not an \.npz archive"),
    "damaged-zip": (_write(b"PK\x03\x04" + b"\0" * 40), r"not a readable \.npz archive"),
    "member-not-npy": (
        _zip(
            {
                "x.npy": _npy_bytes(_x(8)),
                "lengths.npy": _npy_bytes(np.arange(8)),
                "notes.txt": b"hello",
            }
        ),
        r"member 'notes\.txt' is not a \.npy array",
    ),
    "npy-member-not-an-array": (
        _zip({"x.npy": b"not an array at all", "lengths.npy": _npy_bytes(np.arange(8))}),
        r"member 'x\.npy' is not a \.npy array",
    ),
    "object-array": (
        _with(x=np.array([{"a": 1}] * 8, dtype=object)),
        r"member 'x\.npy' holds Python objects, not numbers",
    ),
    "missing-input": (
        _with(lengths=None),
        r"no array for model input\(s\) lengths \(has labels, x\); name each array like the "
        r"model input it feeds: x, lengths",
    ),
    "wrong-rank": (_with(x=_x(8)[:, :, 0]), r"array 'x' has shape \[8, 4\] \(2 axes\); model "),
    "wrong-fixed-dim": (
        _with(x=np.zeros((8, 4, 6), np.float32)),
        r"array 'x' has shape \[8, 4, 6\]: axis 2 is 6, model input 'x' \[N, 4, 5\] wants 5",
    ),
    "wrong-dtype": (
        _with(lengths=np.arange(8, dtype=np.int32)),
        r"array 'lengths' is int32, the model wants tensor\(int64\)",
    ),
    "non-finite": (
        _with(x=_nan_x()),
        r"array 'x' \(model input 'x'\) holds 3 non-finite value\(s\) \(NaN or inf\) among 160",
    ),
    "sample-counts": (
        _with(lengths=np.arange(7, dtype=np.int64)),
        r"array 'lengths' does not have 8 samples on its first axis \(has 7",
    ),
    "labels-length": (_with(labels=np.arange(9)), r"'labels' has 9 entries for 8 samples"),
    "no-samples": (
        _with(x=_x(0), lengths=np.zeros(0, np.int64), labels=np.zeros(0)),
        "the arrays hold no samples",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_check_data_refuses_with_one_line(
    case: str, tmp_path: Path, two_inputs: list[InputSpec]
) -> None:
    make, message = BAD_FILES[case]
    path = make(tmp_path / "calib.npz")
    with pytest.raises(DataError, match=message) as info:
        check_data(path, two_inputs, role="calibration")
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith(f"calibration data {path}: ")
    assert "pickle" not in text.lower().replace("numpy.savez", "")


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_load_npz_runs_the_same_checks(
    case: str, tmp_path: Path, two_inputs: list[InputSpec]
) -> None:
    make, message = BAD_FILES[case]
    path = make(tmp_path / "eval.npz")
    with pytest.raises(DataError, match=message) as info:
        load_npz(path, two_inputs)
    assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value)
    assert "allow_pickle" not in str(info.value)


def test_missing_file_names_the_role(tmp_path: Path, two_inputs: list[InputSpec]) -> None:
    path = tmp_path / "absent.npz"
    with pytest.raises(DataError, match=r"^evaluation data .*absent\.npz: no such data file$"):
        check_data(path, two_inputs, role="evaluation")
    with pytest.raises(DataError, match=r"not a regular file"):
        check_data(tmp_path, two_inputs, role="evaluation")


def test_one_array_under_another_key_is_not_guessed(tmp_path: Path) -> None:
    """A single-input model and a single array named otherwise: the expected key is named
    (it used to be fed to the input silently, which registered duplicates)."""
    path = classifier(tmp_path / "clf.onnx")
    specs = input_specs(path)
    data = _npz(tmp_path / "d.npz", {"features": np.zeros((6, 3), np.float32)})
    with pytest.raises(DataError, match=r"no array for model input\(s\) x \(has features\)"):
        check_data(data, specs, role="evaluation")
    with pytest.raises(DataError, match=r"name each array like the model input it feeds: x"):
        load_npz(data, specs)


def test_one_array_feeds_an_unnamed_input_and_the_log_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A signature without names: export calls the input input_0, a name the user never
    chose. The one array feeds it, with a warning; two arrays are still an error."""
    specs: list[InputSpec] = [("input_0", "tensor(float)", [None, 3])]
    one = _npz(tmp_path / "one.npz", {"features": np.ones((6, 3), np.float32)})
    with caplog.at_level("WARNING", logger="graphtrim.data"):
        data = load_npz(one, specs)
        check_data(one, specs, role="calibration")
    assert float(data.batches[0]["input_0"].sum()) == 18.0
    assert "array 'features' feeds the model's unnamed input (input_0)" in caplog.text
    two = _npz(
        tmp_path / "two.npz",
        {"features": np.ones((6, 3), np.float32), "more": np.ones((6, 3), np.float32)},
    )
    with pytest.raises(DataError, match=r"no array for model input\(s\) input_0"):
        check_data(two, specs, role="calibration")


def test_good_file_summary(tmp_path: Path, two_inputs: list[InputSpec]) -> None:
    path = _npz(tmp_path / "d.npz", _good(8))
    summary = check_data(path, two_inputs, role="evaluation")
    assert summary["samples"] == 8 and summary["role"] == "evaluation"
    assert summary["labels"] == "labels" and summary["batch"] is None
    assert summary["arrays"]["x"] == {"dtype": "float32", "shape": [8, 4, 5]}
    assert summary["arrays"]["lengths"] == {"dtype": "int64", "shape": [8]}
    other = check_data(path, two_inputs, role="evaluation", label_key="targets")
    assert other["labels"] is None and "labels" not in other["arrays"]


class _Opened:
    """Records every archive member opened for reading."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.names: list[str] = []
        original = zipfile.ZipFile.open

        def spy(zf: zipfile.ZipFile, name: Any, *args: Any, **kwargs: Any) -> Any:
            self.names.append(name.filename if isinstance(name, zipfile.ZipInfo) else str(name))
            return original(zf, name, *args, **kwargs)

        monkeypatch.setattr(zipfile.ZipFile, "open", spy)


def test_members_the_model_does_not_use_are_never_opened(
    tmp_path: Path, two_inputs: list[InputSpec], monkeypatch: pytest.MonkeyPatch
) -> None:
    arrays = {**_good(8), "spectrogram_raw": np.zeros((8, 64, 64), np.float32)}
    path = _npz(tmp_path / "d.npz", arrays)
    opened = _Opened(monkeypatch)
    check_data(path, two_inputs, role="evaluation")
    assert opened.names and "spectrogram_raw.npy" not in opened.names
    opened.names.clear()
    data = load_npz(path, two_inputs)
    assert data.samples == 8
    assert opened.names and "spectrogram_raw.npy" not in opened.names


def test_member_that_would_decompress_absurdly_is_refused_unread(
    tmp_path: Path, two_inputs: list[InputSpec], monkeypatch: pytest.MonkeyPatch
) -> None:
    # 4 MiB of zeros compress about a thousandfold; the floor is lowered to keep the file small
    monkeypatch.setattr(npz, "RATIO_FLOOR_BYTES", 1024**2)
    path = tmp_path / "bomb.npz"
    np.savez_compressed(path, x=np.zeros((8192, 4, 32), np.float32), lengths=np.arange(8192))
    assert path.stat().st_size * 200 < 4 * 1024**2
    opened = _Opened(monkeypatch)
    with pytest.raises(DataError, match=r"member 'x\.npy' would decompress to 4\.0 MiB \(\d+x"):
        check_data(path, two_inputs, role="calibration")
    assert "x.npy" not in opened.names
    with pytest.raises(DataError, match="refusing it"):
        load_npz(path, two_inputs)


def test_member_over_the_absolute_limit_is_refused(
    tmp_path: Path, two_inputs: list[InputSpec], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(npz, "MAX_MEMBER_BYTES", 1000)
    path = _npz(tmp_path / "d.npz", _good(8))  # x: 8*4*5 float32 = 640 bytes + header
    assert check_data(path, two_inputs, role="evaluation")["samples"] == 8
    path = _npz(tmp_path / "e.npz", _good(16))  # x: 1280 bytes + header, uncompressed
    with pytest.raises(DataError, match=r"member 'x\.npy' would decompress to 1\.4 KiB"):
        check_data(path, two_inputs, role="evaluation")


def test_fixed_batch_larger_than_the_data_is_found_by_check_data(tmp_path: Path) -> None:
    graph = oh.make_graph(
        [oh.make_node("Relu", ["x"], ["y"])],
        "fixed",
        [oh.make_tensor_value_info("x", FLOAT, [4, 3])],
        [oh.make_tensor_value_info("y", FLOAT, [4, 3])],
    )
    specs = input_specs(_save(graph, tmp_path / "fixed.onnx"))
    path = _npz(tmp_path / "d.npz", {"x": np.zeros((3, 3), np.float32)})
    with pytest.raises(DataError, match="3 samples, fewer than one batch of 4"):
        check_data(path, specs, role="calibration")
    assert (
        check_data(
            _npz(tmp_path / "e.npz", {"x": np.zeros((6, 3), np.float32)}), specs, role="calibration"
        )["batch"]
        == 4
    )


# ---------------------------------------------------------------------------------------------
# the last partial batch


def test_dynamic_batch_keeps_the_last_partial_batch(tmp_path: Path) -> None:
    model = classifier(tmp_path / "clf.onnx")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((600, 3)).astype(np.float32)
    labels = rng.integers(0, 4, 600)
    data = load_npz(_npz(tmp_path / "d.npz", {"x": x, "labels": labels}), input_specs(model))
    assert data.samples == 600
    assert [len(b["x"]) for b in data.batches] == [32] * 18 + [24]
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in data]), x)
    np.testing.assert_array_equal(labels_of(data), labels)
    # every sample is scored: the accuracy gate's outputs cover all 600
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    name, outputs = run_outputs(session, data, None)
    assert name == "logits" and outputs.shape == (600, 4)
    np.testing.assert_allclose(
        outputs, x @ onh.to_array(onnx.load(str(model)).graph.initializer[0]), rtol=1e-5, atol=1e-5
    )
    # fewer samples than one batch make one smaller batch
    few = load_npz(_npz(tmp_path / "few.npz", {"x": x[:5]}), input_specs(model))
    assert [len(b["x"]) for b in few.batches] == [5]
    # max_samples cuts the data first; the digest covers exactly the samples used
    cut = load_npz(tmp_path / "d.npz", input_specs(model), max_samples=40)
    assert [len(b["x"]) for b in cut.batches] == [32, 8]
    assert cut.digest != data.digest


def test_calibration_leaves_out_the_partial_batch_so_every_method_runs(tmp_path: Path) -> None:
    """onnxruntime's entropy calibrator stacks all batches: a ragged last one would break it."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, quantize_static

    model = classifier(tmp_path / "clf.onnx")
    x = np.random.default_rng(2).standard_normal((70, 3)).astype(np.float32)
    calib = load_npz(_npz(tmp_path / "c.npz", {"x": x}), input_specs(model))
    assert [len(b["x"]) for b in calib.batches] == [32, 32, 6]
    reader = CalibrationReader(calib.batches)
    assert len(reader) == 2 and reader.left_out == 1
    out = tmp_path / "q.onnx"
    quantize_static(
        str(model),
        str(out),
        reader,
        quant_format=QuantFormat.QDQ,
        calibrate_method=CalibrationMethod.Entropy,
    )
    assert any(n.op_type == "QuantizeLinear" for n in onnx.load(str(out)).graph.node)
    # batches of one shape, or ragged ones in the middle (varying sequences), all stay
    assert len(CalibrationReader(calib.batches[:2])) == 2
    varying = [{"x": np.zeros((2, n), np.float32)} for n in (3, 5, 4)]
    assert len(CalibrationReader(varying)) == 3


# ---------------------------------------------------------------------------------------------
# inputs from an MLflow signature


def _mlmodel(tmp_path: Path, signature: Any) -> dict[str, Any]:
    """The MLmodel document MLflow itself writes for ``signature``, parsed."""
    import yaml
    from mlflow.models import Model

    folder = tmp_path / "mlmodel"
    folder.mkdir(exist_ok=True)
    Model(signature=signature).save(str(folder / "MLmodel"))
    doc = yaml.safe_load((folder / "MLmodel").read_text())
    assert isinstance(doc, dict)
    return doc


def test_specs_from_an_inferred_signature(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow.models import infer_signature

    feats = np.zeros((2, 40, 49), np.float32)
    doc = _mlmodel(tmp_path, infer_signature(feats, np.zeros((2, 12), np.float32)))
    raw = json.loads(doc["signature"]["inputs"])
    assert raw[0]["tensor-spec"] == {"dtype": "float32", "shape": [-1, 40, 49]}
    assert "name" not in raw[0]  # a single unnamed tensor: the exporter calls it input_0
    specs = specs_from_signature(doc)
    assert specs == [("input_0", "tensor(float)", [None, 40, 49])]
    good = _npz(tmp_path / "d.npz", {"input_0": np.ones((5, 40, 49), np.float32)})
    assert check_data(good, specs, role="evaluation")["samples"] == 5
    bad = _npz(tmp_path / "e.npz", {"input_0": np.ones((5, 40, 48), np.float32)})
    with pytest.raises(DataError, match="axis 2 is 48"):
        check_data(bad, specs, role="evaluation")


def test_specs_from_a_named_signature(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    signature = ModelSignature(
        inputs=Schema(
            [
                TensorSpec(np.dtype(np.float32), (-1, 40, 49), "feats"),
                TensorSpec(np.dtype(np.int64), (-1,), "lengths"),
                TensorSpec(np.dtype(np.uint8), (-1, 2), "mask"),
            ]
        )
    )
    specs = specs_from_signature(_mlmodel(tmp_path, signature))
    assert specs == [
        ("feats", "tensor(float)", [None, 40, 49]),
        ("lengths", "tensor(int64)", [None]),
        ("mask", "tensor(uint8)", [None, 2]),
    ]
    # the same form as input_specs gives for an ONNX model: the checks take either
    path = _npz(
        tmp_path / "d.npz",
        {
            "feats": np.zeros((3, 40, 49)),
            "lengths": np.arange(3),
            "mask": np.zeros((3, 2), np.uint8),
        },
    )
    with pytest.raises(
        DataError, match=r"array 'feats' is float64, the model wants tensor\(float\)"
    ):
        check_data(path, specs, role="calibration")


def test_no_tensor_signature_gives_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    import pandas as pd
    from mlflow.models import infer_signature

    columns = _mlmodel(tmp_path, infer_signature(pd.DataFrame({"a": [1.0], "b": ["text"]})))
    assert columns.get("signature", {}).get("inputs")
    assert specs_from_signature(columns) is None
    assert specs_from_signature({"flavors": {"pytorch": {}}}) is None
    assert specs_from_signature({"signature": {"inputs": None, "outputs": None}}) is None


# ------------------------------------------------------------------ inputs to verify on

FRAME: list[InputSpec] = [
    ("x", "tensor(float)", ["batch", 4]),
    ("state", "tensor(float)", [2, "batch", 3]),
    ("rate", "tensor(int64)", []),
]


def test_feeds_with_samples_on_the_first_axis_come_in_batches(tmp_path: Path) -> None:
    from graphtrim.data import load_feeds

    specs: list[InputSpec] = [("x", "tensor(float)", ["batch", 4])]
    path = tmp_path / "f.npz"
    np.savez(path, x=np.arange(40 * 4, dtype=np.float32).reshape(40, 4))
    feeds = load_feeds(path, specs, limit=3)
    assert [f["x"].shape for f in feeds] == [(32, 4), (8, 4)]
    assert [f["x"].shape for f in load_feeds(path, specs, limit=1)] == [(32, 4)]


def test_feeds_a_scalar_or_a_second_axis_batch_needs_are_one_set_as_given(tmp_path: Path) -> None:
    from graphtrim.data import load_feeds

    path = tmp_path / "f.npz"
    x, state = np.ones((1, 4), np.float32), np.zeros((2, 1, 3), np.float32)
    np.savez(path, x=x, state=state, rate=np.array(16000))
    (feeds,) = load_feeds(path, FRAME, limit=3)
    assert feeds["rate"].shape == () and int(feeds["rate"]) == 16000
    np.testing.assert_array_equal(feeds["state"], state)
    np.savez(path, x=x, state=state, rate=np.array(16000, dtype=np.int32))
    with pytest.raises(DataError) as err:
        load_feeds(path, FRAME, limit=3)
    # both readings are named: the user sees why neither fits
    assert "samples (entries) go on its first axis" in str(err.value)
    assert "read as one set of feeds: array 'rate' is int32, the model wants tensor(int64)" in (
        str(err.value)
    )


def test_feeds_of_a_fixed_batch_model_come_in_its_batches(tmp_path: Path) -> None:
    """A model whose batch dim is 8 is fed 8 samples at a time, whatever batch size was asked
    for verification (4 in the pipeline's optimize stage)."""
    from graphtrim.data import load_feeds

    specs: list[InputSpec] = [("x", "tensor(float)", [8, 4])]
    path = tmp_path / "f.npz"
    np.savez(path, x=np.zeros((30, 4), dtype=np.float32))
    feeds = load_feeds(path, specs, limit=3, batch_size=4)
    assert [f["x"].shape for f in feeds] == [(8, 4), (8, 4), (8, 4)]
