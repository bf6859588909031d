"""Entry point of the graph optimizer: run a preset to a fixed point on an ``onnx_ir`` model."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.driver import FixedPointDriver
from graphtrim.graph.framework import ChangeLog, Instrument, OptimizeOptions, ProgressFn
from graphtrim.graph.opset import passthrough_reason, upgrade_opset
from graphtrim.graph.passes.scalar_inputs import ScalarInputs
from graphtrim.graph.presets import build, resolve
from graphtrim.graph.shape_inference import ShapeInference
from graphtrim.graph.targets import record_metadata

logger = logging.getLogger("graphtrim.optimizer")


@dataclasses.dataclass
class OptimizeResult:
    model: ir.Model
    log: ChangeLog
    modified: bool


def _normalize(model: ir.Model, log: ChangeLog) -> None:
    # Before IR version 4 every initializer had to be a graph input too, and runtimes treat
    # those as constants. Make that explicit so folding may add initializers.
    if model.ir_version is not None and model.ir_version < 4:
        graph = model.graph
        kept = [v for v in graph.inputs if not v.is_initializer()]
        if len(kept) != len(graph.inputs):
            graph.inputs.clear()
            graph.inputs.extend(kept)
        log.notes.append(
            f"IR version {model.ir_version} raised to 4; initializers are no longer listed as inputs"
        )
        model.ir_version = 4


def _free_output_names(model: ir.Model) -> list[ir.Shape | None]:
    """The main graph's output shapes as declared, by position. Dim names that only outputs
    declare (no graph input has them) are forgotten for the run, on the outputs and on every
    value inference named after them, so inference names those dims from the graph: an
    exporter names an output's dims after the output (``Concatpresent_key_0_dim_0`` is the
    ``batch`` its inputs have, which nothing relates them to otherwise)."""
    graph = model.graph
    declared = [value.shape for value in graph.outputs]
    inputs = {
        d.value
        for value in graph.inputs
        if value.shape is not None
        for d in value.shape.dims
        if isinstance(d, ir.SymbolicDim) and d.value
    }
    only_out = {
        d.value
        for value in graph.outputs
        if value.shape is not None and value.producer() is not None
        for d in value.shape.dims
        if isinstance(d, ir.SymbolicDim) and d.value and d.value not in inputs
    }
    if not only_out:
        return declared
    for g in u.all_graphs(model):
        for node in g:
            for value in node.outputs:
                shape = value.shape
                if shape is not None and any(
                    isinstance(d, ir.SymbolicDim) and d.value in only_out for d in shape.dims
                ):
                    value.shape = ir.Shape(
                        [
                            None if isinstance(d, ir.SymbolicDim) and d.value in only_out else d
                            for d in shape.dims
                        ]
                    )
    ShapeInference()(model)
    return declared


def _restore_output_names(model: ir.Model, declared: Sequence[ir.Shape | None]) -> None:
    """Give the outputs back the dim names they were declared with (the model's interface),
    where the rank is the same and the optimized shape agrees on every static size."""
    for value, shape in zip(model.graph.outputs, declared, strict=False):
        if shape is None:
            continue
        now = value.shape
        if now is None or len(now) != len(shape):
            value.shape = shape
            continue
        dims: list[int | str | None] = []
        for d, n in zip(shape.dims, now.dims, strict=True):
            if isinstance(d, ir.SymbolicDim) and d.value:
                dims.append(d.value)
            elif isinstance(d, int):
                dims.append(d)
            else:
                dims.append(n if isinstance(n, int) else getattr(n, "value", None))
        value.shape = ir.Shape(dims)


def optimize_model(
    model: ir.Model,
    *,
    preset: str = "default",
    passes: Sequence[str] | None = None,
    skip: Sequence[str] = (),
    options: OptimizeOptions | None = None,
    instruments: Sequence[Instrument] = (),
    progress: ProgressFn | None = None,
) -> OptimizeResult:
    """Optimize ``model`` in place and return it with the change log (with
    ``options.target_opset`` above the model's opset, the returned model is a converted copy).

    Args:
        model: the model; it is modified in place.
        preset: name of a preset in ``graphtrim.graph.presets.PRESETS``.
        passes: explicit pass names (overrides the preset).
        skip: pass names to leave out.
        options: folding budgets, iteration cap and the like.
        instruments: hooks called after every pass (e.g. per-pass verification).
        progress: called with a short line before each pass.

    A model the passes do not handle (see :func:`~graphtrim.graph.opset.passthrough_reason`)
    comes back untouched, ``modified`` false, with the reason in ``log.passed_through``.

    For the ``ort-cpu`` / ``ort-cuda`` targets this returns the portable model; onnxruntime's
    fusions are chosen by timing, above this layer (:func:`graphtrim.ort_target.apply_target`).
    """
    options = options or OptimizeOptions()
    names = resolve(preset, passes, skip)
    reason = passthrough_reason(dict(model.opset_imports), options.target_opset)
    if reason is not None:
        log = ChangeLog(
            preset=preset if not passes else "custom",
            passes=[],
            notes=[f"passed through: {reason}"],
            target={"target": options.target},
            passed_through=reason,
        )
        return OptimizeResult(model=model, log=log, modified=False)
    driver = FixedPointDriver(
        build(names, options),
        preset=preset if not passes else "custom",
        options=options,
        per_iteration=[ShapeInference(only_if_unknown=True)],
        repairs=[ScalarInputs(options)],
        instruments=instruments,
        progress=progress,
    )
    notes: list[str] = []
    if options.target_opset is not None:
        model, note = upgrade_opset(model, options.target_opset)
        if note:
            notes.append(note)
    probe = ChangeLog(preset=driver.preset, passes=names)
    _normalize(model, probe)
    notes.extend(probe.notes)
    with u.flat_model(model):
        declared = _free_output_names(model)
        result = driver(model)
        _restore_output_names(result.model, declared)
    driver.log.notes[:0] = notes
    out = result.model
    modified = result.modified or bool(notes)
    driver.log.target = {"target": options.target}
    record_metadata(out, options.target, driver.log.fusions())
    return OptimizeResult(model=out, log=driver.log, modified=modified)
