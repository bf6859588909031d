"""Examples of the ``dead-code`` rules."""

from __future__ import annotations

import onnx

from tests.helpers import parse
from tests.optimizer_core.graph.rule_examples import Example
from tests.optimizer_core.graph.rule_examples._build import model


def _unused_opset() -> onnx.ModelProto:
    return parse(
        """
        <ir_version: 8, opset_import: ["" : 18, "custom.domain" : 1]>
        g (float[2, 4] xin) => (float[2, 4] y) {
          y = Relu(xin)
        }
        """
    )


EXAMPLES: dict[tuple[str, str], Example] = {
    ("dead-code", "dead-node"): Example(model=model("a = Relu(xin)\n b = Neg(xin)\n y = Abs(a)")),
    ("dead-code", "unused-initializer"): Example(
        model=model("y = Relu(xin)", inits="float[4] c = {1.0, 2.0, 3.0, 4.0}")
    ),
    ("dead-code", "unused-opset"): Example(model=_unused_opset),
}
