"""The ``graphtrim`` command line: one module per command group (``graph_commands``: optimize,
verify, passes; ``variant_commands``: quantize, evaluate, variants, report; ``pipeline_commands``:
pipeline, promote, rollback), ``main`` for the parser and the error handling, ``exits`` for the
exit codes. Adapters add their own commands (``trigger``, ``kfp``) through the
``graphtrim.commands`` entry point group."""

from graphtrim.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
