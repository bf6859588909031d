"""Examples of the rules of pass ``loop-unroll``."""

from __future__ import annotations

import onnx

from tests.helpers import parse
from tests.optimizer_core.graph.rule_examples import Example


def _accumulator() -> onnx.ModelProto:
    return parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y, float[3, 4] s) {
          n = Constant<value = int64 {3}>()
          y, s = Loop(n, , x) <
            body = b (int64 i, bool ci, float[4] acc) => (bool co, float[4] acc_out, float[4] sc) {
              f = Cast<to = 1>(i)
              a = Add(acc, f)
              acc_out = Mul(a, x)
              sc = Sub(acc_out, f)
              co = Identity(ci)
            }
          >
        }
        """
    )


EXAMPLES = {
    ("loop-unroll", "loop-unroll"): Example(model=_accumulator),
}
