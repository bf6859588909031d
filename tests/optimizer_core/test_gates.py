"""The gates that decide whether a variant may be registered: policy, accuracy, latency, size.

Everything runs for real in onnxruntime: the digits CNN and its int8 variant for accuracy, and
two hand-built models whose speeds differ by orders of magnitude (with identical outputs) for
latency. Latency verdicts that depend on the machine are only checked for consistency with the
numbers the gate recorded; the decision logic itself is checked on hand-made samples.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnxruntime as ort
import pytest

from graphtrim.cli import main
from graphtrim.data import EvalData, input_specs, load_npz
from graphtrim.errors import GraphtrimError
from graphtrim.examples.digits import DigitsTask
from graphtrim.gates import GatePolicy, PolicyError, evaluate
from graphtrim.gates import latency as lat
from graphtrim.gates.policy import BUILTIN, LatencyThresholds
from graphtrim.quantize import build_variant
from graphtrim.runtime import DeviceUnavailableError, providers_for

FLOAT = onnx.TensorProto.FLOAT
HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()

# latency on, but with no threshold that the machine's speed could decide
QUIET_LATENCY = {"min_speedup": None, "runs": 10, "warmup": 2}


# ---------------------------------------------------------------------------------------------
# models and data


def break_model(source: Path, target: Path, *, scale: float = 0.3, noise: float = 3.0) -> Path:
    """A copy of ``source`` whose first Gemm (or Conv) weight is scaled and drowned in noise."""
    model = onnx.load(str(source))
    node = next(n for n in model.graph.node if n.op_type in ("Gemm", "Conv"))
    init = next(i for i in model.graph.initializer if i.name == node.input[1])
    w = onh.to_array(init)
    rng = np.random.default_rng(0)
    broken = (w * scale + noise * w.std() * rng.standard_normal(w.shape)).astype(np.float32)
    init.CopyFrom(onh.from_array(broken, init.name))
    onnx.save(model, str(target))
    return target


def _model(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], out: str = "y") -> Any:
    graph = oh.make_graph(
        nodes,
        "g",
        [oh.make_tensor_value_info("x", FLOAT, [1, 256])],
        [oh.make_tensor_value_info(out, FLOAT, [1, 256])],
        inits,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _weight() -> onnx.TensorProto:
    rng = np.random.default_rng(0)
    return onh.from_array((rng.standard_normal((256, 256)) / 16).astype(np.float32), "W")


def baseline_model(out: str = "y") -> Any:
    """y = x @ W with x [1, 256]: a few microseconds."""
    return _model([oh.make_node("MatMul", ["x", "W"], [out])], [_weight()], out)


def slow_model(chain: int = 30) -> Any:
    """The baseline's y plus 0 * ReduceSum(a chain of [256,256] MatMuls over x broadcast to
    [256, 256]): the same output, about a thousand times the work, and nothing that
    onnxruntime can fold away because the chain starts from the input. The constant's rows sum
    to about 0.5, so the chain shrinks towards zero and never overflows into inf * 0 = NaN."""
    rng = np.random.default_rng(1)
    c = (rng.uniform(0.0, 1.0, (256, 256)) / 256).astype(np.float32)
    inits = [
        _weight(),
        onh.from_array(c, "C"),
        onh.from_array(np.array([256, 256], np.int64), "square"),
        onh.from_array(np.zeros((), np.float32), "zero"),
    ]
    nodes = [
        oh.make_node("MatMul", ["x", "W"], ["y0"]),
        oh.make_node("Expand", ["x", "square"], ["h0"]),
    ]
    nodes += [oh.make_node("MatMul", [f"h{i}", "C"], [f"h{i + 1}"]) for i in range(chain)]
    nodes += [
        oh.make_node("ReduceSum", [f"h{chain}"], ["s"], keepdims=0),
        oh.make_node("Mul", ["s", "zero"], ["z"]),
        oh.make_node("Add", ["y0", "z"], ["y"]),
    ]
    return _model(nodes, inits)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tiny")
    paths = {
        "base": folder / "base.onnx",
        "copy": folder / "copy.onnx",
        "slow": folder / "slow.onnx",
        "renamed": folder / "renamed.onnx",
        "garbage": folder / "garbage.onnx",
    }
    onnx.save(baseline_model(), str(paths["base"]))
    shutil.copy(paths["base"], paths["copy"])
    onnx.save(slow_model(), str(paths["slow"]))
    onnx.save(baseline_model(out="other"), str(paths["renamed"]))
    paths["garbage"].write_bytes(b"this is not an ONNX model\x00\xff\xfe" * 8)
    return paths


@pytest.fixture(scope="module")
def eval_data(digits_task: DigitsTask) -> EvalData:
    return load_npz(digits_task.eval, input_specs(digits_task.model))


@pytest.fixture(scope="module")
def int8_static(digits_task: DigitsTask, tmp_path_factory: pytest.TempPathFactory) -> Path:
    specs = input_specs(digits_task.model)
    calibration = load_npz(digits_task.calibration, specs)
    out = tmp_path_factory.mktemp("int8") / "digits.int8-static.onnx"
    build_variant(digits_task.model, out, "int8-static", calibration=calibration.batches)
    return out


@pytest.fixture(scope="module")
def broken(digits_task: DigitsTask, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return break_model(digits_task.model, tmp_path_factory.mktemp("broken") / "broken.onnx")


def write_policy(folder: Path, document: dict[str, Any], name: str = "policy.yaml") -> Path:
    import yaml

    path = folder / name
    path.write_text(yaml.safe_dump(document))
    return path


def gate_names(result: Any) -> set[str]:
    return {g.gate for g in result.gates}


# ---------------------------------------------------------------------------------------------
# policy


def test_builtin_policy_defaults() -> None:
    policy = GatePolicy()
    other = policy.for_variant("some-variant")
    assert other.accuracy is not None and other.latency is not None and other.size is not None
    assert other.accuracy.min_cosine == 0.99
    assert other.accuracy.min_top1_agreement == 0.98
    assert other.accuracy.max_metric_drop == 0.01
    assert other.accuracy.metric_drop_mode == "absolute"
    assert other.accuracy.max_abs_error is None
    assert other.latency.min_speedup == 1.0
    assert other.latency.max_noise == 0.05
    assert other.size.max_ratio == 1.0

    graph = policy.for_variant("graph")
    assert graph.accuracy is not None and graph.size is not None
    assert graph.accuracy.min_cosine == 0.9999
    assert graph.accuracy.min_top1_agreement == 1.0
    assert graph.accuracy.max_metric_drop == 0.0
    assert graph.accuracy.max_rel_error == 1e-4
    assert graph.size.max_ratio == 1.01
    assert graph.latency is not None and graph.latency.min_speedup == 0.98
    for name in ("int8-static", "int8-dynamic"):
        size = policy.for_variant(name).size
        assert size is not None and size.max_ratio == 0.35
    fp16 = policy.for_variant("fp16")
    assert fp16.accuracy is not None and fp16.accuracy.min_cosine == 0.999
    assert policy.to_json() == {"version": 1, "defaults": {}, "variants": {}}
    assert GatePolicy.load(None).digest() == policy.digest()


def test_policy_loads_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(
        "version: 1\n"
        "defaults:\n"
        "  accuracy: {min_cosine: 0.95, max_metric_drop: 0.02, metric_drop_mode: relative}\n"
        "  latency: {min_speedup: 1.2, max_noise: 0.1, runs: 50}\n"
        "variants:\n"
        "  int8-static:\n"
        "    size: {max_ratio: 0.3, max_bytes: 1000000}\n"
    )
    policy = GatePolicy.load(path)
    assert policy.source == str(path)
    p = policy.for_variant("int8-static")
    assert p.accuracy is not None and p.latency is not None and p.size is not None
    assert p.accuracy.min_cosine == 0.95
    assert p.accuracy.max_metric_drop == 0.02
    assert p.accuracy.metric_drop_mode == "relative"
    assert p.latency.min_speedup == 1.2
    assert p.latency.max_noise == 0.1
    assert p.latency.runs == 50
    assert p.size.max_ratio == 0.3
    assert p.size.max_bytes == 1000000
    # the same document given as a mapping is the same policy
    assert GatePolicy(policy.to_json()).digest() == policy.digest()

    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert GatePolicy.load(empty).digest() == GatePolicy().digest()


@pytest.mark.parametrize(
    ("document", "named"),
    [
        ({"defualts": {}}, "defualts"),
        ({"version": 2}, "version"),
        ({"defaults": {"acuracy": {}}}, "acuracy"),
        ({"variants": {"int8-static": {"latncy": {}}}}, "latncy"),
        ({"variants": {"int8-static": {"accuracy": {"min_cosin": 0.9}}}}, "min_cosin"),
        ({"defaults": {"size": {"max_ratio": "small"}}}, "max_ratio"),
        ({"defaults": {"accuracy": {"min_cosine": True}}}, "min_cosine"),
        ({"defaults": {"latency": {"min_speedup": -1.0}}}, "min_speedup"),
        ({"variants": {"fp16": {"size": {"max_bytes": -5}}}}, "max_bytes"),
        ({"defaults": {"accuracy": {"metric_drop_mode": "sideways"}}}, "metric_drop_mode"),
        ({"defaults": {"size": [1, 2]}}, "size"),
        ({"variants": ["int8-static"]}, "variants"),
        ({"variants": {"int8-static": 3}}, "int8-static"),
        ({"variants": {"int8_static": {"size": {"max_ratio": 0.3}}}}, "int8_static"),
        ({"promotion": {"eligible": ["int8-static", "int4"]}}, "int4"),
    ],
)
def test_policy_refuses_bad_documents(tmp_path: Path, document: dict[str, Any], named: str) -> None:
    path = write_policy(tmp_path, document)
    with pytest.raises(PolicyError) as info:
        GatePolicy.load(path)
    message = str(info.value)
    assert named in message
    assert str(path) in message


def test_policy_names_the_unknown_key_and_where_it_is() -> None:
    with pytest.raises(PolicyError, match=r"variants\.graph\.accuracy: unknown key 'max_cos'"):
        GatePolicy({"variants": {"graph": {"accuracy": {"max_cos": 0.1}}}})


def test_policy_refuses_bad_yaml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("defaults: {accuracy: [unclosed\n")
    with pytest.raises(PolicyError, match="not valid YAML") as info:
        GatePolicy.load(bad)
    assert str(bad) in str(info.value)

    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("- just\n- a list\n")
    with pytest.raises(PolicyError, match="mapping at the top level") as info:
        GatePolicy.load(scalar)
    assert str(scalar) in str(info.value)

    missing = tmp_path / "nowhere.yaml"
    with pytest.raises(PolicyError, match="no such policy file") as info:
        GatePolicy.load(missing)
    assert str(missing) in str(info.value)


def test_null_switches_a_threshold_off(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        "defaults:\n"
        "  accuracy: {min_cosine: null, max_metric_drop: null}\n"
        "  latency: {min_speedup: null}\n"
        "  size: {max_ratio: null}\n"
    )
    p = GatePolicy.load(path).for_variant("custom")
    assert p.accuracy is not None and p.latency is not None and p.size is not None
    assert p.accuracy.min_cosine is None
    assert p.accuracy.max_metric_drop is None
    assert p.accuracy.min_top1_agreement == 0.98  # untouched keys keep their defaults
    assert p.latency.min_speedup is None
    assert p.size.max_ratio is None


def test_false_disables_a_whole_gate() -> None:
    policy = GatePolicy({"defaults": {"latency": False}, "variants": {"custom": {"size": False}}})
    custom = policy.for_variant("custom")
    assert custom.latency is None and custom.size is None and custom.accuracy is not None
    other = policy.for_variant("other")
    assert other.latency is None and other.size is not None


def test_false_in_file_defaults_beats_builtin_entries() -> None:
    policy = GatePolicy({"defaults": {"latency": False, "size": False}})
    assert policy.for_variant("graph").latency is None
    assert policy.for_variant("int8-static").size is None


def test_policy_precedence() -> None:
    """field defaults < file defaults < built-in per-variant entries < file per-variant."""
    doc = {
        "defaults": {
            "accuracy": {"min_cosine": 0.95, "max_abs_error": 0.5},
            "size": {"max_ratio": 0.9},
        },
        "variants": {"fp16": {"accuracy": {"min_cosine": 0.9}}},
    }
    policy = GatePolicy(doc)
    custom = policy.for_variant("custom")
    assert custom.accuracy is not None and custom.size is not None
    assert custom.accuracy.min_cosine == 0.95  # file defaults over field defaults
    assert custom.accuracy.max_abs_error == 0.5
    assert custom.accuracy.min_top1_agreement == 0.98  # field default
    assert custom.size.max_ratio == 0.9

    graph = policy.for_variant("graph")
    assert graph.accuracy is not None and graph.size is not None
    assert graph.accuracy.min_cosine == BUILTIN["variants"]["graph"]["accuracy"]["min_cosine"]
    assert graph.accuracy.max_abs_error == 0.5  # merged key by key: file default survives
    assert graph.size.max_ratio == 1.01  # built-in over file defaults

    fp16 = policy.for_variant("fp16")
    assert fp16.accuracy is not None and fp16.size is not None
    assert fp16.accuracy.min_cosine == 0.9  # file per-variant over built-in
    assert fp16.accuracy.max_metric_drop == 0.005  # built-in key the file left alone
    assert fp16.size.max_ratio == 0.6


def test_policy_digest_follows_the_document() -> None:
    a = GatePolicy({"defaults": {"accuracy": {"min_cosine": 0.95}}})
    same = GatePolicy({"defaults": {"accuracy": {"min_cosine": 0.95}}}, source="elsewhere")
    changed = GatePolicy({"defaults": {"accuracy": {"min_cosine": 0.96}}})
    assert a.digest() == same.digest()
    assert a.digest() != changed.digest()
    assert a.digest() != GatePolicy().digest()
    assert len(a.digest()) == 16


# ---------------------------------------------------------------------------------------------
# accuracy


def test_int8_static_passes_accuracy(
    digits_task: DigitsTask, int8_static: Path, eval_data: EvalData
) -> None:
    policy = GatePolicy({"defaults": {"latency": False}})
    evaluation = evaluate(
        digits_task.model, {"int8-static": int8_static}, policy=policy, data=eval_data
    )
    result = evaluation.variant("int8-static")
    assert gate_names(result) == {"accuracy", "size"}  # latency: false leaves it out
    accuracy = result.gate("accuracy")
    assert accuracy is not None
    assert accuracy.status == "pass", accuracy.reasons
    m = accuracy.measured
    assert m["samples"] == eval_data.samples
    assert m["cosine"] >= 0.99
    assert m["top1_agreement"] >= 0.98
    assert m["reference_metric"] > 0.9  # the digits CNN really classifies
    assert m["metric_drop"] <= 0.01
    size = result.gate("size")
    assert size is not None and size.status == "pass"
    assert size.measured["ratio"] < 0.35
    assert evaluation.passed == ["int8-static"]


def test_broken_variant_fails_accuracy_with_the_numbers(
    digits_task: DigitsTask, broken: Path, eval_data: EvalData
) -> None:
    policy = GatePolicy({"defaults": {"latency": False}})
    evaluation = evaluate(digits_task.model, {"broken": broken}, policy=policy, data=eval_data)
    result = evaluation.variant("broken")
    gate = result.gate("accuracy")
    assert gate is not None
    assert gate.status == "fail"
    assert not result.passed and evaluation.passed == []
    m = gate.measured
    assert m["reference_metric"] - m["variant_metric"] == pytest.approx(m["metric_drop"])
    assert m["metric_drop"] > 0.01
    assert m["cosine"] < 0.99
    text = "; ".join(gate.reasons)
    assert "accuracy dropped" in text
    assert f"{m['metric_drop']:.4f}" in text
    assert f"cosine {m['cosine']:.6f} < 0.99" in text


def test_null_thresholds_let_the_broken_variant_through(
    digits_task: DigitsTask, broken: Path, eval_data: EvalData
) -> None:
    """With every accuracy threshold switched off the gate measures but judges nothing."""
    off = {
        "min_cosine": None,
        "min_top1_agreement": None,
        "max_metric_drop": None,
        "max_abs_error": None,
        "max_rel_error": None,
    }
    policy = GatePolicy({"defaults": {"latency": False, "accuracy": off}})
    evaluation = evaluate(digits_task.model, {"broken": broken}, policy=policy, data=eval_data)
    gate = evaluation.variant("broken").gate("accuracy")
    assert gate is not None and gate.status == "pass"
    assert gate.measured["cosine"] < 0.99  # still measured and recorded


def test_relative_metric_drop(digits_task: DigitsTask, broken: Path, eval_data: EvalData) -> None:
    """A relative allowance is a fraction of the reference's metric."""
    probe = evaluate(
        digits_task.model,
        {"broken": broken},
        policy=GatePolicy({"defaults": {"latency": False}}),
        data=eval_data,
    )
    m = probe.variant("broken").gate("accuracy").measured  # type: ignore[union-attr]
    fraction = m["metric_drop"] / m["reference_metric"]
    lenient = {
        "min_cosine": None,
        "min_top1_agreement": None,
        "metric_drop_mode": "relative",
    }
    for allowed, status in ((fraction * 1.05, "pass"), (fraction * 0.95, "fail")):
        policy = GatePolicy(
            {"defaults": {"latency": False, "accuracy": {**lenient, "max_metric_drop": allowed}}}
        )
        gate = (
            evaluate(digits_task.model, {"broken": broken}, policy=policy, data=eval_data)
            .variant("broken")
            .gate("accuracy")
        )
        assert gate is not None
        assert gate.status == status, (allowed, gate.reasons)


