"""Shared test helpers: build models from ONNX text, optimize, and check the three things every
pass test checks (the rule fired, outputs equal in onnxruntime, the full ONNX checker passes)."""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from graphtrim.graph.optimizer import OptimizeResult, optimize_model
from graphtrim.ort_target import apply_target
from graphtrim.verify import Tolerance, verify


def parse(text: str) -> onnx.ModelProto:
    proto = onnx.parser.parse_model(text)
    onnx.checker.check_model(proto, full_check=True)
    return proto


def written_out_layernorm(x: str) -> str:
    """ONNX text of a LayerNormalization of ``x`` over its last axis written out op by op, as
    exporters write it below opset 17: the normalized value is ``n`` (before any scale and shift);
    ``two`` and ``eps`` are constants the model defines."""
    return f"""m = ReduceMean<axes = [-1]>({x})
            d = Sub({x}, m)
            sq = Pow(d, two)
            v = ReduceMean<axes = [-1]>(sq)
            ve = Add(v, eps)
            sd = Sqrt(ve)
            n = Div(d, sd)"""


def ort_kernels(path: Path | str) -> list[str]:
    """The ops onnxruntime's CPU provider runs for the model at ``path`` (its optimizations on;
    the optimized model is written beside it)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(path) + ".ort.onnx"
    so.log_severity_level = 3
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return [n.op_type for n in onnx.load(str(path) + ".ort.onnx").graph.node]


def run_passes(
    proto: onnx.ModelProto, passes: Sequence[str] | None = None, preset: str = "default", **kw
) -> tuple[onnx.ModelProto, OptimizeResult]:
    # onnx_ir shares tensors with the proto it reads: work on a copy so ``proto`` stays the reference
    model = ir.serde.deserialize_model(copy.deepcopy(proto))
    # with an onnxruntime target, the fusions chosen by timing as ``graphtrim optimize`` applies them
    result = apply_target(optimize_model(model, preset=preset, passes=passes, **kw))
    out = ir.serde.serialize_model(result.model)
    return out, result


def rules_fired(result: OptimizeResult) -> dict[str, int]:
    merged: dict[str, int] = {}
    for rec in result.log.records:
        for k, v in rec.rules.items():
            merged[k] = merged.get(k, 0) + v
    return merged


def op_types(proto: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in proto.graph.node]


def assert_equivalent(
    original: onnx.ModelProto,
    optimized: onnx.ModelProto,
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    inputs=None,
    dim_values=None,
) -> None:
    """Full ONNX check of the result, then outputs compared in onnxruntime (exact by default)."""
    onnx.checker.check_model(optimized, full_check=True)
    record = verify(
        original,
        optimized,
        inputs=inputs,
        dim_values=dim_values,
        tolerance=Tolerance(rtol=rtol, atol=atol, min_cosine=0.0),
    )
    assert record.ok, record.summary()


def random_feed(shape, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape).astype(dtype)


__all__ = ["assert_equivalent", "op_types", "parse", "random_feed", "rules_fired", "run_passes"]


def tiny_onnx(path: Path) -> Path:
    """A one-node model (Relu over ``x[1, 2]``) at ``path``: something to register or log."""
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 2])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 2])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])
    onnx.save(model, str(path))
    return path


def untimed_policy(doc: dict[str, Any] | None = None) -> Any:
    """The policy ``doc`` with every kind's latency measured and ranked but under no bar: on a
    machine busy with the whole suite, a variant that computes what the reference does times
    anywhere near 1x, and a search whose every candidate missed a latency bar by noise ends
    without a champion. These tests are about the search, not about timing."""
    from graphtrim.gates import GatePolicy
    from graphtrim.quantize.kinds import KINDS

    doc = dict(doc or {})
    variants = {k.name: {"latency": {"min_speedup": None}} for k in KINDS}
    for name, entry in doc.get("variants", {}).items():
        variants[name] = {**variants.get(name, {}), **entry}
    return GatePolicy({**doc, "variants": variants})
