"""Pipeline stages: one module per stage, each a function from typed input records to a typed,
JSON-serializable output record. ``STAGES`` is the one place that lists them, in order; the CLI's
``graphtrim pipeline stage``, the Airflow operators and the Kubeflow steps are derived from it.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Stage:
    """How a stage sits in the pipeline.

    Attributes:
        name: the stage's name (CLI ``graphtrim pipeline stage NAME``, task ids, record keys).
        inputs: the records of earlier stages it reads, by stage name.
        per_variant: runs once per variant (a mapped task, a ``ParallelFor`` step).
        on_device: runs on the worker class the variant targets (CPU or GPU workers).
        writes_registry: writes to the model registry, so it is never served from a cache.
        summary: one line for ``--help`` and the UIs.
        function: the stage function, ``module:name``: ``fn(ctx, config, *records)`` with the
            records named by :attr:`args`, in that order (the first stage takes the model URI),
            returning its record. Imported when first called, so listing the stages stays light.
        record: the type of the record it returns, ``module:name`` (:mod:`.records`).
        takes: the records the function takes, in order, when not all of ``inputs``: the export
            record reaches every stage run apart for its resolved config (the data hashes)
            only.
        searched: with ``tune`` in the config, an orchestrator runs the settings search before
            it over its worker pool (:mod:`.tune`: a plan, then per round a task per trial and
            a select), on the records of its ``inputs``, and gives it the search's state as
            ``tuned``; run alone, the stage searches itself.
    """

    name: str
    inputs: tuple[str, ...]
    summary: str
    per_variant: bool = False
    on_device: bool = False
    writes_registry: bool = False
    function: str = ""
    record: str = ""
    takes: tuple[str, ...] | None = None
    searched: bool = False

    @property
    def args(self) -> tuple[str, ...]:
        """The records its function takes, in order."""
        return self.inputs if self.takes is None else self.takes

    def load(self) -> Any:
        """The stage function."""
        return _resolve(self.function)

    def record_type(self) -> Any:
        """The record type the stage function returns."""
        return _resolve(self.record)


def _resolve(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


STAGES: tuple[Stage, ...] = (
    Stage(
        "export",
        (),
        "resolve the registry version and export it to ONNX",
        function="graphtrim.stages.export:export",
        record="graphtrim.stages.records:ExportRecord",
    ),
    Stage(
        "optimize",
        ("export",),
        "optimize the exported graph, verified against it",
        function="graphtrim.stages.optimize:optimize",
        record="graphtrim.stages.records:OptimizeRecord",
    ),
    Stage(
        "quantize",
        ("export", "optimize"),
        "build one variant of the optimized model",
        per_variant=True,
        on_device=True,
        searched=True,
        function="graphtrim.stages.quantize:quantize",
        record="graphtrim.stages.records:QuantizeRecord",
    ),
    Stage(
        "validate",
        ("export", "quantize"),
        "measure one variant against the gates on its worker class",
        per_variant=True,
        on_device=True,
        function="graphtrim.stages.validate:validate",
        record="graphtrim.stages.records:ValidateRecord",
    ),
    Stage(
        "register",
        ("export", "optimize", "validate"),
        "register the variants that passed, with lineage",
        writes_registry=True,
        takes=("optimize", "validate"),
        function="graphtrim.stages.register:register",
        record="graphtrim.stages.records:RegisterRecord",
    ),
    Stage(
        "promote",
        ("export", "validate", "register"),
        "move aliases by the promotion policy",
        writes_registry=True,
        takes=("validate", "register"),
        function="graphtrim.stages.promote:promote",
        record="graphtrim.stages.records:PromoteRecord",
    ),
)

STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)


def stage(name: str) -> Stage:
    """The stage called ``name``."""
    for s in STAGES:
        if s.name == name:
            return s
    raise KeyError(f"unknown stage '{name}'; stages: {', '.join(STAGE_NAMES)}")


def record_arg(stage_name: str) -> str:
    """The argument that carries the record of the stage ``stage_name`` to later stages, in
    every orchestrator (export -> ``exported``, validate -> ``validated``): a new stage needs no
    entry anywhere."""
    return stage_name + ("d" if stage_name.endswith("e") else "ed")


def variant_loops(stages: Sequence[Stage]) -> dict[str, int]:
    """The loop over variants each per-variant stage runs in, by stage name: one loop per run of
    consecutive per-variant stages, numbered from 0 (a mapped chain in Airflow, a
    ``ParallelFor`` in Kubeflow)."""
    out: dict[str, int] = {}
    loop = -1
    previous = False
    for s in stages:
        if s.per_variant:
            loop += 0 if previous else 1
            out[s.name] = loop
        previous = s.per_variant
    return out