# ---------------------------------------------------------------------------------------------
# latency


def test_slow_variant_is_refused_and_equal_speed_is_never_passed_by_luck(
    tiny: dict[str, Path],
) -> None:
    policy = GatePolicy(
        {
            "defaults": {"latency": {"min_speedup": 1.0, "runs": 30, "warmup": 3}},
            "variants": {"same": {"latency": {"min_speedup": 1.0, "max_noise": 0.0}}},
        }
    )
    evaluation = evaluate(tiny["base"], {"slow": tiny["slow"], "same": tiny["copy"]}, policy=policy)
    slow = evaluation.variant("slow")
    acc = slow.gate("accuracy")
    assert acc is not None and acc.status == "pass"  # identical outputs
    assert acc.measured["max_abs_error"] == 0.0
    gate = slow.gate("latency")
    assert gate is not None
    assert gate.status == "fail", gate.reasons
    assert any("speedup" in r for r in gate.reasons)
    assert gate.measured["speedup_p50"] < 0.2
    assert max(gate.measured["block_speedups"]) < 1.0
    assert gate.measured["runs"] == 30
    assert not slow.passed

    same = evaluation.variant("same").gate("latency")
    assert same is not None
    blocks = same.measured["block_speedups"]
    assert len(blocks) == 5
    assert same.status in {"pass", "fail", "undecided"}
    if same.status == "pass":
        assert min(blocks) >= 1.0 and same.reasons == []
    else:
        assert same.reasons
    if same.status == "undecided":
        assert min(blocks) < 1.0 <= max(blocks)
        assert "too noisy" in same.reasons[0]
    if same.status == "fail":
        assert max(blocks) < 1.0
    assert set(evaluation.latency_samples) == {"reference", "slow", "same"}
    assert all(len(s) == 30 for s in evaluation.latency_samples.values())


