"""``residual-sum``: Add in front of a normalization written as Sum (a finishing pass of the
presets), its inverse ``residual-add``, and the measurements that decide where either is kept (the
onnxruntime targets, variant builds tuned for a device)."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper, numpy_helper

from graphtrim import ort_target as targets
from graphtrim.graph.framework import OptimizeOptions
from graphtrim.graph.optimizer import optimize_model
from graphtrim.graph.presets import PRESETS
from graphtrim.ort_target import tune_residual_sum
from tests.helpers import (
    assert_equivalent,
    op_types,
    ort_kernels,
    rules_fired,
    run_passes,
    written_out_layernorm,
)

HIDDEN = 384


def _residual_ln(
    layers: int = 1, *, opset: int = 17, extra_reader: bool = False, norm: str = "ln"
) -> onnx.ModelProto:
    """``layers`` blocks of x -> LayerNormalization(x + MatMul(x, W)); [batch, 128, HIDDEN]."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    x = "x"
    outputs = []
    for i in range(layers):
        w = (rng.standard_normal((HIDDEN, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
        inits += [
            numpy_helper.from_array(w, f"w{i}"),
            numpy_helper.from_array(rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32), f"g{i}"),
        ]
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"h{i}"]))
        nodes.append(helper.make_node("Add", [x, f"h{i}"], [f"s{i}"]))
        if norm == "ln":
            inits.append(
                numpy_helper.from_array(rng.standard_normal(HIDDEN).astype(np.float32), f"b{i}")
            )
            nodes.append(
                helper.make_node(
                    "LayerNormalization", [f"s{i}", f"g{i}", f"b{i}"], [f"y{i}"], epsilon=1e-5
                )
            )
        else:
            nodes.append(
                helper.make_node("RMSNormalization", [f"s{i}", f"g{i}"], [f"y{i}"], epsilon=1e-5)
            )
        if extra_reader:
            nodes.append(helper.make_node("Relu", [f"s{i}"], [f"r{i}"]))
            outputs.append(
                helper.make_tensor_value_info(
                    f"r{i}", onnx.TensorProto.FLOAT, ["batch", 128, HIDDEN]
                )
            )
        x = f"y{i}"
    graph = helper.make_graph(
        nodes,
        "residual",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 128, HIDDEN])],
        [
            helper.make_tensor_value_info(x, onnx.TensorProto.FLOAT, ["batch", 128, HIDDEN]),
            *outputs,
        ],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize(("opset", "norm"), [(17, "ln"), (23, "ln"), (23, "rms")])
def test_add_feeding_a_normalization_becomes_sum(opset, norm):
    proto = _residual_ln(2, opset=opset, norm=norm)
    out, result = run_passes(proto, ["residual-sum"])
    assert rules_fired(result) == {"residual-sum": 2}
    assert op_types(out).count("Sum") == 2 and "Add" not in op_types(out)
    assert_equivalent(proto, out)  # exact: Sum of two is their Add


def test_add_with_another_reader_or_as_graph_output_is_kept():
    proto = _residual_ln(1, extra_reader=True)
    out, result = run_passes(proto, ["residual-sum"])
    assert rules_fired(result) == {} and "Sum" not in op_types(out)

    graph_output = _residual_ln(1)
    graph_output.graph.output.append(
        helper.make_tensor_value_info("s0", onnx.TensorProto.FLOAT, ["batch", 128, HIDDEN])
    )
    out, result = run_passes(graph_output, ["residual-sum"])
    assert rules_fired(result) == {}


def test_add_into_a_normalizations_scale_is_kept():
    proto = _residual_ln(1)
    ln = next(n for n in proto.graph.node if n.op_type == "LayerNormalization")
    # the sum is the scale, not the data: no fusion would take it, nothing to rewrite
    ln.input[0], ln.input[1] = ln.input[1], ln.input[0]
    _out, result = run_passes(proto, ["residual-sum"])
    assert rules_fired(result) == {}


def test_integer_add_is_kept():
    model = onnx.parser.parse_model(
        """<ir_version: 10, opset_import: ["" : 17]>
        g (int64[4] a, int64[4] b) => (int64[4] y) { y = Add(a, b) }"""
    )
    _out, result = run_passes(model, ["residual-sum"])
    assert rules_fired(result) == {}


def test_residual_sum_finishes_the_presets_and_residual_add_is_in_none():
    for name in ("default", "compact", "safe"):
        assert PRESETS[name][-1] == "residual-sum", name
    assert all("residual-add" not in names for names in PRESETS.values())


def test_residual_add_inverts_residual_sum():
    proto = _residual_ln(2)
    summed, _ = run_passes(proto, ["residual-sum"])
    back, result = run_passes(summed, ["residual-add"])
    assert rules_fired(result) == {"residual-add": 2}
    assert op_types(back) == op_types(proto)
    assert_equivalent(proto, back)


