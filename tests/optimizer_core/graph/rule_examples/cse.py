"""Examples of the ``cse`` rules."""

from __future__ import annotations

from tests.helpers import parse
from tests.optimizer_core.graph.rule_examples import Example
from tests.optimizer_core.graph.rule_examples._build import model

# the sequence length read from the input and again from an activation of the same dims
SAME_DIM = """
<ir_version: 8, opset_import: ["" : 17]>
g (int64[B, S] ids, float[B, S, 4] h) => (float[B, S, 4] y) <int64 one = {1}> {
    s1 = Shape(ids)
    n1 = Gather<axis = 0>(s1, one)
    s2 = Shape(h)
    n2 = Gather<axis = 0>(s2, one)
    p = Mul(n1, n2)
    f = Cast<to = 1>(p)
    y = Mul(h, f)
}
"""

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
    ("cse", "same-dim-read"): Example(model=lambda: parse(SAME_DIM)),
}