def _run(reference: list[float], variant: list[float], blocks: int = 5) -> lat.LatencyRun:
    return lat.LatencyRun(
        "ref",
        {"ref": lat.LatencyStats(reference, 1), "v": lat.LatencyStats(variant, 1)},
        blocks,
        {},
    )


def _blocks(*values: float, size: int = 2) -> list[float]:
    return [v for v in values for _ in range(size)]


def test_judge_all_blocks_above_passes() -> None:
    run = _run([2.0] * 10, _blocks(1.0, 0.9, 1.1, 1.0, 0.95))
    assert min(run.block_speedups("v")) > 1.0
    status, reasons = lat.judge(run, "v", LatencyThresholds(min_speedup=1.5))
    assert (status, reasons) == ("pass", [])


def test_judge_all_blocks_below_fails() -> None:
    run = _run([1.0] * 10, _blocks(2.0, 1.9, 2.1, 2.0, 1.8))
    status, reasons = lat.judge(run, "v", LatencyThresholds(min_speedup=1.0))
    assert status == "fail"
    assert len(reasons) == 1
    assert "p50 speedup 0.500x < 1x" in reasons[0]
    assert "every block below" in reasons[0]


def test_judge_straddling_and_noisy_is_undecided() -> None:
    # block speedups 1.25, 0.8, 1.25, 0.8, 1.0: p50 speedup exactly 1.0, spread 45%
    run = _run([1.0] * 10, _blocks(0.8, 1.25, 0.8, 1.25, 1.0))
    assert run.speedup("v") == pytest.approx(1.0)
    assert run.spread("v") == pytest.approx(0.45)
    status, reasons = lat.judge(run, "v", LatencyThresholds(min_speedup=1.0, max_noise=0.05))
    assert status == "undecided"
    assert len(reasons) == 1
    assert "too noisy" in reasons[0]
    assert "0.800-1.250x" in reasons[0]
    assert "45.0%" in reasons[0]


