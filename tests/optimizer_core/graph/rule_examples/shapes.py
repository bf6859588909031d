"""Examples of the ``symbolic-shapes`` rules: shapes computed from the tensors' own dims."""

from __future__ import annotations

from tests.helpers import parse
from tests.optimizer_core.graph.rule_examples import Example
from tests.optimizer_core.graph.test_shapes import HEADS, RTR, _relative_position_model

# a fill shaped like a Range over a dim: named in the same run that names the Range
FILL = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[batch, seq] x) => (float[seq] y) {
    s = Shape(x)
    i1 = Constant<value = int64 {1}>()
    n = Gather<axis = 0>(s, i1)
    zero = Constant<value = int64 {0}>()
    one = Constant<value = int64 {1}>()
    r = Range(zero, n, one)
    rs = Shape(r)
    f = ConstantOfShape<value = float[1] {2.0}>(rs)
    rf = Cast<to = 1>(r)
    y = Mul(rf, f)
}
"""

EXPAND = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[batch, 1, seq] x, float[batch, 4, seq] z) => (float[batch, 4, seq] y) {
    sz = Shape(z)
    e = Expand(x, sz)
    y = Add(e, z)
}
"""


EXAMPLES: dict[tuple[str, str], Example] = {
    ("symbolic-shapes", "range-dim"): Example(model=_relative_position_model),
    ("symbolic-shapes", "fill-dims"): Example(model=lambda: parse(FILL)),
    ("symbolic-shapes", "reshape-transpose-reshape"): Example(
        model=lambda: parse(RTR.replace("PERM", "[0, 2, 1]"))
    ),
    ("symbolic-shapes", "reshape-copy-dims"): Example(model=lambda: parse(HEADS)),
    ("symbolic-shapes", "expand-keep-dims"): Example(model=lambda: parse(EXPAND)),
}
