"""Examples of the ``algebraic`` rules."""

from __future__ import annotations

from tests.optimizer_core.graph.rule_examples import Example
from tests.optimizer_core.graph.rule_examples._build import model

ZERO = "float[4] c = {0.0, 0.0, 0.0, 0.0}"
ONE = "float[4] c = {1.0, 1.0, 1.0, 1.0}"
AXES = "int64[1] ax = {0}"


def _neutral(expr: str, const: str) -> Example:
    return Example(model=model(f"x = Neg(xin)\n y = {expr}", inits=const))


def _logic(expr: str, neutral: bool) -> Example:
    value = int(neutral)
    return Example(
        model=model(
            f"x = Not(xin)\n y = {expr}",
            sig="(bool[2, 4] xin) => (bool[2, 4] y)",
            inits=f"bool[4] c = {{{value}, {value}, {value}, {value}}}",
        )
    )


EXAMPLES: dict[tuple[str, str], Example] = {
    ("algebraic", "x+0"): _neutral("Add(x, c)", ZERO),
    ("algebraic", "0+x"): _neutral("Add(c, x)", ZERO),
    ("algebraic", "x-0"): _neutral("Sub(x, c)", ZERO),
    ("algebraic", "x*1"): _neutral("Mul(x, c)", ONE),
    ("algebraic", "1*x"): _neutral("Mul(c, x)", ONE),
    ("algebraic", "x/1"): _neutral("Div(x, c)", ONE),
    ("algebraic", "x**1"): _neutral("Pow(x, c)", ONE),
    ("algebraic", "x-and-true"): _logic("And(x, c)", True),
    ("algebraic", "true-and-x"): _logic("And(c, x)", True),
    ("algebraic", "x-or-false"): _logic("Or(x, c)", False),
    ("algebraic", "false-or-x"): _logic("Or(c, x)", False),
    ("algebraic", "x-xor-false"): _logic("Xor(x, c)", False),
    ("algebraic", "false-xor-x"): _logic("Xor(c, x)", False),
    ("algebraic", "neg-neg"): Example(
        model=model("t = Relu(xin)\n a = Neg(t)\n y = Neg(a)"),
    ),
    ("algebraic", "not-not"): Example(
        model=model(
            "a = Not(xin)\n b = Not(a)\n y = Xor(b, xin)",
            sig="(bool[2, 4] xin) => (bool[2, 4] y)",
        ),
    ),
    ("algebraic", "transpose-transpose-cancel"): Example(
        model=model(
            "a = Transpose<perm = [1, 0]>(xin)\n b = Transpose<perm = [1, 0]>(a)\n y = Relu(b)"
        ),
    ),
    ("algebraic", "transpose-transpose-compose"): Example(
        model=model(
            "a = Transpose<perm = [1, 0, 2]>(xin)\n y = Transpose<perm = [0, 2, 1]>(a)",
            sig="(float[2, 3, 4] xin) => (float[3, 4, 2] y)",
        ),
    ),
    ("algebraic", "unsqueeze-unsqueeze"): Example(
        model=model(
            "a = Unsqueeze(xin, ax)\n y = Unsqueeze(a, ax)",
            sig="(float[2, 4] xin) => (float[1, 1, 2, 4] y)",
            inits=AXES,
        ),
    ),
    ("algebraic", "reshape-reshape"): Example(
        model=model(
            "a = Reshape(xin, s1)\n y = Reshape(a, s2)",
            sig="(float[2, 4] xin) => (float[4, 2] y)",
            inits="int64[1] s1 = {8}, int64[2] s2 = {4, 2}",
        ),
    ),
    ("algebraic", "flatten-reshape"): Example(
        model=model(
            "a = Flatten<axis = 0>(xin)\n y = Reshape(a, s2)",
            sig="(float[2, 4] xin) => (float[4, 2] y)",
            inits="int64[2] s2 = {4, 2}",
        ),
    ),
    ("algebraic", "squeeze-reshape"): Example(
        model=model(
            "a = Squeeze(xin, ax)\n y = Reshape(a, s2)",
            sig="(float[1, 8] xin) => (float[4, 2] y)",
            inits=f"{AXES}, int64[2] s2 = {{4, 2}}",
        ),
    ),
    ("algebraic", "unsqueeze-reshape"): Example(
        model=model(
            "a = Unsqueeze(xin, ax)\n y = Reshape(a, s2)",
            sig="(float[2, 4] xin) => (float[4, 2] y)",
            inits=f"{AXES}, int64[2] s2 = {{4, 2}}",
        ),
    ),
}

# a unit dim moved past a symbolic one, then flattened: the Transpose is no Reshape by itself
# (two symbolic dims, one of them moved), but the Reshape after it reads through it
EXAMPLES[("algebraic", "transpose-reshape")] = Example(
    model=model(
        "t = Transpose<perm = [1, 0, 2]>(xin)\n y = Reshape(t, s)",
        inits="int64[1] s = {-1}",
        sig="(float[N, 1, M] xin) => (float[K] y)",
    )
)

# DenseNet/DPN-style growing concatenations: each step appends to the last
EXAMPLES[("algebraic", "concat-concat")] = Example(
    model=model(
        "a = Concat<axis = 1>(xin, xin)\n b = Concat<axis = 1>(a, xin)\n"
        " c = Concat<axis = -1>(xin, a)\n y = Concat<axis = 1>(b, c)",
        sig="(float[2, 4] xin) => (float[2, 24] y)",
    )
)