@pytest.mark.parametrize(
    ("variant", "status"),
    [
        # block speedups 0.990 x3, 1.005, 1.0: straddles 1.0; p50 speedup 0.990
        (_blocks(1.01, 1.01, 1.01, 0.995, 1.0), "fail"),
        # block speedups 1.010 x3, 0.995, 1.0: straddles 1.0; p50 speedup 1.010
        (_blocks(0.99, 0.99, 0.99, 1.005, 1.0), "pass"),
    ],
)
def test_judge_straddling_with_small_spread_goes_by_the_median(
    variant: list[float], status: str
) -> None:
    run = _run([1.0] * 10, variant)
    blocks = run.block_speedups("v")
    assert min(blocks) < 1.0 <= max(blocks)
    assert run.spread("v") < 0.02
    got, reasons = lat.judge(run, "v", LatencyThresholds(min_speedup=1.0, max_noise=0.05))
    assert got == status
    if status == "fail":
        assert reasons == [f"p50 speedup {run.speedup('v'):.3f}x < 1x"]
    else:
        assert reasons == []
    # the same numbers with a tighter noise allowance are too noisy to decide
    tight, reasons = lat.judge(run, "v", LatencyThresholds(min_speedup=1.0, max_noise=0.01))
    assert tight == "undecided" and "too noisy" in reasons[0]


