"""Examples of the ``symbolic-shapes`` rules: shapes computed from the tensors' own dims."""

from __future__ import annotations

from tests.helpers import parse
from tests.optimizer_core.graph.rule_examples import Example
from tests.optimizer_core.graph.test_shapes import (
    HEADS,
    KV,
    RTR,
    _qkv,
    _relative_position_model,
)

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

# cls_token.expand(B, -1, -1): the target picks B where it is not -1; the Expand's output is
# named [B, 1, 8], so the Concat after it has x's batch
EXPAND_DIMS = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[B, 4, 8] x) => (float[B, 5, 8] y)
  <float[1, 1, 8] cls = {1, 2, 3, 4, 5, 6, 7, 8}, int64 i0 = {0}, int64[1] ax = {0},
   int64[1] m1 = {-1}, int64[3] ones = {1, 1, 1}, bool[3] pick = {0, 1, 1}> {
    s = Shape(x)
    b = Gather<axis = 0>(s, i0)
    bu = Unsqueeze(b, ax)
    target = Concat<axis = 0>(bu, m1, m1)
    fixed = Where(pick, ones, target)
    c = Expand(cls, fixed)
    y = Concat<axis = 1>(c, x)
}
"""

# GC ViT's global query tiled over the windows of each image: [B, 8] by [4, 1] is [(4*B), 8], the
# windows' own first dim, so the sum below has it too
TILE_DIMS = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[B, 8] q, float[B, 4, 8] x) => (float[M, 8] y) <int64[2] reps = {4, 1}, int64[2] flat = {-1, 8}> {
    t = Tile(q, reps)
    w = Reshape(x, flat)
    s = Add(t, w)
    y = Relu(s)
}
"""

# a Reshape to [-1, 8] of [B, 2, 4]: -1 is B
RESHAPE_DIMS = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[B, 2, 4] x) => (float[B, 8] y) <int64[2] s = {-1, 8}> {
    a = Relu(x)
    r = Reshape(a, s)
    y = Neg(r)
}
"""

# position ids sliced to the sequence length (BERT's buffered table): the sliced output keeps
# the table's dim 0, so the batch read back from it is the constant 1
SLICE_DIMS = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[B, S] x) => (float[B, S] y)
  <float[1, 16] table = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
   int64[1] z = {0}, int64[1] one = {1}, int64 i1 = {1}, int64 i0 = {0}> {
    s = Shape(x)
    n = Gather<axis = 0>(s, i1)
    nu = Unsqueeze(n, z)
    p = Slice(table, z, nu, one)
    ps = Shape(p)
    b = Gather<axis = 0>(ps, i0)
    bf = Cast<to = 1>(b)
    q = Mul(p, bf)
    y = Add(x, q)
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
    ("symbolic-shapes", "expand-dims"): Example(model=lambda: parse(EXPAND_DIMS)),
    ("symbolic-shapes", "reshape-dims"): Example(model=lambda: parse(RESHAPE_DIMS)),
    ("symbolic-shapes", "concat-dims"): Example(model=lambda: parse(KV)),
    ("symbolic-shapes", "slice-dims"): Example(model=lambda: parse(SLICE_DIMS)),
    ("symbolic-shapes", "tile-dims"): Example(model=lambda: parse(TILE_DIMS)),
    ("symbolic-shapes", "shape-read-origin"): Example(model=_qkv),
}
