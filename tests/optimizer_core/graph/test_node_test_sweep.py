"""onnx's backend node tests through the optimizer: every class of failure the sweep found
(``python -m bench.nodetests``), one test each, built from the node test cases themselves, plus
the whole sweep as a slow test.

A valid model is optimized (and still gives the expected outputs in onnxruntime) or written out
unchanged with the reason; it is never refused, never crashes a pass, never comes out unloadable.
"""

from __future__ import annotations

import copy
import functools
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnx.parser
import onnx_ir as ir
import onnxruntime as ort
import pytest

from graphtrim.cli import main
from graphtrim.graph.opset import MIN_OPSET
from graphtrim.graph.optimizer import optimize_model
from tests.helpers import rules_fired


@functools.cache
def _node_tests() -> dict[str, Any]:
    # generated once per process: onnx builds every case when its modules are first imported
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return {case.name: case for case in collect_testcases()}


def _arrays(values: Any) -> list[Any]:
    return [onh.to_array(v) if isinstance(v, onnx.TensorProto) else v for v in values]


def _assert_expected_outputs(model: str | bytes, case: Any) -> None:
    """``model`` loads in onnxruntime (as its backend runs the node tests: every graph
    optimization on) and gives the case's expected outputs at the case's tolerance."""
    import onnxruntime.backend as backend
    from onnx.backend.test.runner import Runner

    inputs, outputs = case.data_sets[0]
    got = backend.prepare(model).run(_arrays(inputs))
    Runner.assert_similar_outputs(_arrays(outputs), list(got), rtol=case.rtol, atol=case.atol)


def _save_case(name: str, folder: Path) -> tuple[Any, Path]:
    case = _node_tests()[name]
    src = folder / f"{name}.onnx"
    src.write_bytes(case.model.SerializeToString())
    _assert_expected_outputs(str(src), case)  # onnxruntime runs the original as given
    return case, src


# ---------------------------------------------------------------- optimized, same outputs


@pytest.mark.parametrize(
    "name",
    [
        # an If with an optional-typed output: cse keyed Optional's ``type`` attribute (an
        # unhashable TypeAndShape) and crashed (exit 3)
        "test_if_opt",
        # onnx's AffineGrid function body feeds Range from Split outputs of shape [1]: once the
        # If choosing 2-D or 3-D was folded, onnxruntime refused to load the result
        "test_affine_grid_2d_expanded",
        "test_affine_grid_2d_align_corners_expanded",
    ],
)
def test_node_test_is_optimized_and_gives_the_expected_outputs(name, tmp_path, capsys):
    case, src = _save_case(name, tmp_path)
    out = tmp_path / "out" / "optimized.onnx"

    rc = main(["optimize", str(src), "-o", str(out), "--report", str(tmp_path / "r.json")])

    captured = capsys.readouterr()
    assert rc == 0, captured.err
    onnx.checker.check_model(str(out), full_check=True)
    _assert_expected_outputs(str(out), case)
    assert "passed through" not in captured.out  # these are optimized, not copied
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["optimization"]["passed_through"] is None


# ---------------------------------------------------------------- passed through unchanged


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        (
            "test_ai_onnx_ml_binarizer",
            "passed through: the model imports no default-domain opset (ai.onnx.ml 1)",
        ),
        (
            "test_not_2d",
            f"passed through: opset 1 is below the lowest opset the passes support ({MIN_OPSET})",
        ),
    ],
)
def test_node_test_the_passes_do_not_handle_is_passed_through(name, reason, tmp_path, capsys):
    case, src = _save_case(name, tmp_path)
    out = tmp_path / "out" / "o.onnx"

    rc = main(["optimize", str(src), "-o", str(out), "--report", str(tmp_path / "r.json")])

    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert captured.err == ""
    assert reason in captured.out
    assert out.read_bytes() == src.read_bytes()  # the very bytes
    assert not out.with_name("o.onnx.data").exists()
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["optimization"]["passed_through"].startswith(
        reason.removeprefix("passed through: ")
    )
    assert report["before"]["nodes"] == report["after"]["nodes"] == 1
    _assert_expected_outputs(str(out), case)


def _opset5_matmul_with_external_weight(folder: Path) -> tuple[Path, np.ndarray]:
    w = np.arange(32 * 32, dtype=np.float32).reshape(32, 32) / 1000.0
    graph = oh.make_graph(
        [oh.make_node("MatMul", ["x", "W"], ["y"])],
        "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 32])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 32])],
        [onh.from_array(w, "W")],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 5)], ir_version=4)
    src = folder / "old.onnx"
    onnx.save_model(
        model, str(src), save_as_external_data=True, location="weights.bin", size_threshold=0
    )
    return src, w


def test_passed_through_model_with_external_data_and_verify(tmp_path, capsys):
    src, w = _opset5_matmul_with_external_weight(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    out = tmp_path / "out" / "o.onnx"
    reports = tmp_path / "reports"

    rc = main(
        ["optimize", str(src), "-o", str(out), "--verify", "--report", str(reports / "r.json")]
    )

    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert (
        f"passed through: opset 5 is below the lowest opset the passes support ({MIN_OPSET})"
        in captured.out
    )
    assert "verification skipped: the output is a copy of the input" in captured.out
    report = json.loads((reports / "r.json").read_text())
    assert report["verification"] is None
    # the input is untouched; the output keeps its weights beside it, as every output does
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["o.onnx", "o.onnx.data"]
    written = onnx.load(str(out), load_external_data=False)
    assert written.opset_import == onnx.load(str(src), load_external_data=False).opset_import
    assert [n.op_type for n in written.graph.node] == ["MatMul"]
    x = np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32)
    (y,) = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(y, x @ w, rtol=1e-5, atol=1e-5)


