"""Examples of the ``activations`` rules."""

from __future__ import annotations

from tests.optimizer_core.graph.rule_examples import Example
from tests.optimizer_core.graph.rule_examples._build import model

EXAMPLES: dict[tuple[str, str], Example] = {
    ("activations", "relu-after-non-negative"): Example(
        model=model("a = Relu(xin)\n y = Relu(a)"),
    ),
    ("activations", "clip-after-non-negative"): Example(
        model=model("a = Sigmoid(xin)\n y = Clip(a, lo)", inits="float lo = {0.0}"),
    ),
    ("activations", "relu-into-clip"): Example(
        model=model(
            "a = Relu(xin)\n y = Clip(a, lo, hi)", inits="float lo = {0.0}, float hi = {6.0}"
        ),
    ),
    ("activations", "clip-clip"): Example(
        model=model(
            "a = Clip(xin, l1, h1)\n y = Clip(a, l2, h2)",
            inits="float l1 = {-1.0}, float h1 = {1.0}, float l2 = {-0.5}, float h2 = {2.0}",
        ),
    ),
}
