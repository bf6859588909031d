"""Optimize a model file: load safely, run the passes, verify, save atomically, report."""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import onnx
import onnx_ir as ir

from graphtrim import __version__
from graphtrim.errors import GraphtrimError, VerificationError, VerificationUnavailable
from graphtrim.graph.framework import ChangeLog, Instrument, OptimizeOptions, ProgressFn
from graphtrim.graph.metadata import (
    StrippedMetadata,
    strip_debug_metadata_stats,
    strip_intermediate_shapes,
)
from graphtrim.graph.opset import passthrough_reason
from graphtrim.graph.optimizer import optimize_model
from graphtrim.graph.presets import resolve
from graphtrim.modelio import (
    deserialize,
    input_files,
    load_model,
    read_validated,
    refuse_overwrite,
    save_model,
    staging_dir,
)
from graphtrim.ort_target import apply_target, settle_norm_scales
from graphtrim.stats import ModelStats, before_after_table

if TYPE_CHECKING:
    # imported where a model is verified: optimizing alone does without them
    import numpy as np

    from graphtrim.verify import Tolerance, VerificationRecord


@dataclasses.dataclass
class OptimizeReport:
    input: str
    output: str
    before: ModelStats
    after: ModelStats
    log: ChangeLog
    seconds: float
    verification: VerificationRecord | None = None
    # exporter debug metadata removed from the output; None when it was kept
    metadata_stripped: StrippedMetadata | None = None
    # intermediate values whose type and shape annotations were removed; None when kept
    shapes_stripped: int | None = None

    def table(self) -> str:
        return before_after_table(self.before, self.after, self.seconds)

    def to_json(self) -> dict[str, Any]:
        return {
            "graphtrim_version": __version__,
            "input": self.input,
            "output": self.output,
            "seconds": round(self.seconds, 6),
            "before": self.before.to_json(),
            "after": self.after.to_json(),
            "optimization": self.log.to_json(),
            "debug_metadata": (
                {"stripped": True, **self.metadata_stripped.to_json()}
                if self.metadata_stripped is not None
                else {"stripped": False}
            ),
            "intermediate_shapes": (
                {"stripped": True, "values": self.shapes_stripped}
                if self.shapes_stripped is not None
                else {"stripped": False}
            ),
            "verification": self.verification.to_json() if self.verification else None,
        }

    def write_json(self, path: str | os.PathLike[str]) -> None:
        """Write the report atomically: a temporary file beside ``path``, renamed into place;
        on any failure the temporary file is removed and ``path`` is left as it was."""
        target = Path(path)
        if target.is_dir():
            raise GraphtrimError(f"report {target} is a directory; give a file path")
        text = json.dumps(self.to_json(), indent=2, sort_keys=False)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            tmp.chmod(0o644)  # mkstemp's 0600 would hide the report from its readers
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def _check_paths(src: Path, dst: Path, proto: onnx.ModelProto) -> None:
    for out in (dst, dst.with_name(dst.name + ".data")):
        if out.is_dir():
            raise GraphtrimError(f"output {out} is a directory; give a file path")
    folder = next((p for p in dst.parents if p.exists()), None)
    if folder is not None and not folder.is_dir():
        raise GraphtrimError(f"cannot write {dst}: {folder} is not a folder")
    refuse_overwrite(src, dst, proto)


def _move_into_place(staged: Sequence[Path], dst: Path) -> None:
    """Move a staged model (and its data file) to ``dst``: the data file first, then the
    model that refers to it; without external data now, a stale ``.data`` of an earlier run
    goes."""
    for path in reversed(staged):
        os.replace(path, dst.parent / path.name)
    if len(staged) == 1:
        dst.with_name(dst.name + ".data").unlink(missing_ok=True)