def test_judge_absolute_budgets() -> None:
    samples = [float(i) for i in range(1, 101)]  # ms
    run = _run(samples, samples)
    p50, p95, p99 = (float(np.percentile(samples, q)) for q in (50, 95, 99))
    status, reasons = lat.judge(
        run, "v", LatencyThresholds(min_speedup=None, max_p50_ms=10.0, max_p95_ms=90)
    )
    assert status == "fail"
    assert reasons == [
        f"p50 {p50:.3f} ms > budget 10 ms",
        f"p95 {p95:.3f} ms > budget 90 ms",
    ]
    status, reasons = lat.judge(run, "v", LatencyThresholds(min_speedup=None, max_p99_ms=50))
    assert status == "fail" and reasons == [f"p99 {p99:.3f} ms > budget 50 ms"]
    within = LatencyThresholds(min_speedup=None, max_p50_ms=p50, max_p95_ms=p95, max_p99_ms=p99)
    assert lat.judge(run, "v", within) == ("pass", [])
    # a broken budget is a failure even when the speedup alone would be undecided
    noisy = _run([1.0] * 10, _blocks(0.8, 1.25, 0.8, 1.25, 1.0))
    status, reasons = lat.judge(
        noisy, "v", LatencyThresholds(min_speedup=1.0, max_p50_ms=0.5, max_noise=0.05)
    )
    assert status == "fail"
    assert reasons[0].startswith("p50 1.000 ms > budget 0.5 ms")
    assert "too noisy" in reasons[1]


