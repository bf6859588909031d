"""The ``graphtrim`` command line.

Exit codes: 0 success, 1 the optimized model was run and its results differ (or a variant failed a
gate), 2 bad input or arguments, or a model that cannot be verified (the reference does not run in
onnxruntime), 3 a pass failed (a bug: the message names the pass).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from graphtrim import __version__
from graphtrim.cli.exits import EXIT_BAD_INPUT, EXIT_MISMATCH, EXIT_OK, EXIT_PASS_FAILURE
from graphtrim.errors import (
    GraphtrimError,
    InvalidModelError,
    PassFailure,
    VerificationError,
    VerificationUnavailable,
)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command; with ``argv``, the parser for that command line: where it
    names a command of the core, the adapters' commands (entry points) are left out, since
    parsing it never reaches them."""
    from graphtrim.cli import (
        graph_commands,
        pipeline_commands,
        registry_commands,
        tune_commands,
        variant_commands,
    )
    from graphtrim.cli.argtypes import Parser

    parser = Parser(
        prog="graphtrim",
        description="Remove redundant nodes from ONNX models without changing their results.",
    )
    parser.add_argument("--version", action="version", version=f"graphtrim {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # each command group adds its commands with their handler (``set_defaults(handler=...)``)
    for group in (
        graph_commands,
        variant_commands,
        tune_commands,
        pipeline_commands,
        registry_commands,
    ):
        group.add_parsers(sub)
    if argv and argv[0] in sub.choices:
        return parser
    for name, handler in _extensions(sub).items():
        sub.choices[name].set_defaults(handler=handler)
    return parser


def _extensions(sub: Any) -> dict[str, Any]:
    """Commands contributed by installed adapters (entry point group ``graphtrim.commands``):
    the core names no orchestrator, an adapter adds its own commands."""
    from importlib import metadata

    handlers: dict[str, Any] = {}
    for ep in metadata.entry_points(group="graphtrim.commands"):
        try:
            register = ep.load()
        except ImportError as exc:  # its optional dependency is absent: the command is too
            logging.getLogger("graphtrim").debug("command %s unavailable: %s", ep.name, exc)
            continue
        handlers.update(register(sub))
    return handlers


# the extra that installs each optional library a command may import
EXTRAS = {
    "mlflow": "pipeline",
    "boto3": "pipeline",
    "botocore": "pipeline",
    "requests": "pipeline",
    "onnxruntime": "cpu",  # or gpu: the CUDA build
    "torch": "export",
    "onnxscript": "export",
    "airflow": "airflow",
    "airflow_client": "airflow-client",
    "kfp": "kubeflow",
    "kubernetes": "airflow",
    "matplotlib": "reports",
}


def main(argv: Sequence[str] | None = None) -> int:
    from graphtrim import lazy_sympy

    lazy_sympy.install()  # onnx_ir without sympy until a symbolic dim needs it
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="graphtrim: %(levelname)s: %(message)s")
    with _process_state_restored():
        return _run(args)


@contextlib.contextmanager
def _process_state_restored() -> Iterator[None]:
    """A command may change process-wide state for its own run: ``-q`` lowers loggers' levels,
    ignores warnings and sets MLflow's printing switches in the environment. Called as a
    function (``main([...])`` from Python), the caller gets its own state back afterwards."""
    loggers = [
        logging.getLogger(),
        *(
            lg
            for lg in logging.Logger.manager.loggerDict.values()
            if isinstance(lg, logging.Logger)
        ),
    ]
    levels = [(lg, lg.level) for lg in loggers]
    environ = dict(os.environ)
    with warnings.catch_warnings():
        try:
            yield
        finally:
            for lg, level in levels:
                lg.setLevel(level)
            for key in set(os.environ) - set(environ):
                del os.environ[key]
            for key, value in environ.items():
                if os.environ.get(key) != value:
                    os.environ[key] = value


def _run(args: argparse.Namespace) -> int:
    """The command's handler, its errors mapped to the exit-code contract."""
    handler = args.handler
    try:
        return handler(args)
    except VerificationError as exc:  # the optimized model ran and differs
        _error_line("verification failed", exc)
        return EXIT_MISMATCH
    except VerificationUnavailable as exc:  # nothing could be compared: not a difference
        _error_line("error", exc)
        return EXIT_BAD_INPUT
    except InvalidModelError as exc:
        _error_line("error", exc)
        return EXIT_BAD_INPUT
    except PassFailure as exc:
        _error_line("internal error", exc)
        return EXIT_PASS_FAILURE
    except GraphtrimError as exc:
        _error_line("error", exc)
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        # the reader went away (``graphtrim passes --rules | head``): not an error of the
        # command; stdout goes to /dev/null so the interpreter's final flush cannot fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except ModuleNotFoundError as exc:  # an optional dependency absent: name the extra
        extra = EXTRAS.get((exc.name or "").partition(".")[0])
        if extra is None:
            return _internal_error(exc)
        hint = f"pip install 'graphtrim[{extra}]'"
        if extra == "cpu":
            hint += " (or 'graphtrim[gpu]' for onnxruntime's CUDA build)"
        _error_line("error", f"graphtrim {args.command} needs {exc.name}, not installed: {hint}")
        return EXIT_BAD_INPUT
    except OSError as exc:  # unwritable output, disk full, ...: one line, not a traceback
        _error_line("error", exc)
        return EXIT_BAD_INPUT
    except Exception as exc:  # a defect of graphtrim: one line and its own exit code, never 1
        return _internal_error(exc)


def _internal_error(exc: BaseException) -> int:
    """A defect of graphtrim: one line (the traceback at debug level) and its own exit code."""
    logging.getLogger("graphtrim").debug("internal error", exc_info=exc)
    _error_line("internal error", f"{type(exc).__name__}: {exc}")
    return EXIT_PASS_FAILURE


def _error_line(kind: str, exc: BaseException | str) -> None:
    """``graphtrim: KIND: message`` on one line of stderr (onnxruntime's messages span several),
    credentials masked."""
    from graphtrim.redact import redact

    print(f"graphtrim: {kind}: {' '.join(redact(str(exc)).split())}", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
