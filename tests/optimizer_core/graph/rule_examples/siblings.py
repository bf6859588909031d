"""Examples of the ``fuse-siblings`` rules: two MatMuls reading one input (inexact: the merged
product may sum in another order)."""

from __future__ import annotations

from tests.optimizer_core.graph.rule_examples import Example
from tests.optimizer_core.graph.rule_examples._build import model

SIG = "(float[2, 4] xin) => (float[2, 3] y1, float[2, 2] y2)"
WEIGHTS = (
    "float[4, 3] w1 = {0.5, -1.0, 2.0, 1.5, 0.25, -0.5, 1.0, 2.0, -2.0, 0.75, 1.25, -0.25}, "
    "float[4, 2] w2 = {1.0, -0.5, 0.25, 2.0, -1.5, 0.5, 0.75, 1.0}"
)
BIASES = "float[3] b1 = {0.1, 0.2, 0.3}, float[2] b2 = {-0.1, 0.4}"
RTOL, ATOL = 1e-5, 1e-6

EXAMPLES: dict[tuple[str, str], Example] = {
    ("fuse-siblings", "matmul-siblings"): Example(
        model=model("a = Relu(xin)\n y1 = MatMul(a, w1)\n y2 = MatMul(a, w2)", SIG, WEIGHTS),
        rtol=RTOL,
        atol=ATOL,
    ),
    ("fuse-siblings", "matmul-siblings-bias"): Example(
        model=model(
            "a = Relu(xin)\n m1 = MatMul(a, w1)\n m2 = MatMul(a, w2)\n"
            " y1 = Add(m1, b1)\n y2 = Add(b2, m2)",
            SIG,
            f"{WEIGHTS}, {BIASES}",
        ),
        rtol=RTOL,
        atol=ATOL,
    ),
}