def test_latency_stats_numbers() -> None:
    stats = lat.LatencyStats([1.0, 2.0, 3.0, 4.0], batch=8)
    assert stats.p50_ms == 2.5
    assert stats.mean_ms == 2.5
    assert stats.throughput == pytest.approx(8 * 1000 / 2.5)
    doc = stats.to_json(samples=True)
    assert doc["runs"] == 4 and doc["batch"] == 8 and doc["samples_ms"] == [1.0, 2.0, 3.0, 4.0]


def test_variant_named_reference_is_still_timed_against_the_reference(
    tiny: dict[str, Path],
) -> None:
    policy = GatePolicy(
        {"defaults": {"size": False, "latency": {"min_speedup": 1.0, "runs": 10, "warmup": 1}}}
    )
    evaluation = evaluate(tiny["base"], {"reference": tiny["slow"]}, policy=policy)
    assert not evaluation.variant("reference").passed


# ---------------------------------------------------------------------------------------------
# size


def test_larger_variant_fails_the_size_gate(tiny: dict[str, Path]) -> None:
    policy = GatePolicy(
        {"defaults": {"latency": False}, "variants": {"bigger": {"size": {"max_ratio": 1.5}}}}
    )
    evaluation = evaluate(tiny["base"], {"bigger": tiny["slow"]}, policy=policy)
    result = evaluation.variant("bigger")
    gate = result.gate("size")
    assert gate is not None
    assert gate.status == "fail"
    ratio = gate.measured["ratio"]
    assert ratio == pytest.approx(tiny["slow"].stat().st_size / tiny["base"].stat().st_size)
    assert ratio > 1.5
    assert gate.reasons == [f"size ratio {ratio:.3f} > 1.5"]
    assert not result.passed
    acc = result.gate("accuracy")
    assert acc is not None and acc.status == "pass"  # only the size is wrong

    by_bytes = GatePolicy(
        {"defaults": {"latency": False, "size": {"max_ratio": None, "max_bytes": 1000}}}
    )
    gate = (
        evaluate(tiny["base"], {"copy": tiny["copy"]}, policy=by_bytes).variant("copy").gate("size")
    )
    assert gate is not None and gate.status == "fail"
    assert gate.reasons == [f"{tiny['copy'].stat().st_size} bytes > 1000"]


# ---------------------------------------------------------------------------------------------
# failing closed


def test_unreadable_variant_is_an_error_and_the_others_are_still_judged(
    tiny: dict[str, Path],
) -> None:
    policy = GatePolicy({"defaults": {"latency": QUIET_LATENCY}})
    evaluation = evaluate(
        tiny["base"],
        {"garbage": tiny["garbage"], "copy": tiny["copy"], "renamed": tiny["renamed"]},
        policy=policy,
    )
    garbage = evaluation.variant("garbage")
    assert not garbage.passed
    errors = [g for g in garbage.gates if g.status == "error"]
    assert errors and all(g.reasons for g in errors)
    assert "measurement failed" in errors[0].reasons[0]
    assert "latency" not in gate_names(garbage)

    # a model whose judged output does not exist: the accuracy gate errors, never passes
    renamed = evaluation.variant("renamed")
    acc = renamed.gate("accuracy")
    assert acc is not None and acc.status == "error"
    assert "no output 'y'" in acc.reasons[0]
    assert not renamed.passed

    copy = evaluation.variant("copy")
    assert {g.gate: g.status for g in copy.gates} == {
        "size": "pass",
        "accuracy": "pass",
        "latency": "pass",
    }
    assert evaluation.passed == ["copy"]
    assert set(evaluation.latency_samples) == {"reference", "copy", "renamed"}


def test_a_variant_with_every_gate_disabled_does_not_pass(tiny: dict[str, Path]) -> None:
    policy = GatePolicy(
        {"variants": {"copy": {"accuracy": False, "latency": False, "size": False}}}
    )
    evaluation = evaluate(tiny["base"], {"copy": tiny["copy"]}, policy=policy)
    assert evaluation.variant("copy").gates == []
    assert evaluation.passed == []


@pytest.mark.parametrize("threads", [None, 1.5])
def test_policy_with_unusable_thread_count_is_refused_or_works(
    tiny: dict[str, Path], threads: Any
) -> None:
    try:
        policy = GatePolicy({"defaults": {"latency": {"threads": threads, "runs": 5}}})
    except PolicyError:
        return
    evaluate(tiny["base"], {"copy": tiny["copy"]}, policy=policy)


# ---------------------------------------------------------------------------------------------
# device