def test_residual_add_leaves_other_sums():
    # three inputs, or a reader besides the normalization: no Add to write
    three = onnx.parser.parse_model(
        """<ir_version: 10, opset_import: ["" : 17]>
        g (float[2, 4] a, float[2, 4] b, float[2, 4] c) => (float[2, 4] y) {
            s = Sum(a, b, c)
            y = LayerNormalization<axis = -1>(s, a)
        }"""
    )
    _out, result = run_passes(three, ["residual-add"])
    assert rules_fired(result) == {}
    shared = onnx.parser.parse_model(
        """<ir_version: 10, opset_import: ["" : 17]>
        g (float[2, 4] a, float[2, 4] b) => (float[2, 4] y, float[2, 4] r) {
            s = Sum(a, b)
            y = LayerNormalization<axis = -1>(s, a)
            r = Relu(s)
        }"""
    )
    _out, result = run_passes(shared, ["residual-add"])
    assert rules_fired(result) == {}


def test_the_default_preset_writes_the_sum_once_after_the_fixed_point():
    """``x + zeros`` in front of a LayerNormalization, the zeros known only once folding has
    run (iteration 1): the Add goes (x + 0 -> x, iteration 2), where a Sum written at the end of
    iteration 1 would have hidden it."""
    proto = onnx.parser.parse_model(
        """<ir_version: 10, opset_import: ["" : 17]>
        g (float[2, 8] x, float[2, 8] h) => (float[2, 8] y, float[2, 8] y2) {
            shape = Shape(x)
            zeros = ConstantOfShape<value = float[1] {0.0}>(shape)
            s = Add(x, zeros)
            y = LayerNormalization<axis = -1>(s, h)
            t = Add(x, h)
            y2 = LayerNormalization<axis = -1>(t, h)
        }"""
    )
    out, result = run_passes(proto, PRESETS["default"])
    records = result.log.records
    assert [r.pass_name for r in records].count("residual-sum") == 1
    assert records[-1].pass_name == "residual-sum"
    assert records[-1].rules == {"residual-sum": 1}  # the residual x + h only
    assert op_types(out).count("Sum") == 1 and "Add" not in op_types(out)
    assert_equivalent(proto, out)


def test_sum_keeps_onnxruntime_off_skip_layer_normalization(tmp_path):
    """The reason for the rewrite, checked against the installed onnxruntime: it fuses Add +
    LayerNormalization into SkipLayerNormalization, and not Sum + LayerNormalization."""
    proto = _residual_ln(1)
    plain = tmp_path / "plain.onnx"
    onnx.save(proto, plain)
    summed_proto, _ = run_passes(proto, ["residual-sum"])
    summed = tmp_path / "summed.onnx"
    onnx.save(summed_proto, summed)
    assert "SkipLayerNormalization" in ort_kernels(plain)
    kernels = ort_kernels(summed)
    assert "SkipLayerNormalization" not in kernels and "Sum" in kernels


def _written_out(norm: str, *, opset: int = 13, reader: str = "") -> onnx.ModelProto:
    """``x + MatMul(x, W)`` into a normalization written out in elementwise ops, as exporters
    write it below opset 17 (23 for RMS): ``norm`` is "ln", "rms" or "centered" (the mean
    taken off, no division: not a normalization); ``reader`` is an extra node reading the sum."""
    rng = np.random.default_rng(0)
    inits = {
        "w": (rng.standard_normal((HIDDEN, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32),
        "g": rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32),
        "b": rng.standard_normal(HIDDEN).astype(np.float32),
        "two": np.array(2.0, np.float32),
        "eps": np.array(1e-5, np.float32),
    }
    body = {
        "ln": written_out_layernorm("s")
        + """
            ng = Mul(n, g)
            y = Add(ng, b)""",
        "rms": """sq = Pow(s, two)
            v = ReduceMean<axes = [-1]>(sq)
            ve = Add(v, eps)
            sd = Sqrt(ve)
            n = Div(s, sd)
            y = Mul(n, g)""",
        "centered": """m = ReduceMean<axes = [-1]>(s)
            y = Sub(s, m)""",
    }[norm]
    extra = f"r = {reader}(s)" if reader else ""
    outputs = f"float[batch, 128, {HIDDEN}] y" + (
        f", float[batch, 128, {HIDDEN}] r" if reader else ""
    )
    model = onnx.parser.parse_model(
        f"""<ir_version: 8, opset_import: ["" : {opset}]>
        g (float[batch, 128, {HIDDEN}] x) => ({outputs}) {{
            h = MatMul(x, w)
            s = Add(x, h)
            {body}
            {extra}
        }}"""
    )
    model.graph.initializer.extend(numpy_helper.from_array(a, k) for k, a in inits.items())
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("norm", ["ln", "rms"])
def test_add_feeding_a_written_out_normalization_becomes_sum(norm):
    proto = _written_out(norm)
    out, result = run_passes(proto, ["residual-sum"])
    assert rules_fired(result) == {"residual-sum": 1}
    assert op_types(out).count("Sum") == 1
    assert_equivalent(proto, out)


@pytest.mark.parametrize(("norm", "reader"), [("centered", ""), ("ln", "Relu")])
def test_add_feeding_other_reductions_is_kept(norm, reader):
    # the mean taken off alone is no normalization; a sum read besides the pattern is kept
    _out, result = run_passes(_written_out(norm, reader=reader), ["residual-sum"])
    assert rules_fired(result) == {}


def test_sum_keeps_onnxruntime_off_skip_layer_normalization_below_opset_17(tmp_path):
    """onnxruntime fuses a written-out LayerNormalization with its shapes known into its own op,
    then the Add in front into SkipLayerNormalization; with the Sum, the LayerNormalization
    alone."""
    proto = _written_out("ln")
    plain = tmp_path / "plain.onnx"
    onnx.save(proto, plain)
    summed = tmp_path / "summed.onnx"
    onnx.save(run_passes(proto, ["residual-sum"])[0], summed)
    assert "SkipLayerNormalization" in ort_kernels(plain)
    kernels = ort_kernels(summed)
    assert "SkipLayerNormalization" not in kernels and "LayerNormalization" in kernels


@pytest.mark.parametrize(("rewritten_p50", "kept"), [(0.5, "rewritten"), (0.99, "original")])
def test_tuning_keeps_the_rewrite_only_when_measurably_faster(
    tmp_path, monkeypatch, rewritten_p50, kept
):
    # the decision, with the timing replaced (the real timing runs in the test below)
    path = tmp_path / "model.onnx"
    onnx.save(_residual_ln(2), path)
    monkeypatch.setattr(targets, "_p50s", lambda paths, *a: ([0.0, 0.0], [1.0, rewritten_p50]))
    record = tune_residual_sum(path)
    assert record["kept"] == kept
    ops = op_types(onnx.load(str(path)))
    assert ("Sum" in ops) == (kept == "rewritten")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]  # nothing left behind
    if kept == "original":
        assert "margin" in record["why"]


