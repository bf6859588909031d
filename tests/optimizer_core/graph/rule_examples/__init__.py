"""One example model per rewrite rule.

Each module here (one per pass, named after it) defines ``EXAMPLES``: a mapping from
``(pass name, rule name)`` to an :class:`Example`. ``test_rules.py`` checks that every rule in the
passes' tables has an example, that the example fires that rule and that the rewritten model
computes what the original does.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable, Sequence
from typing import Any

import onnx


@dataclasses.dataclass(frozen=True)
class Example:
    """A model on which a rule fires.

    Attributes:
        model: builds the model.
        passes: the passes to run (default: the rule's pass alone).
        options: ``OptimizeOptions`` keyword arguments.
        rtol / atol: tolerance of the comparison with the original: exact by default; an
            inexact rule (a fusion, a reassociation) rounds differently.
        compare: run both models and compare outputs (off only where onnxruntime cannot run
            the original, which the example's docstring then says).
    """

    model: Callable[[], onnx.ModelProto]
    passes: Sequence[str] | None = None
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    rtol: float = 0.0
    atol: float = 0.0
    compare: bool = True


def all_examples() -> dict[tuple[str, str], Example]:
    """Every module's ``EXAMPLES``, merged; a key defined twice is an error."""
    out: dict[tuple[str, str], Example] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for key, example in getattr(module, "EXAMPLES", {}).items():
            assert key not in out, f"{key} has two examples"
            out[key] = example
    return out