@pytest.mark.skipif(HAS_CUDA, reason="this onnxruntime has a CUDA provider")
def test_gpu_without_cuda_is_an_error_never_a_cpu_measurement(tiny: dict[str, Path]) -> None:
    with pytest.raises(DeviceUnavailableError, match="CUDAExecutionProvider"):
        providers_for("gpu")
    with pytest.raises(DeviceUnavailableError, match="TensorrtExecutionProvider"):
        providers_for("gpu", tensorrt=True)
    with pytest.raises(DeviceUnavailableError, match="CUDAExecutionProvider"):
        evaluate(tiny["base"], {"copy": tiny["copy"]}, device="gpu")


def test_unknown_device_is_refused() -> None:
    with pytest.raises(GraphtrimError, match="unknown device 'tpu'"):
        providers_for("tpu")
    assert providers_for("cpu") == ["CPUExecutionProvider"]


# ---------------------------------------------------------------------------------------------
# fingerprint


def test_fingerprint_records_where_it_was_measured(
    digits_task: DigitsTask, int8_static: Path, eval_data: EvalData
) -> None:
    policy = GatePolicy({"defaults": {"latency": QUIET_LATENCY}})
    evaluation = evaluate(
        digits_task.model, {"int8-static": int8_static}, policy=policy, data=eval_data, threads=2
    )
    fp = evaluation.fingerprint
    assert isinstance(fp["cpu_model"], str) and fp["cpu_model"]
    assert fp["cpu_count"] == os.cpu_count()
    assert fp["onnxruntime"] == ort.__version__
    assert fp["onnx"] == onnx.__version__
    assert fp["execution_providers"] == ["CPUExecutionProvider"]
    assert fp["device"] == "cpu"
    assert fp["intra_op_threads"] == 2
    assert fp["eval_data_sha256"] == eval_data.digest
    assert len(eval_data.digest) == 64
    latency = evaluation.variant("int8-static").gate("latency")
    assert latency is not None and latency.measured["settings"]["threads"] == 2
    doc = json.loads(json.dumps(evaluation.to_json()))
    assert doc["fingerprint"] == fp
    assert doc["data_source"] == str(digits_task.eval)
    assert doc["policy_hash"] == policy.digest()


def test_eval_data_digest_depends_on_the_data(digits_task: DigitsTask, tmp_path: Path) -> None:
    specs = input_specs(digits_task.model)
    full = load_npz(digits_task.eval, specs)
    again = load_npz(digits_task.eval, specs)
    fewer = load_npz(digits_task.eval, specs, max_samples=64)
    assert full.digest == again.digest
    assert fewer.digest != full.digest
    with np.load(digits_task.eval) as npz:
        labels = npz["labels"].copy()
        images = npz["image"]
    labels[0] = (labels[0] + 1) % 10
    relabelled = tmp_path / "relabelled.npz"
    np.savez(relabelled, image=images, labels=labels)
    assert load_npz(relabelled, specs).digest != full.digest


# ---------------------------------------------------------------------------------------------
# command line


@pytest.fixture
def relaxed_policy(tmp_path: Path) -> Path:
    return write_policy(tmp_path, {"defaults": {"latency": QUIET_LATENCY}}, "relaxed.yaml")


