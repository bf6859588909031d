"""Gates that decide whether a variant may be registered: accuracy, latency and size.

Thresholds come from a declarative policy (``GatePolicy``); every result records the hardware
and software it was measured on. Gates fail closed.
"""

from graphtrim.gates.evaluate import evaluate
from graphtrim.gates.policy import GatePolicy, PolicyError
from graphtrim.gates.verdicts import Evaluation, GateResult, VariantResult

__all__ = [
    "Evaluation",
    "GatePolicy",
    "GateResult",
    "PolicyError",
    "VariantResult",
    "evaluate",
]
