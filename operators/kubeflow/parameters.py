"""The pipeline's parameters: each row of the run-parameter table (:mod:`graphtrim.run_params`)
that Kubeflow takes, as a parameter of the pipeline and its components and the
``graphtrim pipeline stage`` option it is passed as."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from graphtrim import run_params


@dataclasses.dataclass(frozen=True)
class RunParameter:
    """A parameter of a pipeline run and the ``graphtrim pipeline stage`` option it is passed as.

    Attributes:
        name: the pipeline (and component) parameter.
        flag: the command-line option.
        type: its KFP type (``str`` or ``list``).
        default: its default for a run; none: the run must give it.
    """

    name: str
    flag: str
    type: type
    default: Any = inspect.Parameter.empty

    def parameter(self, *, with_default: bool = True) -> inspect.Parameter:
        """This parameter in a function signature (a component's have no defaults: the
        pipeline passes them all)."""
        return inspect.Parameter(
            self.name,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            annotation=self.type,
            default=self.default if with_default else inspect.Parameter.empty,
        )


def _from_table(row: run_params.RunParam) -> RunParameter:
    """A row of the run-parameter table as this pipeline's parameter: a list stays a list and
    a boolean a boolean; everything else travels as a string, "" (or ``{}`` for a JSON
    document) standing for none."""
    kind: type = {"array": list, "boolean": bool}.get(row.type, str)
    default = row.default_value()
    if default is run_params.REQUIRED:
        return RunParameter(row.name, row.flag, kind)
    if default is None:
        default = "{}" if row.type == "object" else ""
    elif kind is str:
        default = str(default)
    return RunParameter(row.name, row.flag, kind, default)


MODEL = _from_table(run_params.BY_NAME["model_uri"])
"""The source model, read by the stage without inputs (export)."""


CONFIG: tuple[RunParameter, ...] = tuple(
    _from_table(p)
    for p in sorted(run_params.on("kfp"), key=lambda p: p.into != "location")
    if p.into != "source"
)
"""The run's configuration, passed to every step: the pipeline's parameters after ``model_uri``
and every step's options, the run-parameter table's (:data:`graphtrim.run_params.RUN_PARAMS`)
with the locations first."""


VARIANTS = next(p for p in CONFIG if p.name == "variants")
"""The variants to build: the per-variant steps run once for each (``ParallelFor``)."""


ONLY = RunParameter("variant", "--only", str)
"""The variant a per-variant step builds: the ``ParallelFor``'s item."""


TUNED = RunParameter("tuned", "--tuned", str)
"""The settings search a searched stage's step judges: the last tune select's ``search``."""
