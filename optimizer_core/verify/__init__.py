"""Numerical verification of optimized models."""

from optimizer_core.verify.compare import (
    EQUAL,
    MISMATCH,
    UNVERIFIABLE,
    Session,
    Tolerance,
    VerificationRecord,
    compare_outputs,
    make_inputs,
    verify,
)
from optimizer_core.verify.instrument import VerifyEachPass
from optimizer_core.verify.nondeterminism import RANDOM_OPS, random_outputs

__all__ = [
    "EQUAL",
    "MISMATCH",
    "RANDOM_OPS",
    "UNVERIFIABLE",
    "Session",
    "Tolerance",
    "VerificationRecord",
    "VerifyEachPass",
    "compare_outputs",
    "make_inputs",
    "random_outputs",
    "verify",
]
