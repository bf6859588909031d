"""Numerical equivalence of two models in onnxruntime.

Both models run with onnxruntime's own graph optimizations disabled, on the same inputs: seeded
random inputs of the right dtypes (symbolic dims bound consistently by name to sample sizes) or
inputs the user gives. Every output is compared with explicit tolerances:
``|a - b| <= atol + rtol * |b|`` element-wise, plus a cosine similarity floor for float outputs.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

ModelLike = str | os.PathLike[str] | onnx.ModelProto | ir.Model

_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
    "tensor(int8)": np.int8,
    "tensor(int16)": np.int16,
    "tensor(int32)": np.int32,
    "tensor(int64)": np.int64,
    "tensor(uint8)": np.uint8,
    "tensor(uint16)": np.uint16,
    "tensor(uint32)": np.uint32,
    "tensor(uint64)": np.uint64,
    "tensor(bool)": np.bool_,
}


@dataclasses.dataclass(frozen=True)
class Tolerance:
    rtol: float = 1e-4
    atol: float = 1e-5
    min_cosine: float = 0.9999


@dataclasses.dataclass
class OutputComparison:
    name: str
    ok: bool
    max_abs_diff: float
    max_rel_diff: float
    cosine: float | None
    reason: str = ""


@dataclasses.dataclass
class VerificationRecord:
    """Outcome of :func:`verify`; ``ok`` only when every output of every trial matched."""

    ok: bool
    trials: int
    outputs: list[OutputComparison]
    tolerance: Tolerance
    input_shapes: dict[str, list[int]]
    error: str = ""

    @property
    def max_rel_diff(self) -> float:
        return max((o.max_rel_diff for o in self.outputs), default=0.0)

    @property
    def max_abs_diff(self) -> float:
        return max((o.max_abs_diff for o in self.outputs), default=0.0)

    def first_failure(self) -> OutputComparison | None:
        return next((o for o in self.outputs if not o.ok), None)

    def summary(self) -> str:
        if self.error:
            return f"verification error: {self.error}"
        status = "equal" if self.ok else "MISMATCH"
        text = (
            f"{status} on {self.trials} input set(s): max abs diff {self.max_abs_diff:.3g}, "
            f"max rel diff {self.max_rel_diff:.3g} (rtol {self.tolerance.rtol:g}, atol {self.tolerance.atol:g})"
        )
        bad = self.first_failure()
        if bad is not None:
            text += f"; first mismatch: output '{bad.name}' ({bad.reason})"
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "trials": self.trials,
            "max_abs_diff": self.max_abs_diff,
            "max_rel_diff": self.max_rel_diff,
            "tolerance": dataclasses.asdict(self.tolerance),
            "input_shapes": self.input_shapes,
            "outputs": [dataclasses.asdict(o) for o in self.outputs],
            "error": self.error,
        }


class Session:
    """An onnxruntime session over a path, a ModelProto or an ``onnx_ir`` model.

    Large in-memory models are written to a temporary folder first (protobuf's 2 GB limit; the
    external data of a loaded model is relative to its own folder).
    """

    def __init__(
        self,
        model: ModelLike,
        *,
        threads: int = 1,
        providers: Sequence[str] = ("CPUExecutionProvider",),
    ):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        source: str | bytes
        if isinstance(model, str | os.PathLike):
            source = str(model)
        elif isinstance(model, onnx.ModelProto):
            source = model.SerializeToString()
        else:
            source = self._from_ir(model)
        self.session = ort.InferenceSession(source, so, providers=list(providers))

    def _from_ir(self, model: ir.Model) -> str | bytes:
        from optimizer_core.modelio import (
            PROTO_LIMIT_BYTES,
            has_external_data,
            initializer_bytes,
            save_model,
        )

        if not has_external_data(model) and initializer_bytes(model) < PROTO_LIMIT_BYTES:
            return ir.serde.serialize_model(model).SerializeToString()
        self._tmp = tempfile.TemporaryDirectory(prefix="graphtrim-verify-")
        path = Path(self._tmp.name) / "model.onnx"
        save_model(model, path, external_data=True)
        return str(path)

    def input_specs(self) -> list[tuple[str, Any, list[int | str | None]]]:
        return [(i.name, i.type, list(i.shape)) for i in self.session.get_inputs()]

    def output_names(self) -> list[str]:
        return [o.name for o in self.session.get_outputs()]

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = self.output_names()
        return dict(zip(names, self.session.run(names, dict(feeds)), strict=True))

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def make_inputs(
    specs: Sequence[tuple[str, Any, Sequence[int | str | None]]],
    *,
    seed: int,
    dim_values: Mapping[str, int] | None = None,
    default_dim: int = 2,
) -> dict[str, np.ndarray]:
    """Seeded random feeds; a named symbolic dim gets the same size everywhere it appears."""
    rng = np.random.default_rng(seed)
    bound: dict[str, int] = dict(dim_values or {})
    feeds: dict[str, np.ndarray] = {}
    for name, type_str, shape in specs:
        dtype = _ORT_TYPES.get(type_str)
        if dtype is None:
            raise ValueError(
                f"input '{name}' has type {type_str}, which random inputs cannot fill; pass inputs"
            )
        dims: list[int] = []
        for d in shape:
            if isinstance(d, int) and d >= 0:
                dims.append(d)
            elif isinstance(d, str) and d:
                dims.append(bound.setdefault(d, default_dim))
            else:
                dims.append(default_dim)
        if dtype == np.bool_:
            arr = rng.integers(0, 2, size=dims).astype(np.bool_)
        elif np.issubdtype(dtype, np.integer):
            arr = rng.integers(0, 8, size=dims).astype(dtype)
        else:
            arr = rng.standard_normal(size=dims).astype(dtype)
        feeds[name] = arr
    return feeds


def compare_outputs(
    name: str, ref: np.ndarray, got: np.ndarray, tol: Tolerance
) -> OutputComparison:
    if ref.shape != got.shape:
        return OutputComparison(
            name, False, float("inf"), float("inf"), None, f"shape {got.shape} != {ref.shape}"
        )
    if ref.dtype != got.dtype:
        return OutputComparison(
            name, False, float("inf"), float("inf"), None, f"dtype {got.dtype} != {ref.dtype}"
        )
    if ref.size == 0:
        return OutputComparison(name, True, 0.0, 0.0, None)
    if ref.dtype.kind not in "fc":
        equal = bool(np.array_equal(ref, got))
        diff = (
            0.0 if equal else float(np.max(np.abs(ref.astype(np.float64) - got.astype(np.float64))))
        )
        return OutputComparison(
            name, equal, diff, diff, None, "" if equal else "integer outputs differ"
        )
    a = ref.astype(np.float64)
    b = got.astype(np.float64)
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    if not np.array_equal(nan_a, nan_b):
        return OutputComparison(
            name, False, float("inf"), float("inf"), None, "NaN positions differ"
        )
    finite = np.isfinite(a) & np.isfinite(b)
    if not np.array_equal(a[~finite & ~nan_a], b[~finite & ~nan_b]):
        return OutputComparison(name, False, float("inf"), float("inf"), None, "infinities differ")
    da, db = a[finite], b[finite]
    abs_diff = np.abs(da - db)
    max_abs = float(abs_diff.max()) if abs_diff.size else 0.0
    scale = float(np.max(np.abs(da))) if da.size else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    ok = bool(np.all(abs_diff <= tol.atol + tol.rtol * np.abs(da)))
    cosine: float | None = None
    na, nb = float(np.linalg.norm(da)), float(np.linalg.norm(db))
    if na > 0 and nb > 0:
        cosine = float(np.dot(da.ravel(), db.ravel()) / (na * nb))
        # cosine judges direction only where differences exceed the absolute floor
        if cosine < tol.min_cosine and max_abs > tol.atol:
            ok = False
    reason = "" if ok else f"max abs diff {max_abs:.3g}, max rel diff {max_rel:.3g}"
    return OutputComparison(name, ok, max_abs, max_rel, cosine, reason)


def verify(
    original: ModelLike,
    optimized: ModelLike,
    *,
    inputs: Sequence[Mapping[str, np.ndarray]] | None = None,
    trials: int = 3,
    seed: int = 0,
    dim_values: Mapping[str, int] | None = None,
    tolerance: Tolerance | None = None,
    per_output: Mapping[str, Tolerance] | None = None,
) -> VerificationRecord:
    """Run both models on the same inputs and compare every output.

    Args:
        original: the reference model (path, ModelProto or onnx_ir model).
        optimized: the candidate.
        inputs: feeds to use; when absent, ``trials`` seeded random feeds are generated.
        trials: number of random feeds.
        seed: seed of the first random feed.
        dim_values: sizes for named symbolic dims (default 2).
        tolerance: default tolerance; ``per_output`` overrides it by output name.
    """
    tol = tolerance or Tolerance()
    per_output = per_output or {}
    try:
        ref = Session(original)
        cand = Session(optimized)
    except Exception as exc:
        return VerificationRecord(
            False, 0, [], tol, {}, error=f"cannot load model in onnxruntime: {exc}"
        )
    try:
        if [s[0] for s in ref.input_specs()] != [
            s[0] for s in cand.input_specs()
        ] and inputs is None:
            ref_names = sorted(s[0] for s in ref.input_specs())
            cand_names = sorted(s[0] for s in cand.input_specs())
            if ref_names != cand_names:
                return VerificationRecord(
                    False, 0, [], tol, {}, error=f"inputs differ: {ref_names} vs {cand_names}"
                )
        if ref.output_names() != cand.output_names():
            return VerificationRecord(
                False,
                0,
                [],
                tol,
                {},
                error=f"outputs differ: {ref.output_names()} vs {cand.output_names()}",
            )
        try:
            feeds_list = (
                list(inputs)
                if inputs is not None
                else [
                    make_inputs(ref.input_specs(), seed=seed + i, dim_values=dim_values)
                    for i in range(trials)
                ]
            )
        except ValueError as exc:  # an input type random feeds cannot fill
            return VerificationRecord(False, 0, [], tol, {}, error=f"cannot make inputs: {exc}")
        merged: dict[str, OutputComparison] = {}
        for feeds in feeds_list:
            try:
                expected = ref.run(feeds)
            except Exception as exc:
                return VerificationRecord(
                    False, 0, [], tol, {}, error=f"the original model fails on these inputs: {exc}"
                )
            try:
                got = cand.run(feeds)
            except Exception as exc:
                return VerificationRecord(
                    False, 0, [], tol, {}, error=f"the optimized model fails to run: {exc}"
                )
            for name in expected:
                cmp = compare_outputs(name, expected[name], got[name], per_output.get(name, tol))
                prev = merged.get(name)
                if (
                    prev is None
                    or (prev.ok and not cmp.ok)
                    or (prev.ok == cmp.ok and cmp.max_rel_diff > prev.max_rel_diff)
                ):
                    merged[name] = cmp
        shapes = {k: list(v.shape) for k, v in feeds_list[0].items()} if feeds_list else {}
        outs = list(merged.values())
        return VerificationRecord(all(o.ok for o in outs), len(feeds_list), outs, tol, shapes)
    finally:
        ref.close()
        cand.close()
