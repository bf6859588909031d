"""Example of the ``reshape-infer`` rule: tf2onnx's run-time batch dim in a Reshape target."""

from __future__ import annotations

from tests.optimizer_core.graph.rule_examples import Example
from tests.optimizer_core.graph.test_reshape_infer import INITS, TF_SHAPE, _model

EXAMPLES: dict[tuple[str, str], Example] = {
    ("reshape-infer", "reshape-one-unknown"): Example(
        model=lambda: _model(TF_SHAPE, "(float[N, 4, 12] x) => (float[N, 6, 8] y)", INITS),
    ),
}
