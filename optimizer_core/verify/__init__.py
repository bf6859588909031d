"""Numerical verification of optimized models."""

from graphtrim.verify.compare import (
    EQUAL,
    MISMATCH,
    UNVERIFIABLE,
    Session,
    Tolerance,
    VerificationRecord,
    compare_outputs,
    declared_input_specs,
    make_inputs,
    verify,
    verify_isolated,
)
from graphtrim.verify.instrument import VerifyEachPass
from graphtrim.verify.nondeterminism import RANDOM_OPS, random_outputs

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
    "declared_input_specs",
    "make_inputs",
    "random_outputs",
    "verify",
    "verify_isolated",
]
