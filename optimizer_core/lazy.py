"""Module attributes imported when first asked for (PEP 562)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(module: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that gives each name of ``where`` from the module named beside
    it, imported on first use: for names a package offers without importing their dependencies
    up front, and for names that moved and keep their old import path. Any other name is the
    usual ``AttributeError`` of ``module``."""

    def __getattr__(name: str) -> Any:
        if name in where:
            return getattr(importlib.import_module(where[name]), name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
