"""argparse ``type=`` functions shared by the commands: a count must be a count, a tolerance
finite, a timeout positive. A bad value is argparse's own one-line error and exit 2."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, overload


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default where it tells something: not for a required
    option, a flag, a default of None (the help says what happens then), nor a help text that
    already states its default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "%(default)" in text or "default" in text.lower():
            return text
        if action.required or action.default in (None, False, argparse.SUPPRESS, [], ()):
            return text
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, "*"):
            return text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """graphtrim's parsers: :class:`HelpFormatter` unless told otherwise, inherited by the
    sub-command parsers (``add_subparsers`` makes them of the parent's class)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]


def add_command_group(
    sub: Any,
    name: str,
    dest: str,
    *,
    help: str,
    description: str,
    metavar: str = "SUBCOMMAND",
    **defaults: Any,
) -> Any:
    """Add command ``name`` to ``sub``, one of whose sub-commands must be named (it lands in
    ``args.<dest>``); ``defaults`` are the command's ``set_defaults``. Returns its sub-parsers
    (``add_parser`` adds a sub-command)."""
    group = sub.add_parser(name, help=help, description=description)
    if defaults:
        group.set_defaults(**defaults)
    return group.add_subparsers(dest=dest, required=True, metavar=metavar)


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse ``type=``: an integer of at least 1 (a count of trials, attempts, threads)."""
    return _int_at_least(text, 1)


def nonneg_int(text: str) -> int:
    """argparse ``type=``: an integer of at least 0."""
    return _int_at_least(text, 0)


def finite_nonneg_float(text: str) -> float:
    """argparse ``type=``: a finite number of at least 0 (a tolerance); nan and inf refused."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    """argparse ``type=``: a number from 0 to 1 (a share of something)."""
    value = finite_nonneg_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must lie between 0 and 1, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse ``type=``: a finite number greater than 0 (a timeout, an interval)."""
    value = finite_nonneg_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text!r}")
    return value


def duration(text: str) -> float:
    """argparse ``type=``: a positive duration in seconds: ``600``, ``90s``, ``10m``, ``1h30m``."""
    import re

    t = text.strip().lower()
    parts = re.fullmatch(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?", t)
    if not t or parts is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 600, 90s, 10m, 1h30m)")
    h, m, sec = (float(x) if x else 0.0 for x in parts.groups())
    seconds = h * 3600 + m * 60 + sec
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return seconds


def tune_budget(value: object) -> float | None:
    """A settings search's budget (``--tune``, an orchestrator's ``tune`` parameter): a
    :func:`duration`, or none for no search (``None``, ``""``, ``"0"``, ``0``: an empty
    parameter)."""
    if value is None or str(value).strip() in ("", "0"):
        return None
    return duration(str(value))


def opset_arg(value: object) -> int | None:
    """An opset to raise a model to (``--opset``, an orchestrator's ``opset`` parameter): a
    whole number, or none (``None``, ``""``: an empty parameter)."""
    if value is None or str(value).strip() == "":
        return None
    try:
        return int(str(value).strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an opset number: {value!r}") from exc


def csv(text: str) -> list[str]:
    """argparse ``type=``: ``a,b,c``, or a JSON list (what orchestrators render a list parameter
    as)."""
    if text.strip().startswith("["):
        try:
            return [str(t) for t in json.loads(text)]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {text!r}") from exc
    return [t.strip() for t in text.split(",") if t.strip()]


class LazyChoices(Sequence[str]):
    """An argument's ``choices``, computed by ``load`` when argparse first uses them (to check
    a value or to write the help), so that building the parser imports no model library.

    argparse reads ``choices`` while adding the argument (to check its metavar), so they are
    set on the action it returns: ``lazy_choices(p.add_argument(...), load)``."""

    def __init__(self, load: Callable[[], Iterable[str]]) -> None:
        self._load = load
        self._items: tuple[str, ...] | None = None

    def _names(self) -> tuple[str, ...]:
        if self._items is None:
            self._items = tuple(self._load())
        return self._items

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[str]: ...

    def __getitem__(self, index: int | slice) -> str | Sequence[str]:
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, value: object) -> bool:
        return value in self._names()

    def __repr__(self) -> str:
        return repr(list(self._names()))


def lazy_choices(action: argparse.Action, load: Callable[[], Iterable[str]]) -> None:
    """Give ``action`` the choices ``load()`` returns, read on first use (:class:`LazyChoices`)."""
    action.choices = LazyChoices(load)


def literal_names(module: str, name: str) -> list[str]:
    """The names in ``module``'s top-level ``name`` (the keys of a dict, the items of a tuple or
    list), read from the module's source where they are written there as a literal of strings:
    the choices of ``--preset`` are shown without importing the passes, onnx_ir and numpy. Where
    they are not such a literal, or the module is imported already, from the module."""
    loaded = sys.modules.get(module)
    if loaded is None:
        found = _source_literal(module, name)
        if found is not None:
            return found
        loaded = importlib.import_module(module)
    return [str(n) for n in getattr(loaded, name)]


_MUTATORS = {"update", "setdefault", "pop", "popitem", "clear", "append", "extend", "insert"}


def _source_literal(module: str, name: str) -> list[str] | None:
    """``name``'s literal in ``module``'s source; None where the module binds ``name`` more
    than once or changes it in place (the literal would not be what the module ends with)."""
    try:
        spec = importlib.util.find_spec(module)
        get_source = getattr(spec.loader, "get_source", None) if spec is not None else None
        source = get_source(module) if get_source is not None else None
        tree = ast.parse(source) if source is not None else None
    except (ImportError, OSError, SyntaxError, ValueError):
        return None
    if tree is None:
        return None
    literal: ast.expr | None = None
    bindings = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == name and not isinstance(node.ctx, ast.Load):
            bindings += 1
        elif isinstance(node, (ast.Subscript, ast.Attribute)) and (
            isinstance(node.value, ast.Name) and node.value.id == name
        ):
            changed = not isinstance(node.ctx, ast.Load) or (
                isinstance(node, ast.Attribute) and node.attr in _MUTATORS
            )
            if changed:
                return None
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.target.id == name:
                literal = node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id == name:
                literal = node.value
    if bindings != 1:
        return None
    if isinstance(literal, ast.Dict):
        items: list[ast.expr | None] = list(literal.keys)
    elif isinstance(literal, (ast.Tuple, ast.List)):
        items = list(literal.elts)
    else:
        return None
    names = [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]
    return names if len(names) == len(items) else None
