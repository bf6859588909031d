"""What the sweep measures of a model besides the tools' own runs: the p50 latency of graphtrim's
output against its input (interleaved, measured again while slower), and how far rounding alone
moves the input's outputs (onnxruntime without and with its graph optimizations)."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from bench.__main__ import latency
from bench.sweep_render import SLOWER


def self_instability(src: Path, dims: dict[str, int]) -> float | None:
    """The input's own max abs difference between onnxruntime without and with its graph
    optimizations (same feeds): how far rounding alone moves this model's outputs."""
    import onnxruntime as ort

    from graphtrim.verify import make_inputs

    outs = []
    try:
        for level in (
            ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        ):
            so = ort.SessionOptions()
            so.graph_optimization_level = level
            so.log_severity_level = 3
            sess = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
            specs = [(i.name, i.type, list(i.shape)) for i in sess.get_inputs()]
            outs.append(sess.run(None, make_inputs(specs, seed=0, dim_values=dims)))
    except Exception:
        return None
    worst = 0.0
    for a, b in zip(*outs, strict=True):
        if isinstance(a, np.ndarray) and a.dtype.kind == "f" and a.shape == b.shape and a.size:
            worst = max(worst, float(np.nanmax(np.abs(a.astype(np.float64) - b))))
    return worst


def measure_latency(
    res: dict[str, Any], src: Path, dst: Path, dims: dict[str, int], args: argparse.Namespace
) -> None:
    """p50 of graphtrim's output over the input's, ORT_ENABLE_ALL, interleaved; measured again,
    longer, while the median ratio is above ``SLOWER``."""
    ratios = []
    for min_seconds in (
        args.latency_seconds,
        4 * args.latency_seconds,
        4 * args.latency_seconds,
    ):
        p50 = latency(
            {"original": src, "graphtrim": dst},
            10,
            True,
            min_seconds=min_seconds,
            dim_values=dims,
        )
        if "original" not in p50 or "graphtrim" not in p50:
            break
        ratios.append(p50["graphtrim"] / p50["original"])
        res["p50_ms"] = p50
        if statistics.median(ratios) <= SLOWER:
            break
    if ratios:
        res["latency_ratio"] = statistics.median(ratios)
        res["latency_ratios"] = ratios
