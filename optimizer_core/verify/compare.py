"""Numerical equivalence of two models in onnxruntime.

Both models run with onnxruntime's own graph optimizations disabled, on the same inputs: seeded
random inputs of the right dtypes (symbolic dims bound consistently by name to sample sizes) or
inputs the user gives. Every output is compared with explicit tolerances:
``|a - b| <= atol + rtol * |b|`` element-wise, plus a cosine similarity floor for float outputs.
An output computed from a random op (see :mod:`graphtrim.verify.nondeterminism`) is compared
by shape and dtype only.

Some models are ill-conditioned: their outputs are small differences of huge terms (a network
whose activations grow block by block, as random-initialized re-parameterizable ones do), and
rounding alone moves them far beyond any tolerance. When a float output fails, the reference is
run once more with onnxruntime's own graph optimizations on (exact rewrites that round
differently, as graphtrim's do): an output the candidate moves no further than
``NOISE_FACTOR`` times that is within the input's own rounding noise, accepted and said so.

A comparison ends one of three ways: ``equal``; ``mismatch``, the candidate was run (or failed to
load or run where the reference did) and differs; ``unverifiable``, the reference itself cannot
be loaded or run in onnxruntime, or no inputs can be made for it, so nothing was compared.
Repeated node names, which onnxruntime refuses though they mean nothing to the computation, are
made unique in the copy handed to onnxruntime.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from graphtrim.isolation import step
from graphtrim.verify.inputs import (
    _dims_hint,
    declared_input_specs,
    make_inputs,
)
from graphtrim.verify.records import (
    _NUMERIC_MISMATCH,
    NOISE_FACTOR,
    OutputComparison,
    Tolerance,
    VerificationRecord,
)
from graphtrim.verify.session import ModelLike, Session


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

    The reference is loaded and run first: where it cannot be (an op onnxruntime lacks, an
    input type random feeds cannot fill, ...) the record is ``unverifiable``. Where the reference
    runs and the candidate fails to load or run, that is a mismatch: the candidate is broken.
    Outputs the reference computes from a random op are compared by shape and dtype only.

    Args:
        original: the reference model (path, ModelProto or onnx_ir model).
        optimized: the candidate.
        inputs: feeds to use; when absent, ``trials`` seeded random feeds are generated.
        trials: number of random feeds (at least 1).
        seed: seed of the first random feed.
        dim_values: sizes for named symbolic dims (default 2).
        tolerance: default tolerance; ``per_output`` overrides it by output name.
    """
    tol = tolerance or Tolerance()
    per_output = per_output or {}
    if inputs is None and trials < 1:
        raise ValueError(f"trials must be at least 1, got {trials}")
    # read before the sessions open: the model's protobuf is gone again when they hold its weights
    random = random_outputs_of(original)
    step("loading the reference model")
    try:
        ref = Session(original)
    except ModuleNotFoundError:
        raise  # onnxruntime itself is not installed: the command names the extra
    except Exception as exc:
        return VerificationRecord.cannot_verify(
            tol, f"onnxruntime cannot load the reference model: {reason_of(exc)}"
        )
    try:
        return _verify_with(
            ref, original, optimized, inputs, trials, seed, dim_values, tol, per_output, random
        )
    finally:
        ref.close()


def _verify_with(
    ref: Session,
    original: ModelLike,
    optimized: ModelLike,
    inputs: Sequence[Mapping[str, np.ndarray]] | None,
    trials: int,
    seed: int,
    dim_values: Mapping[str, int] | None,
    tol: Tolerance,
    per_output: Mapping[str, Tolerance],
    random_outputs: Mapping[str, str],
) -> VerificationRecord:
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
        return VerificationRecord.cannot_verify(tol, f"cannot make inputs: {reason_of(exc)}")
    step("running the reference model")
    try:
        expected_list = [ref.run(feeds) for feeds in feeds_list]
    except Exception as exc:
        return VerificationRecord.cannot_verify(
            tol,
            f"the reference model fails to run on these inputs: {reason_of(exc)}"
            + _dims_hint(ref.input_specs(), dim_values),
        )
    random = {name: op for name, op in random_outputs.items() if name in ref.output_names()}
    # the reference's results are in hand: its weights go before the candidate's load (a
    # model of several GiB is then held once, not twice)
    ref.close()

    def differs(reason: str) -> VerificationRecord:
        return VerificationRecord(False, 0, [], tol, {}, error=reason, shape_only=random)

    step("loading the optimized model")
    try:
        cand = Session(optimized)
    except Exception as exc:
        return differs(f"onnxruntime cannot load the optimized model: {reason_of(exc)}")
    try:
        ref_names = sorted(s[0] for s in ref.input_specs())
        cand_names = sorted(s[0] for s in cand.input_specs())
        if ref_names != cand_names and inputs is None:
            return differs(f"inputs differ: {ref_names} vs {cand_names}")
        if ref.output_names() != cand.output_names():
            return differs(f"outputs differ: {ref.output_names()} vs {cand.output_names()}")
        merged: dict[str, OutputComparison] = {}
        step("running the optimized model")
        for feeds, expected in zip(feeds_list, expected_list, strict=True):
            try:
                got = cand.run(feeds)
            except Exception as exc:
                return differs(f"the optimized model fails to run: {reason_of(exc)}")
            for name in expected:
                cmp = compare_outputs(
                    name,
                    expected[name],
                    got[name],
                    per_output.get(name, tol),
                    shape_only=name in random,
                )
                prev = merged.get(name)
                if (
                    prev is None
                    or (prev.ok and not cmp.ok)
                    or (prev.ok == cmp.ok and cmp.max_rel_diff > prev.max_rel_diff)
                ):
                    merged[name] = cmp
    finally:
        cand.close()
    shapes = (
        {k: list(np.shape(v)) for k, v in feeds_list[0].items() if isinstance(v, np.ndarray)}
        if feeds_list
        else {}
    )
    outs = list(merged.values())
    # float outputs of equal shape whose values alone differ: rounding may explain these
    numeric = [o for o in outs if not o.ok and o.reason.startswith(_NUMERIC_MISMATCH)]
    if numeric and len(numeric) == sum(not o.ok for o in outs):
        noise = _own_noise(original, feeds_list, expected_list, [o.name for o in numeric])
        for o in numeric:
            if noise.get(o.name, 0.0) > 0 and o.max_abs_diff <= NOISE_FACTOR * noise[o.name]:
                o.ok, o.reason, o.input_noise = True, "", noise[o.name]
    return VerificationRecord(
        all(o.ok for o in outs), len(feeds_list), outs, tol, shapes, shape_only=random
    )


