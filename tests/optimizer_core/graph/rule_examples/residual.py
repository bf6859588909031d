"""Examples of the ``residual-sum`` and ``residual-add`` rules: a residual Add (Sum) read by a
LayerNormalization."""

from __future__ import annotations

from tests.optimizer_core.graph.rule_examples import Example
from tests.optimizer_core.graph.rule_examples._build import model

EXAMPLES: dict[tuple[str, str], Example] = {
    ("residual-sum", "residual-sum"): Example(
        model=model(
            "h = Relu(xin)\n s = Add(xin, h)\n y = LayerNormalization<axis = -1>(s, g)",
            inits="float[4] g = {1.0, 0.5, 2.0, 1.5}",
        ),
    ),
    ("residual-add", "residual-add"): Example(
        model=model(
            "h = Relu(xin)\n s = Sum(xin, h)\n y = LayerNormalization<axis = -1>(s, g)",
            inits="float[4] g = {1.0, 0.5, 2.0, 1.5}",
        ),
    ),
}