def test_cli_evaluate_exit_codes(
    digits_task: DigitsTask,
    int8_static: Path,
    broken: Path,
    relaxed_policy: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ok_dir = tmp_path / "ok"
    common = ["--data", str(digits_task.eval), "--policy", str(relaxed_policy), "-q"]
    argv = ["evaluate", str(digits_task.model), f"int8-static={int8_static}"]
    assert main([*argv, *common, "-o", str(ok_dir)]) == 0
    doc = json.loads((ok_dir / "evaluation.json").read_text())
    assert doc["passed"] == ["int8-static"]
    assert (ok_dir / "evaluation.md").is_file() and (ok_dir / "evaluation.html").is_file()
    capsys.readouterr()

    bad_dir = tmp_path / "bad"
    assert main([*argv, f"broken={broken}", *common, "-o", str(bad_dir)]) == 1
    err = capsys.readouterr().err
    assert "failed gates: broken" in err
    doc = json.loads((bad_dir / "evaluation.json").read_text())
    assert doc["passed"] == ["int8-static"]
    assert [v["name"] for v in doc["variants"]] == ["int8-static", "broken"]
    # the one rule of the commands that judge variants: --allow-failed-variants is content
    # with one that passed, never with none
    allow = [*common, "--allow-failed-variants", "-o", str(tmp_path / "allow")]
    assert main([*argv, f"broken={broken}", *allow]) == 0
    only_broken = ["evaluate", str(digits_task.model), f"broken={broken}"]
    assert main([*only_broken, *allow]) == 1


def test_the_deployment_policy_in_the_environment_is_read_where_none_is_named(
    digits_task: DigitsTask,
    int8_static: Path,
    relaxed_policy: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """GRAPHTRIM_POLICY (the Helm overlay mounts the deployment's policy there) decides the
    gates of a command given no --policy; a --policy given wins over it."""
    strict = write_policy(
        tmp_path,
        {
            "defaults": {"latency": QUIET_LATENCY},
            "variants": {"int8-static": {"size": {"max_ratio": 0.001}}},
        },
        "deployment.yaml",
    )
    monkeypatch.setenv("GRAPHTRIM_POLICY", str(strict))
    assert GatePolicy.load(None).source == str(strict)
    argv = ["evaluate", str(digits_task.model), f"int8-static={int8_static}", "-q"]
    common = ["--data", str(digits_task.eval)]
    assert main([*argv, *common, "-o", str(tmp_path / "env")]) == 1
    doc = json.loads((tmp_path / "env" / "evaluation.json").read_text())
    assert doc["passed"] == []
    assert "failed gates: int8-static" in capsys.readouterr().err
    # the file named on the command line is the one that counts
    assert main([*argv, *common, "--policy", str(relaxed_policy), "-o", str(tmp_path / "cli")]) == 0
    # an unreadable deployment policy is an error, not the built-in thresholds
    monkeypatch.setenv("GRAPHTRIM_POLICY", str(tmp_path / "missing.yaml"))
    with pytest.raises(PolicyError, match=r"missing\.yaml: no such policy file"):
        GatePolicy.load(None)


def test_a_pipeline_config_embeds_the_deployment_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that names no policy takes the deployment's and carries the document in its config
    (the stages on other workers read it from there; the config hash covers it)."""
    from graphtrim.stages.context import PipelineConfig

    plain = PipelineConfig()
    document = {"variants": {"fp16": {"size": {"max_ratio": 0.25}}}}
    monkeypatch.setenv("GRAPHTRIM_POLICY", str(write_policy(tmp_path, document)))
    config = PipelineConfig()
    assert config.policy is not None and config.policy["variants"] == document["variants"]
    size = config.gate_policy().for_variant("fp16").size
    assert size is not None and size.max_ratio == 0.25
    assert PipelineConfig.from_json(config.to_json()).policy == config.policy
    assert config.to_json() != plain.to_json()
    # a policy given with the run is the one used
    given = PipelineConfig(policy={"variants": {"fp16": {"size": {"max_ratio": 0.5}}}})
    size = given.gate_policy().for_variant("fp16").size
    assert size is not None and size.max_ratio == 0.5
    # a pipeline builds known variants only: an entry for another is a mistake, not a no-op
    with pytest.raises(PolicyError, match=r"unknown variant\(s\) 'int4'"):
        PipelineConfig(policy={"variants": {"int4": {"size": {"max_ratio": 0.5}}}})
    # evaluate judges variants of any name; a known kind spelt otherwise is refused there too
    assert GatePolicy({"variants": {"custom": {}}}).for_variant("custom").size is not None
    with pytest.raises(PolicyError, match="did you mean 'int8-static'"):
        GatePolicy({"variants": {"int8_static": {}}})


def test_cli_evaluate_gpu_is_one_line_and_exit_2(
    digits_task: DigitsTask,
    int8_static: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if HAS_CUDA:
        pytest.skip("this onnxruntime has a CUDA provider")
    out = tmp_path / "gpu"
    argv = ["evaluate", str(digits_task.model), f"int8-static={int8_static}", "-o", str(out)]
    assert main([*argv, "--data", str(digits_task.eval), "--device", "gpu"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("graphtrim: error:") and "CUDAExecutionProvider" in err
    assert not out.exists()  # nothing measured, nothing written


def test_cli_names_a_bare_variant_path_by_its_file_name(
    digits_task: DigitsTask, int8_static: Path, relaxed_policy: Path, tmp_path: Path
) -> None:
    bare = tmp_path / "model.int8-static.onnx"
    shutil.copy(int8_static, bare)
    out = tmp_path / "out"
    argv = ["evaluate", str(digits_task.model), str(bare), "-o", str(out), "-q"]
    assert main([*argv, "--data", str(digits_task.eval), "--policy", str(relaxed_policy)]) == 0
    doc = json.loads((out / "evaluation.json").read_text())
    assert [v["name"] for v in doc["variants"]] == ["int8-static"]
    size = next(g for g in doc["variants"][0]["gates"] if g["gate"] == "size")
    assert size["thresholds"]["max_ratio"] == 0.35  # the int8-static entry of the policy


def test_cli_does_not_drop_a_variant_whose_name_repeats(
    digits_task: DigitsTask,
    int8_static: Path,
    broken: Path,
    tmp_path: Path,
) -> None:
    policy = write_policy(tmp_path, {"defaults": {"latency": False}})
    argv = ["evaluate", str(digits_task.model), f"v={broken}", f"v={int8_static}", "-q"]
    argv += ["-o", str(tmp_path / "out"), "--data", str(digits_task.eval)]
    rc = main([*argv, "--policy", str(policy)])
    assert rc != 0
