"""The error hierarchy of graphtrim: one root, a few named kinds.

Orchestrator adapters let these propagate; the CLI maps them to exit codes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar


class GraphtrimError(Exception):
    """Root of every error graphtrim raises on purpose.

    ``transient`` says whether trying again may succeed (a service unreachable or answering
    5xx): orchestrators retry those and fail the others at once (a missing model version will
    not appear by retrying)."""

    transient: bool = False


E = TypeVar("E", bound=GraphtrimError)


def transient(exc: E) -> E:
    """Mark ``exc`` as worth a retry."""
    exc.transient = True
    return exc


def first_line(exc: BaseException) -> str:
    """The first line of what ``exc`` says, or its class name when it says nothing."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class InvalidModelError(GraphtrimError):
    """The input is not a usable ONNX model (corrupt, truncated, unsafe external data, ...)."""

    @classmethod
    def at(cls, path: object, reason: str) -> InvalidModelError:
        return cls(f"{path}: {reason}")


class PassFailure(GraphtrimError):
    """A pass raised while rewriting the graph."""

    def __init__(self, pass_name: str, passes_before: Sequence[str], cause: BaseException):
        self.pass_name = pass_name
        self.passes_before = list(passes_before)
        before = ", ".join(self.passes_before[-8:]) or "none"
        super().__init__(
            f"pass '{pass_name}' failed: {type(cause).__name__}: {cause} (passes run before it: {before})"
        )


class VerificationError(GraphtrimError):
    """The optimized model does not compute what the original computes (it was run and differs,
    or it fails to load or run where the original does)."""

    def __init__(
        self,
        message: str,
        *,
        pass_name: str | None = None,
        rules: Mapping[str, int] | None = None,
        passes_before: Sequence[str] = (),
        record: Any = None,
    ):
        self.pass_name = pass_name
        self.rules = dict(rules or {})
        self.passes_before = list(passes_before)
        self.record = record
        super().__init__(message)


class VerificationUnavailable(GraphtrimError):
    """Nothing could be compared: the reference model cannot be loaded or run in onnxruntime
    (an op or opset it lacks, a custom domain, ...) or no inputs can be made for it. Not a
    difference: the message says why, and the model may still be optimized without verifying."""
