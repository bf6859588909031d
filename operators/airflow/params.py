"""What the DAGs offer in their run parameters, taken from ``optimizer_core``.

The choices of a DAG's ``Param`` (the presets, the variants) are the core's own
(``graphtrim.graph.presets.PRESETS``, ``graphtrim.quantize.VARIANTS``), not a copy
that drifts from them. The scheduler parses DAG files often, and those modules import the graph
passes and quantizers (onnx, numpy): the names are read from the modules' source without
importing them. A module whose table is not a literal there is imported after all (correct,
only slower to parse).
"""

from __future__ import annotations

import ast
import functools
import importlib
import os
from pathlib import Path
from typing import Any

import graphtrim
from graphtrim.run_params import REQUIRED, Names, RunParam, on

_CORE = Path(graphtrim.__file__).resolve().parent


def as_flag(value: Any) -> bool:
    """A boolean operator argument, also when templated (rendered as text: ``"True"``)."""
    return str(value).strip().lower() in ("1", "true", "yes")


def env_flag(value: str | None) -> bool:
    """A boolean from the environment (``1``, ``true``, ``yes``; anything else is false)."""
    return (value or "").lower() in ("1", "true", "yes")


def _literal_names(module: str, name: str) -> list[str] | None:
    """The keys (a dict) or items (a tuple or list) of the top-level literal ``name`` in
    ``module``'s source, or None where it is not such a literal of strings."""
    path = _CORE.joinpath(*module.split(".")[1:]).with_suffix(".py")
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            target, value = node.target.id, node.value
        elif (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        ):
            target, value = node.targets[0].id, node.value
        else:
            continue
        if target != name:
            continue
        if isinstance(value, ast.Dict):
            items: list[Any] = list(value.keys)
        elif isinstance(value, (ast.Tuple, ast.List)):
            items = list(value.elts)
        else:
            return None
        if not all(isinstance(i, ast.Constant) and isinstance(i.value, str) for i in items):
            return None
        return [i.value for i in items]
    return None


@functools.cache
def _names(module: str, name: str) -> tuple[str, ...]:
    found = _literal_names(module, name)
    if found is None:
        found = list(getattr(importlib.import_module(module), name))
    return tuple(found)


def preset_choices() -> list[str]:
    """The names of the optimizer's presets (``graphtrim.graph.presets.PRESETS``), in its
    order: the ``preset`` parameter's choices."""
    return list(_names("graphtrim.graph.presets", "PRESETS"))


def variant_choices() -> list[str]:
    """The variants graphtrim can build (the table ``graphtrim.quantize.kinds``, a module
    that imports nothing heavy)."""
    from graphtrim.quantize.kinds import VARIANTS

    return list(VARIANTS)


def default_variants() -> list[str]:
    """The variants a run builds when it names none."""
    from graphtrim.quantize.kinds import DEFAULT_VARIANTS

    return list(DEFAULT_VARIANTS)


_DAG_TYPES = {"duration": "string"}  # a duration is written as text: 600, 90s, 10m


def dag_param(param: RunParam, device: str) -> tuple[Any, dict[str, Any]]:
    """A run parameter (:mod:`graphtrim.run_params`) as the Param of the optimize DAG for
    ``device``: its default and its schema (type, choices, description). A parameter without a
    default may be null; a location's default is the scheduler's environment
    (``$GRAPHTRIM_ARTIFACTS``); the DAG's device is fixed (each device has its own DAG)."""
    kind = _DAG_TYPES.get(param.type, param.type)
    default = param.default
    if isinstance(default, Names):
        default = list(_names(default.module, default.name))
    schema: dict[str, Any] = {"type": kind}
    if default is None:
        schema["type"] = ["null", kind]
    elif default is REQUIRED:
        default = os.environ.get(param.env, "") if param.env else ""
    if param.choices is not None:
        choices = (
            list(_names(param.choices.module, param.choices.name))
            if isinstance(param.choices, Names)
            else list(param.choices)
        )
        if param.type == "array":
            schema["items"] = {"type": "string", "enum": choices}
        else:
            schema["enum"] = choices
    description = param.help
    if param.name == "device":
        # placement is fixed when the DAG is parsed (queue, pod), so each device has its own
        # DAG; a run asking this one for the other device is refused at trigger time
        other = "graphtrim_optimize_model" if device == "gpu" else "graphtrim_optimize_model_gpu"
        default, schema["enum"] = device, [device]
        description = f"{description}; for the other device use {other}"
    schema["description"] = description
    return default, schema


def dag_params(device: str) -> list[tuple[str, tuple[Any, dict[str, Any]]]]:
    """The optimize DAG's Params for ``device``, in the table's order: each parameter's name,
    default and schema (:func:`dag_param`)."""
    return [(p.name, dag_param(p, device)) for p in on("dag")]
