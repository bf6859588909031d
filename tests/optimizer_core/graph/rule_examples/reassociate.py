"""Examples of the ``reassociate`` rules (they round differently: compared within a few ulps)."""

from __future__ import annotations

from tests.optimizer_core.graph.rule_examples import Example
from tests.optimizer_core.graph.rule_examples._build import model

CONSTANTS = "float[4] c1 = {2.0, 3.0, 0.5, 1.5}, float[4] c2 = {0.25, 1.5, 3.0, -2.0}"
RTOL, ATOL = 1e-5, 1e-6

EXAMPLES: dict[tuple[str, str], Example] = {
    ("reassociate", "mul-chain"): Example(
        model=model("a = Mul(xin, c1)\n y = Mul(a, c2)", inits=CONSTANTS), rtol=RTOL, atol=ATOL
    ),
    ("reassociate", "add-chain"): Example(
        model=model("a = Add(c1, xin)\n y = Add(a, c2)", inits=CONSTANTS), rtol=RTOL, atol=ATOL
    ),
    ("reassociate", "reciprocal-reciprocal"): Example(
        model=model("a = Reciprocal(xin)\n b = Reciprocal(a)\n y = Relu(b)"), rtol=RTOL, atol=ATOL
    ),
}
