"""Examples of the ``casts`` rules: a widening to double first, then back or on."""

from __future__ import annotations

from tests.optimizer_core.graph.rule_examples import Example
from tests.optimizer_core.graph.rule_examples._build import model

EXAMPLES: dict[tuple[str, str], Example] = {
    ("casts", "cast-round-trip"): Example(
        model=model("x = Neg(xin)\n a = Cast<to = 11>(x)\n y = Cast<to = 1>(a)"),
    ),
    ("casts", "cast-chain"): Example(
        model=model(
            "x = Neg(xin)\n a = Cast<to = 11>(x)\n y = Cast<to = 6>(a)",
            sig="(float[2, 4] xin) => (int32[2, 4] y)",
        ),
    ),
}
