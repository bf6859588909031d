"""Models with sequence and map values (``ai.onnx.ml`` classifiers end in ZipMap:
``seq(map(int64, float))``): they load, optimize, verify and keep their declared types."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort

from graphtrim.cli import main
from graphtrim.verify import Tolerance
from graphtrim.verify.outputs import compare_outputs

FLOAT, INT64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64


def zipmap_classifier() -> onnx.ModelProto:
    """x[N, 4] -> Identity -> LinearClassifier (3 classes) -> ZipMap, plus a redundant Identity."""
    rng = np.random.default_rng(0)
    probs_type = oh.make_sequence_type_proto(
        oh.make_map_type_proto(INT64, oh.make_tensor_type_proto(FLOAT, []))
    )
    graph = oh.make_graph(
        [
            oh.make_node("Identity", ["x"], ["x1"]),
            oh.make_node(
                "LinearClassifier",
                ["x1"],
                ["label", "scores"],
                domain="ai.onnx.ml",
                classlabels_ints=[0, 1, 2],
                coefficients=rng.standard_normal(12).astype(np.float32).tolist(),
                intercepts=[0.1, -0.2, 0.3],
                post_transform="SOFTMAX",
            ),
            oh.make_node(
                "ZipMap",
                ["scores"],
                ["probabilities"],
                domain="ai.onnx.ml",
                classlabels_int64s=[0, 1, 2],
            ),
        ],
        "classifier",
        [oh.make_tensor_value_info("x", FLOAT, ["N", 4])],
        [
            oh.make_tensor_value_info("label", INT64, ["N"]),
            oh.make_value_info("probabilities", probs_type),
        ],
    )
    model = oh.make_model(
        graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("ai.onnx.ml", 3)]
    )
    onnx.checker.check_model(model, full_check=True)
    return model


def test_a_zipmap_classifier_optimizes_verifies_and_keeps_its_output_types(tmp_path, capsys):
    src, out = tmp_path / "clf.onnx", tmp_path / "out.onnx"
    model = zipmap_classifier()
    onnx.save(model, src)
    assert main(["optimize", str(src), "-o", str(out), "--verify"]) == 0, capsys.readouterr().err
    got = onnx.load(str(out))
    assert [o.type for o in got.graph.output] == [o.type for o in model.graph.output]
    assert [n.op_type for n in got.graph.node] == ["LinearClassifier", "ZipMap"]
    onnx.checker.check_model(got, full_check=True)
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    want = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    have = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(want[0], have[0])
    assert want[1] == have[1]


def test_sequence_of_map_outputs_are_compared_element_by_element():
    tol = Tolerance(rtol=1e-5, atol=1e-6)
    ref = [{0: 0.25, 1: 0.75}, {0: 0.5, 1: 0.5}]
    assert compare_outputs("p", ref, [dict(d) for d in ref], tol).ok
    changed = compare_outputs("p", ref, [{0: 0.25, 1: 0.75}, {0: 0.4, 1: 0.6}], tol)
    assert not changed.ok and changed.max_abs_diff > 0.09
    other_keys = compare_outputs("p", ref, [{0: 0.25, 2: 0.75}, {0: 0.5, 1: 0.5}], tol)
    assert not other_keys.ok and "structure" in other_keys.reason
    shorter = compare_outputs("p", ref, ref[:1], tol)
    assert not shorter.ok
    tensors = [np.ones(3, np.float32), np.zeros(2, np.float32)]
    assert compare_outputs("s", tensors, [t.copy() for t in tensors], tol).ok


def test_an_unexpected_error_is_one_line_and_exit_3(tmp_path, capsys, monkeypatch):
    import graphtrim.optimize_file as of

    def broken(*args, **kwargs):
        raise KeyError("planted defect")

    monkeypatch.setattr(of, "optimize_file", broken)
    src = tmp_path / "clf.onnx"
    onnx.save(zipmap_classifier(), src)
    rc = main(["optimize", str(src), "-o", str(tmp_path / "o.onnx")])
    err = capsys.readouterr().err
    assert rc == 3
    assert (
        err.strip().count("\n") == 0
        and "internal error: KeyError" in err
        and "Traceback" not in err
    )


def _ml_model(nodes, inputs, outputs) -> onnx.ModelProto:
    graph = oh.make_graph(nodes, "ml", inputs, outputs)
    model = oh.make_model(
        graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("ai.onnx.ml", 3)]
    )
    onnx.checker.check_model(model, full_check=True)
    return model


def test_a_cast_to_float_after_a_scaler_is_removed(tmp_path, capsys):
    """onnx's inference gives ai.onnx.ml's Scaler no output type; its definition fixes float."""
    model = _ml_model(
        [
            oh.make_node(
                "Scaler", ["x"], ["scaled"], domain="ai.onnx.ml", offset=[0.5], scale=[2.0]
            ),
            oh.make_node("Cast", ["scaled"], ["y"], to=FLOAT),
        ],
        [oh.make_tensor_value_info("x", FLOAT, ["N", 3])],
        [oh.make_tensor_value_info("y", FLOAT, ["N", 3])],
    )
    src, out = tmp_path / "scaler.onnx", tmp_path / "out.onnx"
    onnx.save(model, src)
    assert main(["optimize", str(src), "-o", str(out), "--verify"]) == 0, capsys.readouterr().err
    assert [n.op_type for n in onnx.load(str(out)).graph.node] == ["Scaler"]


def test_a_model_with_string_inputs_is_verified_on_random_strings(tmp_path, capsys):
    model = _ml_model(
        [
            oh.make_node("Identity", ["grade"], ["g"]),
            oh.make_node(
                "CategoryMapper",
                ["g"],
                ["code"],
                domain="ai.onnx.ml",
                cats_strings=["low", "high"],
                cats_int64s=[0, 1],
                default_int64=-1,
            ),
        ],
        [oh.make_tensor_value_info("grade", onnx.TensorProto.STRING, ["N", 1])],
        [oh.make_tensor_value_info("code", INT64, ["N", 1])],
    )
    src, out = tmp_path / "strings.onnx", tmp_path / "out.onnx"
    onnx.save(model, src)
    rc = main(["optimize", str(src), "-o", str(out), "--verify"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "verification: equal" in captured.out + captured.err
    assert [n.op_type for n in onnx.load(str(out)).graph.node] == ["CategoryMapper"]


def test_string_outputs_that_differ_are_a_mismatch_not_an_error():
    tol = Tolerance(rtol=1e-5, atol=1e-6)
    ref = np.array(["a", "b"], dtype=object)
    assert compare_outputs("s", ref, ref.copy(), tol).ok
    differ = compare_outputs("s", ref, np.array(["a", "c"], dtype=object), tol)
    assert not differ.ok and "differ" in differ.reason
