"""Pipeline stages: one module per stage, each a function from typed input records to a typed,
JSON-serializable output record. ``STAGES`` is the one place that lists them, in order; the CLI's
``graphtrim pipeline stage``, the Airflow operators and the Kubeflow steps are derived from it.
"""

from __future__ import annotations

import dataclasses


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
    """

    name: str
    inputs: tuple[str, ...]
    summary: str
    per_variant: bool = False
    on_device: bool = False
    writes_registry: bool = False


STAGES: tuple[Stage, ...] = (
    Stage("export", (), "resolve the registry version and export it to ONNX"),
    Stage("optimize", ("export",), "optimize the exported graph, verified against it"),
    Stage(
        "quantize",
        ("export", "optimize"),
        "build one variant of the optimized model",
        per_variant=True,
        on_device=True,
    ),
    Stage(
        "validate",
        ("export", "quantize"),
        "measure one variant against the gates on its worker class",
        per_variant=True,
        on_device=True,
    ),
    Stage(
        "register",
        ("export", "optimize", "validate"),
        "register the variants that passed, with lineage",
        writes_registry=True,
    ),
    Stage(
        "promote",
        ("export", "validate", "register"),
        "move aliases by the promotion policy",
        writes_registry=True,
    ),
)

STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)


def stage(name: str) -> Stage:
    """The stage called ``name``."""
    for s in STAGES:
        if s.name == name:
            return s
    raise KeyError(f"unknown stage '{name}'; stages: {', '.join(STAGE_NAMES)}")
