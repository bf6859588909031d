"""Numerical verification of optimized models."""

from graphtrim.verify.compare import verify, verify_isolated
from graphtrim.verify.inputs import declared_input_specs, make_inputs
from graphtrim.verify.instrument import VerifyEachPass
from graphtrim.verify.nondeterminism import RANDOM_OPS, random_outputs
from graphtrim.verify.outputs import compare_outputs
from graphtrim.verify.records import EQUAL, MISMATCH, UNVERIFIABLE, Tolerance, VerificationRecord
from graphtrim.verify.session import Session

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