def _pass_through(
    src: Path,
    dst: Path,
    proto: onnx.ModelProto,
    src_files: Sequence[Path],
    reason: str,
    *,
    preset: str,
    passes: Sequence[str] | None,
    skip: Sequence[str],
    options: OptimizeOptions | None,
    check: bool,
    progress: ProgressFn | None,
) -> OptimizeReport:
    """Write the input to ``dst`` unchanged: the file's own bytes when it has no external data,
    else the same graph with its weights in ``<dst>.data`` (as every output keeps them)."""
    resolve(preset, passes, skip)  # unknown preset or pass names are refused all the same
    if progress is not None:
        progress(f"passed through: {reason}")
    start = time.perf_counter()
    model = deserialize(proto)
    external = len(src_files) > 1
    if external:
        ir.external_data.set_base_dir(model.graph, str(src.parent.resolve()))
    log = ChangeLog(
        preset=preset if not passes else "custom",
        passes=[],
        notes=[f"passed through: {reason}"],
        target={"target": (options or OptimizeOptions()).target},
        passed_through=reason,
    )
    if check:
        # nothing to compare: the output computes what the input computes by construction
        log.notes.append("verification skipped: the output is a copy of the input")
    staging = staging_dir(dst)
    try:
        if external:
            staged = save_model(model, staging / dst.name)
        else:
            staged = [staging / dst.name]
            shutil.copyfile(src, staged[0])
        report = OptimizeReport(
            str(src),
            str(dst),
            ModelStats.of(model, src_files),
            ModelStats.of(model, staged),
            log,
            time.perf_counter() - start,
        )
        _move_into_place(staged, dst)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return report


P = ParamSpec("P")
R = TypeVar("R")


