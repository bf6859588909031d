"""Fusions into Gemm and MatMul weights (portable: standard ONNX ops only).

Rules, with ``Y = alpha * A' @ B' + beta * C`` (``A'``, ``B'`` transposed when ``transA``/``transB``):

- ``matmul-add-gemm``: ``Add(MatMul(A, B), C)`` with rank-2 ``A`` and ``B`` and a constant ``C``
  that broadcasts unidirectionally to the ``[M, N]`` result -> ``Gemm(A, B, C)``.
- ``transpose-gemm``: a rank-2 ``Transpose`` feeding ``Gemm``'s ``A`` or ``B`` is absorbed by
  flipping ``transA``/``transB``; ``matmul-transpose-gemm`` does the same for a rank-2 ``MatMul``,
  which becomes a ``Gemm``.
- ``gemm-bn`` / ``gemm-mul`` / ``gemm-add``: a per-column affine map ``Y * k + s`` after a Gemm
  (BatchNormalization in inference mode on the ``[M, N]`` result, or Mul/Add by a constant that
  broadcasts along the last axis only) is folded into the Gemm: ``B'`` columns scaled by ``k``,
  ``C`` becomes ``beta * C * k + s`` and ``beta`` becomes 1.
- ``matmul-mul``: ``MatMul(A, W) * c`` (or ``/ c``) with a constant rank-2 ``W`` and a constant ``c``
  that broadcasts along the last axis only -> ``MatMul(A, W * c)``.

New constants are computed in float64 and rounded once to the weight's dtype: results differ
from the unfused model by rounding (Gemm may also accumulate the bias in a different order), a
relative error around 1e-6 in float32; the pass is therefore not in the ``safe`` preset.
A fusion only rewrites a weight that its node reads alone, so tied weights stay tied and the model
never grows by a weight copy; small bias vectors (within the folding growth budget) are copied.
"""

from __future__ import annotations

import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.passes._linear import (
    GEMM_TYPES,
    broadcasts_to,
    check_after_gemm,
    check_matmul_scale,
    elem_type,
    fold_into_gemm,
    is_transpose_2d,
    scale_weight,
)
from graphtrim.graph.rules import Rule, RuleContext, RulePass, replace

# ---------------------------------------------------------------- Transpose into Gemm


def check_transpose_gemm(gemm: ir.Node, ctx: RuleContext) -> list[int] | str:
    """The inputs (0: A, 1: B) that a rank-2 Transpose read by the Gemm alone produces."""
    found = []
    for index in (0, 1):
        x = gemm.inputs[index]
        if x is not None and is_transpose_2d(x.producer()) and u.single_consumer(x):
            found.append(index)
    return found or "no input is a rank-2 Transpose read by the Gemm alone"


def absorb_transposes(gemm: ir.Node, indices: list[int], ctx: RuleContext) -> None:
    for index in indices:
        attr = ("transA", "transB")[index]
        x = gemm.inputs[index]
        producer = x.producer() if x is not None else None
        assert producer is not None
        gemm.replace_input_with(index, producer.inputs[0])
        gemm.attributes[attr] = ir.AttrInt64(attr, 1 - gemm.attributes.get_int(attr, 0))
        u.remove_nodes(ctx.graph, [producer])
    if len(indices) > 1:  # one count per Transpose absorbed; the pass counts the first
        ctx.pass_.hit("transpose-gemm", len(indices) - 1)


def check_matmul_transpose(matmul: ir.Node, ctx: RuleContext) -> list[bool] | str:
    """Which of A and B a rank-2 Transpose read by the MatMul alone produces."""
    a, b = matmul.inputs[0], matmul.inputs[1]
    if u.rank(a) != 2 or u.rank(b) != 2 or elem_type(matmul.outputs[0]) not in GEMM_TYPES:
        return "not a rank-2 MatMul of a type Gemm takes"
    if a is None or b is None:
        return "an input is missing"
    trans = [is_transpose_2d(x.producer()) and u.single_consumer(x) for x in (a, b)]
    return trans if any(trans) else "no input is a rank-2 Transpose read by the MatMul alone"


def matmul_to_gemm(matmul: ir.Node, trans: list[bool], ctx: RuleContext) -> None:
    inputs = []
    for x, t in zip(matmul.inputs[:2], trans, strict=True):
        assert x is not None
        producer = x.producer()
        inputs.append(producer.inputs[0] if t and producer is not None else x)
    gemm = ir.Node(
        "",
        "Gemm",
        inputs,
        [ir.AttrInt64("transA", int(trans[0])), ir.AttrInt64("transB", int(trans[1]))],
        name=matmul.name,
    )
    ctx.graph.insert_before(matmul, gemm)
    gemm.outputs[0].shape = matmul.outputs[0].shape
    gemm.outputs[0].type = matmul.outputs[0].type
    replace(matmul.outputs[0], gemm.outputs[0], matmul.op_type)
    u.remove_nodes(ctx.graph, [matmul])


# ---------------------------------------------------------------- MatMul + Add -> Gemm


