"""Examples of the ``cse`` rules."""

from __future__ import annotations

from tests.optimizer_core.graph.rule_examples import Example
from tests.optimizer_core.graph.rule_examples._build import model

VALUES = "{1.0, 2.0, 3.0, 4.0}"

EXAMPLES: dict[tuple[str, str], Example] = {
    ("cse", "duplicate-initializer"): Example(
        model=model(
            "a = Add(xin, c1)\n y = Mul(a, c2)",
            inits=f"float[4] c1 = {VALUES}, float[4] c2 = {VALUES}",
        ),
    ),
    ("cse", "duplicate-node"): Example(
        model=model("a = Relu(xin)\n b = Relu(xin)\n y = Add(a, b)")
    ),
    ("cse", "duplicate-constant"): Example(
        model=model(
            f"c1 = Constant<value = float[4] {VALUES}>()\n c2 = Constant<value = float[4] {VALUES}>()\n"
            " a = Add(xin, c1)\n y = Mul(a, c2)"
        ),
    ),
}
