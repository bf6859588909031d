"""The options of ``graphtrim pipeline run|stage|tune``: one per run parameter of
:mod:`graphtrim.run_params` (the same table the orchestrators' parameters come from), then the
command's own."""

from __future__ import annotations

import argparse
import os
from typing import Any

from graphtrim.cli.argtypes import csv as _csv
from graphtrim.cli.argtypes import (
    lazy_choices,
    literal_names,
    opset_arg,
    positive_float,
    tune_budget,
)
from graphtrim.cli.variant_args import add_weight_args

# the defaults the command line falls back on where a run parameter's environment variable is
# unset (an orchestrator always passes them)
_CLI_FALLBACK = {"artifacts": "graphtrim-artifacts"}


_METAVARS = {"integer": "N", "object": "JSON", "duration": "DURATION"}


def _add_run_param(p: Any, row: Any) -> None:
    """The ``graphtrim pipeline`` option of a run parameter (``graphtrim.run_params``)."""
    from graphtrim.run_params import REQUIRED, Names, parse_flag

    help_text = row.help
    kwargs: dict[str, Any] = {}
    default = row.default
    if row.type == "boolean":
        if default:  # on unless turned off: --no-NAME
            p.add_argument(row.flag, action="store_true", help=help_text)
            return
        # --NAME alone, or --NAME true|false (what an orchestrator renders a boolean as)
        kwargs |= {"nargs": "?", "const": True, "type": parse_flag, "metavar": "BOOL"}
    elif row.type == "array":
        kwargs["type"] = _csv
        help_text = f"{help_text}, comma-separated"
    elif row.type == "integer":
        kwargs["type"] = opset_arg
    elif row.type == "duration":
        kwargs["type"] = tune_budget
    if row.type in _METAVARS:
        kwargs["metavar"] = _METAVARS[row.type]
    if default is REQUIRED:
        default = None
        if row.env:
            default = os.environ.get(row.env, _CLI_FALLBACK.get(row.name))
            fallback = _CLI_FALLBACK.get(row.name)
            help_text += f" (default: ${row.env}" + (f", else {fallback})" if fallback else ")")
    elif row.env:
        default = os.environ.get(row.env, default)
        help_text += f" (default: ${row.env})"
    if isinstance(default, Names):
        default = default.load()
    if isinstance(row.choices, Names):
        names = row.choices
        if row.type == "array":
            help_text = f"{help_text}: {', '.join(names.load())}"
        else:
            action = p.add_argument(row.flag, default=default, help=help_text, **kwargs)
            lazy_choices(action, lambda: sorted(literal_names(names.module, names.name)))
            return
    elif row.choices:
        kwargs["choices"] = row.choices
    p.add_argument(row.flag, default=default, help=help_text, **kwargs)


def _add_pipeline_args(p: argparse.ArgumentParser) -> None:
    """The run parameters (``graphtrim.run_params``, the model aside: ``run`` and ``stage``
    take it each in their way), then the options of the command itself."""
    from graphtrim.run_params import on

    for row in on("cli"):
        if row.into == "source":
            continue
        if row.name == "policy":
            policy = p.add_mutually_exclusive_group()
            policy.add_argument(
                "--policy",
                metavar="GATES.yaml",
                help="gate and promotion policy file (default: the file $GRAPHTRIM_POLICY "
                "names, else the built-in policy)",
            )
            _add_run_param(policy, row)
            continue
        if row.name == "weights":
            add_weight_args(p)  # the same settings as flags, not with the JSON
        _add_run_param(p, row)
    p.add_argument("--workdir", help="scratch folder (default: the system's temporary folder)")
    p.add_argument(
        "--orchestrator-run-id",
        help="the orchestrator's run id, recorded in the lineage; a retry with the same id "
        "logs into the same MLflow run",
    )
    p.add_argument(
        "--child-timeout",
        type=positive_float,
        default=1800.0,
        metavar="SECONDS",
        help="limit for one variant's build or gates, each run in a child process (a crash "
        "or a hang there fails that variant only)",
    )
    p.add_argument(
        "-q", "--quiet", action="store_true", help="no progress lines, only the result table"
    )