def check_matmul_add(add: ir.Node, ctx: RuleContext) -> tuple[ir.Node, ir.Value] | str:
    """The MatMul (first operand first) and the constant bias ``C`` of ``MatMul(A, B) + C``."""
    if len(add.inputs) != 2 or add.inputs[0] is None or add.inputs[1] is None:
        return "not a binary Add"
    for mm_index in (0, 1):
        m = add.inputs[mm_index]
        c = add.inputs[1 - mm_index]
        producer = m.producer() if m is not None else None
        if m is None or c is None or not u.is_op(producer, "MatMul") or producer is None:
            continue
        if not u.single_consumer(m):
            continue
        a, b = producer.inputs[0], producer.inputs[1]
        if u.rank(a) != 2 or u.rank(b) != 2 or elem_type(m) not in GEMM_TYPES:
            continue
        # a constant bias only: a computed C (a residual) could still be merged by CSE
        if not u.is_constant(c) or elem_type(c) != elem_type(m):
            continue
        if not broadcasts_to(c, m):
            continue
        return producer, c
    return "no rank-2 MatMul read by the Add alone plus a constant bias that broadcasts to it"


def matmul_add_to_gemm(add: ir.Node, match: tuple[ir.Node, ir.Value], ctx: RuleContext) -> None:
    matmul, c = match
    m = matmul.outputs[0]
    gemm = ir.Node("", "Gemm", [matmul.inputs[0], matmul.inputs[1], c], name=matmul.name)
    ctx.graph.insert_before(matmul, gemm)
    gemm.outputs[0].shape = m.shape
    gemm.outputs[0].type = m.type
    replace(add.outputs[0], gemm.outputs[0], add.op_type)
    u.remove_nodes(ctx.graph, [add, matmul])


_AFFINE = (
    "Gemm(A, B, C, alpha, beta) {op} with a per-column {what} -> "
    "Gemm(A, B * k, beta * C * k + s, beta=1) for the map Y * k + s{when}; B is rewritten only "
    "when the Gemm reads it alone, C only when it is per column"
)
_SCALE = (
    "MatMul(A, W) {op} c for a constant rank-2 W read by the MatMul alone and c of W's type "
    "broadcasting along the last axis only -> MatMul(A, W {op} c){when}"
)

# in the order the pass tries them on a node: Add (MatMul + C first), Mul and Div (a Gemm
# before a MatMul)
RULES: tuple[Rule, ...] = (
    Rule(
        "transpose-gemm",
        "Gemm(Transpose(A), B) -> Gemm(A, B, transA=1 - transA) for a rank-2 Transpose "
        "(perm [1, 0]) read by the Gemm alone; the same for B and transB; counted once per "
        "Transpose",
        ("Gemm",),
        check_transpose_gemm,
        absorb_transposes,
    ),
    Rule(
        "matmul-transpose-gemm",
        "MatMul(Transpose(A), B) -> Gemm(A, B, transA=1) (and for B, transB=1) for rank-2 "
        "float or double operands and a rank-2 Transpose read by the MatMul alone",
        ("MatMul",),
        check_matmul_transpose,
        matmul_to_gemm,
    ),
    Rule(
        "matmul-add-gemm",
        "MatMul(A, B) + C -> Gemm(A, B, C) for rank-2 float or double A and B, the MatMul read "
        "by the Add alone and a constant C of its type that broadcasts unidirectionally to "
        "[M, N] (opset >= 11)",
        ("Add",),
        check_matmul_add,
        matmul_add_to_gemm,
    ),
    Rule(
        "gemm-add",
        _AFFINE.format(op="+ c", what="constant c", when=", k = 1, s = c"),
        ("Add",),
        check_after_gemm,
        fold_into_gemm,
    ),
    Rule(
        "gemm-mul",
        _AFFINE.format(op="* c", what="constant c", when=", k = c, s = 0"),
        ("Mul",),
        check_after_gemm,
        fold_into_gemm,
    ),
    Rule(
        "gemm-div",
        _AFFINE.format(op="/ c", what="constant c", when=", k = 1 / c, s = 0, no zero in c"),
        ("Div",),
        check_after_gemm,
        fold_into_gemm,
    ),
    Rule(
        "gemm-bn",
        _AFFINE.format(
            op="-> BatchNormalization (inference mode, rank 2)",
            what="gamma, beta, mean, var",
            when=", k = gamma / sqrt(var + eps), s = beta - mean * k",
        ),
        ("BatchNormalization",),
        check_after_gemm,
        fold_into_gemm,
    ),
    Rule("matmul-mul", _SCALE.format(op="*", when=""), ("Mul",), check_matmul_scale, scale_weight),
    Rule(
        "matmul-div",
        _SCALE.format(op="/", when=" (no zero in c)"),
        ("Div",),
        check_matmul_scale,
        scale_weight,
    ),
)


class GemmFusion(RulePass):
    name = "fuse-gemm"
    exact = False
    summary = (
        "MatMul+Add into Gemm; rank-2 Transpose into Gemm's transA/transB; BatchNormalization "
        "and per-column Mul/Add into Gemm and MatMul weights"
    )
    rules = RULES

    def apply(self, model: ir.Model) -> bool:
        if u.opset_version(model) < 11:  # Gemm's C became optional in opset 11
            return False
        self._names: u.NameGenerator | None = None
        return super().apply(model)

    def namer(self, model: ir.Model) -> u.NameGenerator:
        """The run's name generator, made on first use (it sees the names made before)."""
        if self._names is None:
            self._names = u.NameGenerator(model)
        return self._names
