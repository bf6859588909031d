"""``onnx_ir`` without importing ``sympy`` until a symbolic dim needs it.

``onnx_ir`` imports ``sympy`` when it is imported (a third of a second, more than the rest of a
small ``graphtrim optimize``), but uses it only for arithmetic on symbolic dims
(``ir.SymbolicDim("N") + 1``, ``evaluate``, ``simplify``), which the optimizer never does.
:func:`install` puts a finder first on ``sys.meta_path`` that intercepts the first import of
``onnx_ir``: while its package runs, ``sys.modules`` holds a stand-in for ``sympy`` and for
``onnx_ir._symbolic_shapes`` (which reads ``sympy.Max`` and the like when imported), so those
names in ``onnx_ir._core`` are bound to the stand-ins. Once ``onnx_ir`` is imported the
stand-ins leave ``sys.modules`` and the finder leaves ``sys.meta_path``: every later
``import sympy`` is an ordinary import of the real package.

A stand-in imports its real module when any attribute of it is read (``sympy.Expr``,
``sympy.sympify``, ``_symbolic_shapes.parse_symbolic_expression``) and from then on forwards
every attribute read to it: ``isinstance(x, sympy.Expr)`` tests against the real class and the
results are the real module's objects.
"""

from __future__ import annotations

import importlib
import sys
import threading
import types
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec

# the modules ``onnx_ir`` gets stand-ins for while it is imported
DEFERRED = ("sympy", "onnx_ir._symbolic_shapes")

_lock = threading.RLock()


class _StandIn(types.ModuleType):
    """A module that imports the module of its name when one of its attributes is read and
    hands out that module's attributes."""

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._real(), attr)

    def _real(self) -> types.ModuleType:
        real = self.__dict__.get("_standin_real")
        if real is None:
            with _lock:
                real = self.__dict__.get("_standin_real")
                if real is None:
                    name = self.__dict__["__name__"]
                    if sys.modules.get(name) is self:  # read while onnx_ir is being imported
                        del sys.modules[name]
                    real = importlib.import_module(name)
                    self.__dict__["_standin_real"] = real
        return real

    def __dir__(self) -> list[str]:
        return dir(self._real())

    def __repr__(self) -> str:
        return f"<module {self.__name__!r} (imported on first use)>"


# (the loader and the finder are plain classes: ``importlib.abc`` would import
# ``importlib.resources`` and ``tempfile`` at every start)


class _Loader:
    """Runs ``onnx_ir``'s package with the stand-ins in ``sys.modules``."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def create_module(self, spec: ModuleSpec) -> types.ModuleType | None:
        module: types.ModuleType | None = self.real.create_module(spec)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # the module looks as if imported without this loader
        module.__loader__ = self.real
        if module.__spec__ is not None:
            module.__spec__.loader = self.real
        standins = {name: _StandIn(name) for name in DEFERRED if name not in sys.modules}
        sys.modules.update(standins)
        try:
            self.real.exec_module(module)
        finally:
            for name, standin in standins.items():
                if sys.modules.get(name) is standin:
                    del sys.modules[name]
            uninstall()


class _Finder:
    """Finds ``onnx_ir`` with the other finders and gives it :class:`_Loader`; once only."""

    def __init__(self) -> None:
        self.done = False

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> ModuleSpec | None:
        if fullname != "onnx_ir" or self.done:
            return None
        # (``sys.meta_path`` is not changed here: the import system is iterating over it)
        self.done = True
        if "sympy" in sys.modules:  # imported already: nothing to save
            return None
        for finder in list(sys.meta_path):
            find = None if finder is self else getattr(finder, "find_spec", None)
            spec: ModuleSpec | None = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = cast("Loader", _Loader(spec.loader))
                return spec
        return None


def install() -> None:
    """Defer ``sympy`` in the ``onnx_ir`` imported next. Nothing changes where ``onnx_ir`` or
    ``sympy`` is imported already; installing twice installs once."""
    if "onnx_ir" in sys.modules or "sympy" in sys.modules:
        return
    with _lock:
        if not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())


def uninstall() -> None:
    with _lock:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
