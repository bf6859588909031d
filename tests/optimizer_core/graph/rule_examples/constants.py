"""Example of the ``lift-constants`` rule."""

from __future__ import annotations

from tests.optimizer_core.graph.rule_examples import Example
from tests.optimizer_core.graph.rule_examples._build import model

EXAMPLES: dict[tuple[str, str], Example] = {
    ("lift-constants", "constant-to-initializer"): Example(
        model=model("c = Constant<value = float[4] {1.0, 2.0, 3.0, 4.0}>()\n y = Add(xin, c)"),
    ),
}
