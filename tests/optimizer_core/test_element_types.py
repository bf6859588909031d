"""Every pass holds for every ONNX element type.

For each element type onnx's helpers can write, the models of ``element_types`` (the type as a
graph input, an initializer, a ``Constant`` and a value through every op that accepts it) go
through ``graphtrim optimize`` once per pass alone (``--passes NAME``) and once per preset.
None may exit 3 (or anything but 0: the models are valid); every output passes the full ONNX
checker and, where onnxruntime runs the input, gives the input's results bit for bit (the ops
only move and convert values exactly). The terminal summary lists, per type, how many models,
optimizer runs and onnxruntime comparisons were checked.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from graphtrim.graph.presets import PASSES, PRESETS
from tests.optimizer_core.element_types import ELEMENT_TYPES, feeds, models_for

PASS_RUNS = [("--passes", name) for name in PASSES]
PRESET_RUNS = [("--preset", name) for name in PRESETS]


def runs_of(model_name: str) -> list[tuple[str, str]]:
    """Each pass alone on the model that holds every construct (the others hold a subset);
    every preset on every model."""
    return (PASS_RUNS if model_name.startswith("combined") else []) + PRESET_RUNS


# where each case writes its counts; the terminal summary (tests/conftest.py) prints the table
SUMMARY_NAME = "element-types.jsonl"


def _run_ort(model: onnx.ModelProto | Path, inputs: dict[str, np.ndarray]) -> list | None:
    """The model's outputs in onnxruntime, or None when onnxruntime cannot load or run it (an
    element type or opset it lacks): such a model is checked by the checker only."""
    import onnxruntime as ort

    data = model.read_bytes() if isinstance(model, Path) else model.SerializeToString()
    try:
        session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        return session.run(None, inputs)
    except Exception:
        return None


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    if a.dtype == object or b.dtype == object:
        return a.shape == b.shape and a.tolist() == b.tolist()
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.slow  # every pass alone and every preset, per type (make test runs it)
@pytest.mark.parametrize("type_name", list(ELEMENT_TYPES))
def test_every_pass_and_preset_holds(type_name: str, tmp_path: Path, request) -> None:
    from graphtrim.cli import main

    elem = ELEMENT_TYPES[type_name]
    models = models_for(elem)
    runs = compared = 0
    for typed in models:
        src = tmp_path / f"{typed.name}.onnx"
        onnx.save(typed.model, src)
        before = src.read_bytes()
        inputs = feeds(typed.model)
        expected = _run_ort(typed.model, inputs)
        for flag, name in runs_of(typed.name):
            dst = tmp_path / f"{typed.name}-{name}.onnx"
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                code = main(["optimize", str(src), "-o", str(dst), flag, name, "-q"])
            what = f"{type_name} {typed.name} model ({', '.join(typed.constructs)}), {flag} {name}"
            assert code == 0, f"{what}: exit {code}: {err.getvalue().strip()}"
            onnx.checker.check_model(str(dst), full_check=True)
            runs += 1
            if expected is not None:
                got = _run_ort(dst, inputs)
                assert got is not None, f"{what}: onnxruntime runs the input but not the output"
                for out, a, b in zip(typed.model.graph.output, expected, got, strict=True):
                    assert _same(a, b), f"{what}: output '{out.name}' differs: {a!r} vs {b!r}"
                compared += 1
            dst.unlink()
        assert src.read_bytes() == before
    assert runs == sum(len(runs_of(m.name)) for m in models)
    summary = Path(request.config.rootpath) / ".test-artifacts" / SUMMARY_NAME
    summary.parent.mkdir(parents=True, exist_ok=True)
    with summary.open("a") as f:
        row = {"type": type_name, "models": len(models), "runs": runs, "compared": compared}
        f.write(json.dumps(row) + "\n")


def test_the_string_concat_of_the_report(tmp_path: Path) -> None:
    """The three-node model of the report: ``Identity(xs) -> Concat(., S) -> Identity`` with
    STRING ``xs`` and ``S = ["a", "bb"]`` optimizes with exit 0 and equal results."""
    from graphtrim.cli import main

    typed = models_for(onnx.TensorProto.STRING)[1]
    assert typed.name == "concat"
    src, dst = tmp_path / "m.onnx", tmp_path / "out.onnx"
    onnx.save(typed.model, src)
    assert main(["optimize", str(src), "-o", str(dst), "--verify", "-q"]) == 0
    xs = np.array([b"a", b"bb", b"ccc"], dtype=object)
    expected = _run_ort(typed.model, {"xs": xs})
    got = _run_ort(dst, {"xs": xs})
    assert expected is not None and got is not None
    assert got[0].tolist() == expected[0].tolist()
