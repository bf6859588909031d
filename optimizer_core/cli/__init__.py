"""The ``graphtrim`` command line: one module per command group (``graph``: optimize, verify,
passes; ``variants``: quantize, evaluate, variants, report; ``pipeline``: pipeline, promote,
rollback, trigger), ``main`` for the parser and the exit codes (``exits``). Adapters add their
own commands through the ``graphtrim.commands`` entry point group."""

from optimizer_core.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
