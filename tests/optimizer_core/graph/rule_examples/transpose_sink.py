"""Example of the ``transpose-sink`` rule: a channels-last block between two Transposes."""

from __future__ import annotations

from tests.optimizer_core.graph.rule_examples import Example
from tests.optimizer_core.graph.test_transpose_sink import KERAS_BLOCK, _model

EXAMPLES: dict[tuple[str, str], Example] = {
    ("transpose-sink", "transpose-sink"): Example(
        model=lambda: _model(KERAS_BLOCK, "(float[2, 4, 6, 6] x) => (float[2, 4, 8, 8] y)"),
    ),
}