def test_tuning_a_model_without_the_pattern_leaves_it_alone(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(_residual_ln(1, extra_reader=True), path)
    before = path.read_bytes()
    assert tune_residual_sum(path) == {
        "rewrite": "residual-sum",
        "kept": "original",
        "why": "nothing to rewrite",
    }
    assert path.read_bytes() == before


def test_tuning_measures_on_onnxruntime(tmp_path):
    """Real timing: whichever form wins, the file afterwards is a valid model with the same
    outputs, and the record holds both measurements."""
    proto = _residual_ln(4)
    path = tmp_path / "model.onnx"
    onnx.save(proto, path)
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 128, HIDDEN)).astype(np.float32)}
    record = tune_residual_sum(path, feeds=feeds, runs=40)
    assert set(record["p50_ms"]) == {"original", "rewritten"}
    assert all(v > 0 for v in record["p50_ms"].values())
    tuned = onnx.load(str(path))
    assert ("Sum" in op_types(tuned)) == (record["kept"] == "rewritten")
    assert_equivalent(proto, tuned)


@pytest.mark.parametrize(
    ("skip", "flip", "fused_op"),
    [
        # the presets write the Sum: the Add form lets the provider fuse SkipLayerNormalization
        ((), "residual-add", "SkipLayerNormalization"),
        # a run without the finishing pass keeps the Add: the Sum form is the one timed
        (("residual-sum",), "residual-sum", "Sum"),
    ],
)
def test_ort_targets_time_the_other_residual_form(monkeypatch, skip, flip, fused_op):
    """With the other residual form measured faster, the target keeps it (here on top of
    onnxruntime's fused model), and the record holds all four timings."""
    proto = _residual_ln(2)

    def timing(paths, *a):
        fast = {f"fused-{flip}.onnx": 0.5, f"portable-{flip}.onnx": 0.6}
        return [0.0] * len(paths), [fast.get(p.name, 1.0) for p in paths]

    monkeypatch.setattr(targets, "_p50s", timing)
    model = ir.serde.deserialize_model(copy.deepcopy(proto))
    result = targets.apply_target(
        optimize_model(model, skip=skip, options=OptimizeOptions(target="ort-cpu"))
    )
    # onnxruntime wrote the fused weights beside its model: read them in before serializing
    out = ir.serde.serialize_model(ir.external_data.load_to_model(result.model))
    record = result.log.target
    assert record["kept"] == f"fused+{flip}"
    assert set(record["p50_ms"]) == {"portable", "fused", f"portable+{flip}", f"fused+{flip}"}
    assert fused_op in op_types(out)
    assert_equivalent(proto, out, rtol=1e-5, atol=1e-5)


def test_ort_target_keeps_the_portable_form_unless_the_other_is_faster(monkeypatch):
    proto = _residual_ln(2)
    monkeypatch.setattr(
        targets, "_p50s", lambda paths, *a: ([0.0] * len(paths), [1.0] * len(paths))
    )
    model = ir.serde.deserialize_model(copy.deepcopy(proto))
    result = targets.apply_target(optimize_model(model, options=OptimizeOptions(target="ort-cpu")))
    assert result.log.target["kept"] == "fused"  # equal timings: the fused model, Sum kept
    out = ir.serde.serialize_model(ir.external_data.load_to_model(result.model))
    assert "SkipLayerNormalization" not in op_types(out) and "Sum" in op_types(out)
