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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from graphtrim.isolation import step
from graphtrim.verify.inputs import (
    _dims_hint,
    declared_input_specs,
    make_inputs,
)
from graphtrim.verify.outputs import (
    compare_outputs,
    random_outputs_of,
    reason_of,
)
from graphtrim.verify.records import (
    _NUMERIC_MISMATCH,
    NOISE_FACTOR,
    OutputComparison,
    Tolerance,
    VerificationRecord,
)
from graphtrim.verify.session import ModelLike, Session


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