# a Reshape copying a dim the input has static ([-1, 64, 0] on [N, 1, 64, 64] in MobileNetV4's
# attention): the size is written out
EXAMPLES[("algebraic", "reshape-static-copy")] = Example(
    model=model(
        "a = Relu(xin)\n y = Reshape(a, s)",
        inits="int64[3] s = {-1, 4, 0}",
        sig="(float[N, 1, 4, 4] xin) => (float[N, 4, 4] y)",
    )
)

# keys moved [B, C, L] -> [B, L, C], given a heads axis, then moved back: one Unsqueeze
EXAMPLES[("algebraic", "transpose-unsqueeze-transpose")] = Example(
    model=model(
        "t = Transpose<perm = [0, 2, 1]>(xin)\n a = Unsqueeze(t, ax)\n"
        " y = Transpose<perm = [0, 1, 3, 2]>(a)",
        inits="int64[1] ax = {1}",
        sig="(float[2, 3, 4] xin) => (float[2, 1, 3, 4] y)",
    )
)

EXAMPLES[("algebraic", "reshape-unsqueeze")] = Example(
    model=model(
        "a = Reshape(xin, s)\n y = Unsqueeze(a, ax)",
        inits="int64[2] s = {-1, 8}, int64[1] ax = {1}",
        sig="(float[2, 4, 2] xin) => (float[2, 1, 8] y)",
    )
)

EXAMPLES[("algebraic", "reshape-squeeze")] = Example(
    model=model(
        "a = Reshape(xin, s)\n y = Squeeze(a, ax)",
        inits="int64[3] s = {2, 1, -1}, int64[1] ax = {-2}",
        sig="(float[2, 4, 2] xin) => (float[2, 8] y)",
    )
)

# LeViT's attention: the query rows sliced on one axis, then the columns on another
EXAMPLES[("algebraic", "slice-slice")] = Example(
    model=model(
        "a = Slice(xin, s1, e1, a1)\n y = Slice(a, s2, e2, a2)",
        inits="int64[1] s1 = {0}, int64[1] e1 = {2}, int64[1] a1 = {1}, "
        "int64[1] s2 = {1}, int64[1] e2 = {3}, int64[1] a2 = {-1}",
        sig="(float[2, 4, 6] xin) => (float[2, 2, 2] y)",
    )
)

# ResNeSt's split attention: [N, 1, 2, 64] -> [N, 2, 1, 64] moves a dim of size 1 only
EXAMPLES[("algebraic", "transpose-unit-reshape")] = Example(
    model=model(
        "a = Relu(xin)\n t = Transpose<perm = [0, 2, 1, 3]>(a)\n y = Softmax<axis = 1>(t)",
        sig="(float[N, 1, 2, 4] xin) => (float[N, 2, 1, 4] y)",
    )
)

# YOLO12's area attention: qkv.flatten(2).transpose(1, 2).view(B, N, heads, 3 * d)
# .permute(0, 2, 3, 1) is one view of the convolution's output
EXAMPLES[("algebraic", "transpose-split-transpose")] = Example(
    model=model(
        "f = Reshape(xin, flat)\n t = Transpose<perm = [0, 2, 1]>(f)\n"
        " v = Reshape(t, heads)\n y = Transpose<perm = [0, 2, 3, 1]>(v)",
        inits="int64[3] flat = {1, 12, 4}, int64[4] heads = {1, 4, 2, 6}",
        sig="(float[1, 12, 2, 2] xin) => (float[1, 2, 6, 4] y)",
    )
)

# timm's attention: qkv.reshape(B, N, 3, heads, d).permute(2, 0, 3, 1, 4).unbind(0)
EXAMPLES[("algebraic", "transpose-unbind")] = Example(
    model=model(
        "t = Transpose<perm = [2, 0, 3, 1, 4]>(xin)\n"
        " q, k, v = Split<axis = 0>(t, ones)\n"
        " qs = Squeeze(q, ax)\n ks = Squeeze(k, ax)\n vs = Squeeze(v, ax)\n"
        " kt = Transpose<perm = [0, 1, 3, 2]>(ks)\n s = MatMul(qs, kt)\n y = MatMul(s, vs)",
        inits=f"int64[3] ones = {{1, 1, 1}}, {AXES}",
        sig="(float[2, 5, 3, 2, 4] xin) => (float[2, 2, 5, 4] y)",
    )
)

# the same unbind as torch's dynamo exporter writes it: one-element Slices, then Squeezes
EXAMPLES[("algebraic", "transpose-unbind-slices")] = Example(
    model=model(
        "t = Transpose<perm = [2, 0, 3, 1, 4]>(xin)\n"
        " q = Slice(t, s0, s1, ax)\n k = Slice(t, s1, s2, ax)\n v = Slice(t, s2, s3, ax)\n"
        " qs = Squeeze(q, ax)\n ks = Squeeze(k, ax)\n vs = Squeeze(v, ax)\n"
        " kt = Transpose<perm = [0, 1, 3, 2]>(ks)\n s = MatMul(qs, kt)\n y = MatMul(s, vs)",
        inits="int64[1] s0 = {0}, int64[1] s1 = {1}, int64[1] s2 = {2}, int64[1] s3 = {3}, " + AXES,
        sig="(float[2, 5, 3, 2, 4] xin) => (float[2, 2, 5, 4] y)",
    )
)

# TorchScript's `cls.expand(B, -1, -1)`: the -1 entries become 1 under a known condition
EXAMPLES[("algebraic", "where-constant-select")] = Example(
    model=model(
        "b = Shape<end = 1>(xin)\n s = Concat<axis = 0>(b, m)\n w = Where(c, ones, s)\n"
        " y = Expand(cls, w)",
        inits="int64[1] m = {-1}, bool[2] c = {0, 1}, int64[2] ones = {1, 1}",
        sig="(float[N, 4] xin, float[1, 4] cls) => (float[N, 4] y)",
    )
)
