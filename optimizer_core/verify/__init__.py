"""Numerical verification of optimized models."""

from optimizer_core.verify.compare import (
    Session,
    Tolerance,
    VerificationRecord,
    compare_outputs,
    make_inputs,
    verify,
)
from optimizer_core.verify.instrument import VerifyEachPass

__all__ = [
    "Session",
    "Tolerance",
    "VerificationRecord",
    "VerifyEachPass",
    "compare_outputs",
    "make_inputs",
    "verify",
]
