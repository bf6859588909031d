"""Comparing two models' outputs: element-wise within a tolerance (structured outputs, sequences
and maps, leaf by leaf), the outputs a model draws at random (compared by shape and type only),
and an exception's message on one line."""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from graphtrim.verify.records import (
    _NUMERIC_MISMATCH,
    OutputComparison,
    Tolerance,
)
from graphtrim.verify.session import ModelLike


def random_outputs_of(model: ModelLike) -> dict[str, str]:
    """:func:`~graphtrim.verify.nondeterminism.random_outputs` of a path, proto or model;
    empty where the model cannot be read (the session that follows says why)."""
    from graphtrim.verify.nondeterminism import random_outputs

    try:
        if isinstance(model, str | os.PathLike):
            model = onnx.load(str(model), load_external_data=False)
        if isinstance(model, onnx.ModelProto):
            model = ir.serde.deserialize_model(model)
        return random_outputs(model)
    except Exception:
        return {}


def _leaves(x: Any) -> tuple[Any, list[np.ndarray]]:
    """A sequence or map output (onnxruntime returns lists and dicts for them) as its structure
    (lengths, keys) and its tensors in a fixed order."""
    if isinstance(x, dict):
        keys = sorted(x, key=repr)
        parts = [_leaves(x[k]) for k in keys]
        return ("map", tuple(keys), tuple(p[0] for p in parts)), [a for p in parts for a in p[1]]
    if isinstance(x, list | tuple):
        parts = [_leaves(e) for e in x]
        return ("seq", tuple(p[0] for p in parts)), [a for p in parts for a in p[1]]
    arr = np.asarray(x)
    return ("tensor",), [arr]


def _compare_structured(
    name: str, ref: Any, got: Any, tol: Tolerance, shape_only: bool
) -> OutputComparison:
    ref_structure, ref_leaves = _leaves(ref)
    got_structure, got_leaves = _leaves(got)
    if ref_structure != got_structure:
        return OutputComparison(
            name, False, float("inf"), float("inf"), None, "sequence or map structure differs"
        )
    parts = [
        compare_outputs(name, a, b, tol, shape_only=shape_only)
        for a, b in zip(ref_leaves, got_leaves, strict=True)
    ]
    bad = [p for p in parts if not p.ok]
    cosines = [p.cosine for p in parts if p.cosine is not None]
    return OutputComparison(
        name,
        not bad,
        max((p.max_abs_diff for p in parts), default=0.0),
        max((p.max_rel_diff for p in parts), default=0.0),
        min(cosines) if cosines else None,
        bad[0].reason if bad else "",
    )


def compare_outputs(
    name: str, ref: Any, got: Any, tol: Tolerance, *, shape_only: bool = False
) -> OutputComparison:
    """Compare one output; with ``shape_only`` (a random op's output) values are not looked at.
    Sequence and map outputs are compared element by element (keys and lengths must match)."""
    if not isinstance(ref, np.ndarray) or not isinstance(got, np.ndarray):
        return _compare_structured(name, ref, got, tol, shape_only)
    if ref.shape != got.shape:
        return OutputComparison(
            name, False, float("inf"), float("inf"), None, f"shape {got.shape} != {ref.shape}"
        )
    if ref.dtype != got.dtype:
        return OutputComparison(
            name, False, float("inf"), float("inf"), None, f"dtype {got.dtype} != {ref.dtype}"
        )
    if ref.size == 0 or shape_only:
        return OutputComparison(name, True, 0.0, 0.0, None)
    if ref.dtype.kind not in "fc":
        equal = bool(np.array_equal(ref, got))
        if equal:
            diff = 0.0
        elif ref.dtype.kind in "OSU":  # strings: no distance, only different
            diff = float("inf")
        else:
            diff = float(np.max(np.abs(ref.astype(np.float64) - got.astype(np.float64))))
        return OutputComparison(
            name, equal, diff, diff, None, "" if equal else f"{ref.dtype.name} outputs differ"
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
    reason = "" if ok else f"{_NUMERIC_MISMATCH} {max_abs:.3g}, max rel diff {max_rel:.3g}"
    return OutputComparison(name, ok, max_abs, max_rel, cosine, reason)


# onnxruntime prefixes some messages with its source file and a C++ signature:
# "/onnxruntime_src/.../model_load_utils.h:46 void onnxruntime::...(const std::string&, int) "
_ORT_SOURCE = re.compile(r"/onnxruntime_src/\S+:\d+ .*?\)(?= [A-Z])\s*")


def reason_of(exc: BaseException) -> str:
    """An exception's message on one line (onnxruntime's span several), without the C++
    source location and signature onnxruntime puts in some."""
    text = " ".join(str(exc).split())
    return _ORT_SOURCE.sub("", text) or type(exc).__name__