def _collecting(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn``, then a garbage collection: a model's IR graph is a web of references that only
    the cycle collector frees, and without a collection the models an optimize (and its
    verification) read would stay in memory through whatever the caller does next.

    The young generations always (what a small model left there); a full collection where the
    call left the process :data:`FULL_COLLECTION_FROM` bytes bigger or more. A full collection
    walks every object of the process, a second or more in one that holds a framework or two,
    and a model that size has long been moved to the oldest generation by then."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        before = _resident_bytes()
        try:
            return fn(*args, **kwargs)
        finally:
            after = _resident_bytes()
            grew = None if before is None or after is None else after - before
            gc.collect(1 if grew is not None and grew < FULL_COLLECTION_FROM else 2)

    return wrapper


# how much a call may leave the process bigger before it pays for a full collection
FULL_COLLECTION_FROM = 32 * 2**20


def _resident_bytes() -> int | None:
    """This process's resident memory (Linux), or None where it cannot be read cheaply."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def release_weights(model: ir.Model) -> None:
    """Close the file mappings of ``model``'s external weights (read again from the file if
    anything needs them later)."""
    for graph in model.graphs():
        for value in graph.initializers.values():
            if isinstance(value.const_value, ir.ExternalTensor):
                value.const_value.release()


@_collecting
def optimize_file(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    preset: str = "default",
    passes: Sequence[str] | None = None,
    skip: Sequence[str] = (),
    options: OptimizeOptions | None = None,
    check: bool = False,
    check_each_pass: bool = False,
    tolerance: Tolerance | None = None,
    trials: int = 3,
    dim_values: Mapping[str, int] | None = None,
    inputs: Sequence[Mapping[str, np.ndarray]] | None = None,
    progress: ProgressFn | None = None,
    keep_metadata: bool = False,
    keep_shapes: bool = False,
) -> OptimizeReport:
    """Optimize the model at ``src`` into ``dst``.

    The input is never written. A valid model the passes do not handle (no default-domain
    opset, or one below :data:`~graphtrim.graph.opset.MIN_OPSET`) is written out unchanged
    and the report says why (``log.passed_through``); there is nothing to verify then. With
    ``check`` the saved result is compared with the input in onnxruntime; with
    ``check_each_pass`` every pass is checked and the first one to change
    results is named. Either failure raises :class:`VerificationError` and leaves no output.
    Both compare on ``inputs`` where given (feeds named like the model's inputs), else on
    ``trials`` seeded random feeds sized by ``dim_values``.
    Exporter debug metadata (node ``metadata_props``, doc strings: see
    :mod:`graphtrim.graph.metadata`) is removed from the output unless ``keep_metadata``;
    the model's own ``metadata_props`` always stay. The type and shape annotations of
    intermediate values (``value_info``) go too unless ``keep_shapes``: onnxruntime infers its
    own, and the ones left by rewrites can steer its transformers to slower graphs (see
    :func:`~graphtrim.graph.metadata.strip_intermediate_shapes`). The report says how much went.

    Raises:
        InvalidModelError: the input cannot be optimized (corrupt, unsafe, unsupported).
        VerificationError: results changed.
        VerificationUnavailable: ``check``/``check_each_pass`` but the input itself cannot be
            run in onnxruntime (nothing written).
        GraphtrimError: other refusals (bad arguments, output would overwrite the input).
    """
    src_p, dst_p = Path(src), Path(dst)
    validated = read_validated(src_p)  # read and checked once: load_model takes it as it is
    proto = validated.proto
    _check_paths(src_p, dst_p, proto)
    src_files = input_files(src_p, proto)  # with every external data file the model names
    reason = passthrough_reason(
        {o.domain or "": o.version for o in proto.opset_import},
        options.target_opset if options is not None else None,
    )
    if reason is not None:
        return _pass_through(
            src_p,
            dst_p,
            proto,
            src_files,
            reason,
            preset=preset,
            passes=passes,
            skip=skip,
            options=options,
            check=check or check_each_pass,
            progress=progress,
        )
    del proto
    start = time.perf_counter()
    model = load_model(src_p, validated)
    del validated
    before = ModelStats.of(model, src_files)
    instruments: list[Instrument] = []
    if check_each_pass:
        from graphtrim.verify import VerifyEachPass

        instruments.append(
            VerifyEachPass(
                inputs=inputs,
                trials=max(1, min(trials, 2)),
                dim_values=dim_values,
                tolerance=tolerance,
            )
        )
    result = optimize_model(
        model,
        preset=preset,
        passes=passes,
        skip=skip,
        options=options,
        instruments=instruments,
        progress=progress,
    )
    result = settle_norm_scales(src_p, apply_target(result))
    stripped = None if keep_metadata else strip_debug_metadata_stats(result.model)
    shapes = None if keep_shapes else strip_intermediate_shapes(result.model)
    seconds = time.perf_counter() - start
    dst_p.parent.mkdir(parents=True, exist_ok=True)
    # stage beside the target: a model that fails verification never reaches ``dst``
    staging = staging_dir(dst_p)  # removes what a killed run left beside dst
    try:
        staged = save_model(result.model, staging / dst_p.name)
        after = ModelStats.of(result.model, staged)
        report = OptimizeReport(
            str(src_p),
            str(dst_p),
            before,
            after,
            result.log,
            seconds,
            metadata_stripped=stripped,
            shapes_stripped=shapes,
        )
        if check:
            from graphtrim.verify import verify_isolated

            # the model's weights are mapped from the input and were read to write the output:
            # those pages would stay in this process beside each verifying session's weights
            release_weights(result.model)
            release_weights(model)
            if progress is not None:
                progress("verifying the optimized model against the input")
            # in a child process: onnxruntime dying on the inputs must not take the
            # command or the pipeline task down with it
            record = verify_isolated(
                src_p,
                staged[0],
                inputs=inputs,
                trials=trials,
                dim_values=dim_values,
                tolerance=tolerance,
            )
            report.verification = record
            if record.unverifiable:
                raise VerificationUnavailable(
                    f"cannot verify the optimized model: {record.error}; nothing was written"
                )
            if not record.ok:
                raise VerificationError(
                    f"the optimized model does not match the input: {record.summary()}; "
                    "rerun with --verify-each-pass to find the pass responsible",
                    record=record,
                )
        _move_into_place(staged, dst_p)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return report
