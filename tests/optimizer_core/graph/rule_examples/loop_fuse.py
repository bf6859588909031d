"""Examples of the rules of pass ``loop-fuse``."""

from __future__ import annotations

import onnx

from tests.helpers import parse
from tests.optimizer_core.graph.rule_examples import Example


def _two_loops() -> onnx.ModelProto:
    return parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x, float[4] v) => (float[4] y, float[4] z) {
          n = Constant<value = int64 {20}>()
          y = Loop(n, , x) <
            body = b (int64 i, bool ci, float[4] acc) => (bool co, float[4] acc_out) {
              a = Mul(acc, v)
              acc_out = Neg(a)
              co = Identity(ci)
            }
          >
          z = Loop(n, , v) <
            body = b (int64 i, bool ci, float[4] acc) => (bool co, float[4] acc_out) {
              s = Sin(acc)
              acc_out = Add(s, x)
              co = Identity(ci)
            }
          >
        }
        """
    )


EXAMPLES = {
    ("loop-fuse", "loop-fuse"): Example(model=_two_loops),
}
