"""Examples of the rules of pass ``loop-hoist``."""

from __future__ import annotations

import onnx

from tests.helpers import parse
from tests.optimizer_core.graph.rule_examples import Example


def _loop_invariant() -> onnx.ModelProto:
    return parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x, float[4] v) => (float[4] y) {
          n = Constant<value = int64 {40}>()
          y = Loop(n, , x) <
            body = b (int64 i, bool ci, float[4] acc) => (bool co, float[4] acc_out) {
              e = Exp(v)
              f = Cast<to = 1>(i)
              a = Mul(acc, e)
              acc_out = Add(a, f)
              co = Identity(ci)
            }
          >
        }
        """
    )


def _scan_invariant() -> onnx.ModelProto:
    return parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] s0, float[5, 4] xs, float[4] v) => (float[4] last, float[5, 4] ys) {
          last, ys = Scan(s0, xs) <
            num_scan_inputs = 1,
            body = b (float[4] st, float[4] xi) => (float[4] st_out, float[4] yi) {
              nv = Neg(v)
              st_out = Add(st, xi)
              yi = Mul(st_out, nv)
            }
          >
        }
        """
    )


EXAMPLES = {
    ("loop-hoist", "loop-hoist"): Example(model=_loop_invariant),
    ("loop-hoist", "scan-hoist"): Example(model=_scan_invariant),
}