def _own_noise(
    original: ModelLike,
    feeds_list: Sequence[Mapping[str, np.ndarray]],
    expected_list: Sequence[Mapping[str, np.ndarray]],
    names: Sequence[str],
) -> dict[str, float]:
    """Per output in ``names``, how far onnxruntime's own graph optimizations move the
    reference (max abs over the feeds); empty when the reference cannot run so."""
    step("measuring the reference's own rounding noise")
    try:
        sess = Session(original, graph_optimizations=True)
    except Exception:
        return {}
    noise: dict[str, float] = {}
    try:
        for feeds, expected in zip(feeds_list, expected_list, strict=True):
            got = sess.run(feeds)
            for name in names:
                a, b = expected[name], got.get(name)
                if not isinstance(a, np.ndarray) or not isinstance(b, np.ndarray):
                    continue
                if a.shape != b.shape or a.dtype.kind not in "fc" or not a.size:
                    continue
                diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
                finite = diff[np.isfinite(diff)]
                if finite.size:
                    noise[name] = max(noise.get(name, 0.0), float(finite.max()))
    except Exception:
        return {}
    finally:
        sess.close()
    return noise


def _verify_paths(paths: tuple[str, str], **kwargs: Any) -> VerificationRecord:
    """:func:`verify` of two model files (the child's side of :func:`verify_isolated`)."""
    return verify(paths[0], paths[1], **kwargs)


def verify_isolated(
    original: str | Path,
    optimized: str | Path,
    *,
    timeout: float | None = None,
    **kwargs: Any,
) -> VerificationRecord:
    """:func:`verify` of two model files in a child process (:mod:`graphtrim.isolation`).

    onnxruntime can die on the inputs it is given (its integer ``Div`` checks for a zero
    divisor, not for ``INT64_MIN / -1``, which traps: SIGFPE) or hang; in the caller's process
    that ends the command or the pipeline task with no word of why. Here a crash or a hang while the reference model
    loads or runs makes the record ``unverifiable`` (the input cannot be run on these inputs:
    nothing is compared, and the dims to set are named); one while the optimized model loads or
    runs is a mismatch (the input ran, the optimized model did not)."""
    import importlib.util
    import sys

    from graphtrim.isolation import DEFAULT_TIMEOUT, ChildFailed, call_isolated

    # onnxruntime absent is the caller's error to report (the command names the extra), not
    # a child that fails to import it
    if sys.modules.get("onnxruntime", ...) is None or not importlib.util.find_spec("onnxruntime"):
        raise ModuleNotFoundError("No module named 'onnxruntime'", name="onnxruntime")
    tol = kwargs.get("tolerance") or Tolerance()
    try:
        record: VerificationRecord = call_isolated(
            "graphtrim.verify.compare:_verify_paths",
            (str(original), str(optimized)),
            common=kwargs,
            timeout=timeout or DEFAULT_TIMEOUT,
            what="verification",
        )
        return record
    except ChildFailed as exc:
        where = exc.step or "starting onnxruntime"
        what = (
            f"onnxruntime ran past {timeout or DEFAULT_TIMEOUT:g} s"
            if exc.timed_out
            else f"onnxruntime died of {exc.signal_name}"
            if exc.signal_name
            else "onnxruntime stopped without a result"
        )
        if "optimized" in where:
            return VerificationRecord(
                False, 0, [], tol, {}, error=f"{what} while {where} (the input ran)"
            )
        hint = ""
        if kwargs.get("inputs") is None:
            with contextlib.suppress(Exception):
                hint = _dims_hint(declared_input_specs(original), kwargs.get("dim_values"))
        return VerificationRecord.cannot_verify(tol, f"{what} while {where}{hint}")