def test_pass_through_still_refuses_a_corrupt_input(tmp_path, capsys):
    # valid opsets are no licence to skip the load checks: missing weights are still refused
    src, _ = _opset5_matmul_with_external_weight(tmp_path)
    (tmp_path / "weights.bin").unlink()
    out = tmp_path / "out" / "o.onnx"

    rc = main(["optimize", str(src), "-o", str(out)])

    captured = capsys.readouterr()
    assert rc == 2
    assert captured.err.startswith("graphtrim: error: ")
    assert "external data file 'weights.bin' of tensor 'W' is missing" in captured.err
    assert "Traceback" not in captured.err
    assert not out.exists()


def test_optimize_model_leaves_a_model_below_the_supported_opsets_alone():
    # opset 6 Add broadcasts by its `axis` attribute, not numpy's rules the passes assume:
    # folding the two constants with numpy's rules would be wrong, so nothing may run
    proto = onnx.parser.parse_model(
        """
        <ir_version: 3, opset_import: ["" : 6]>
        g (float[2, 3] x) => (float[2, 3] y) {
          a = Identity(x)
          y = Relu(a)
        }
        """
    )
    result = optimize_model(ir.serde.deserialize_model(copy.deepcopy(proto)))

    assert not result.modified
    assert result.log.records == []
    assert result.log.passed_through == (
        f"opset 6 is below the lowest opset the passes support ({MIN_OPSET})"
    )
    out = ir.serde.serialize_model(result.model)
    assert [n.op_type for n in out.graph.node] == ["Identity", "Relu"]


# ---------------------------------------------------------------- the pass-level fixes


def test_cse_merges_nodes_whose_attributes_are_types():
    proto = onnx.parser.parse_model(
        """
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[2] x) => (bool p, bool q, bool r) {
          e1 = Optional<type: type_proto = seq(float[5])>()
          e2 = Optional<type: type_proto = seq(float[5])>()
          e3 = Optional<type: type_proto = seq(int64[5])>()
          p = OptionalHasElement(e1)
          h = OptionalHasElement(e2)
          q = Not(h)
          r = OptionalHasElement(e3)
        }
        """
    )
    result = optimize_model(ir.serde.deserialize_model(copy.deepcopy(proto)), passes=["cse"])
    out = ir.serde.serialize_model(result.model)

    # e2 is e1 (and so is its OptionalHasElement); e3 has another type and stays
    assert rules_fired(result) == {"duplicate-node": 2}
    assert [n.op_type for n in out.graph.node].count("Optional") == 2
    onnx.checker.check_model(out, full_check=True)
    feeds = {"x": np.zeros(2, np.float32)}
    want = ort.InferenceSession(proto.SerializeToString()).run(None, feeds)
    got = ort.InferenceSession(out.SerializeToString()).run(None, feeds)
    assert [bool(v) for v in got] == [bool(v) for v in want] == [False, True, False]


@pytest.mark.parametrize(
    ("op", "body", "output"),
    [
        ("Range", "y = Range(zero, b, one)", "int64[N] y"),
        ("HannWindow", "y = HannWindow(b)", "float[N] y"),
        ("DFT", "y = DFT(sig, b)", "float[1, N, 2] y"),
    ],
)
def test_op_taking_a_scalar_still_loads_after_its_if_is_folded(op, body, output):
    # b is [5] (shape [1]) in the branch taken: onnxruntime runs that as given, but once the
    # condition folds and the branch is inlined, its static checks see a constant of rank 1
    proto = onnx.parser.parse_model(
        f"""
        <ir_version: 8, opset_import: ["" : 18]>
        g (int64[2] size, float[1, 8, 1] sig) => ({output}) {{
          two = Constant<value_int: int = 2>()
          n = Size(size)
          is_pair = Equal(n, two)
          b = If(is_pair) <then_branch: graph = g1 () => (b_then) {{
              b_then = Constant<value_ints: ints = [5]>()
          }}, else_branch: graph = g2 () => (b_else) {{
              s0, s1 = Split<num_outputs: int = 2>(size)
              b_else = Squeeze(s1)
          }}>
          zero = Constant<value_int: int = 0>()
          one = Constant<value_int: int = 1>()
          {body}
        }}
        """
    )
    feeds = {"size": np.array([3, 5], np.int64), "sig": np.ones((1, 8, 1), np.float32)}
    feeds = {i.name: feeds[i.name] for i in proto.graph.input}
    (want,) = ort.InferenceSession(proto.SerializeToString()).run(None, feeds)

    result = optimize_model(ir.serde.deserialize_model(copy.deepcopy(proto)))
    out = ir.serde.serialize_model(result.model)

    assert "If" not in [n.op_type for n in out.graph.node]  # the branch was inlined
    assert rules_fired(result).get("scalar-inputs:scalar-input") == 1
    onnx.checker.check_model(out, full_check=True)
    (got,) = ort.InferenceSession(out.SerializeToString()).run(None, feeds)  # all optimizations on
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- the whole sweep


@pytest.mark.slow
def test_every_node_test_onnxruntime_runs_is_optimized_or_passed_through():
    from bench.nodetests import OUTCOMES, collect, summarize, sweep

    summary = summarize(sweep(collect(), jobs=1))

    assert summary["checked"] > 1500  # onnx 1.23 with onnxruntime 1.32: 1,588
    assert summary["not_ok"] == []
    assert {k: summary[k] for k in OUTCOMES if k != "ok"} == dict.fromkeys(
        ("changed", "refused", "unloadable", "crashed"), 0
    )
    assert summary["passed_through"] > 0  # the ai.onnx.ml-only and opset-1 tests
