"""A computed Reshape target with one entry left unknown becomes a constant with ``-1`` there.

``Reshape(x, s)`` is valid only where the entries of ``s`` multiply to ``x``'s element count
(``-1`` and, without ``allowzero``, ``0`` aside). When every entry of a computed ``s`` but one
is proved to be a static size (a constant, or a static dim read from a tensor), the one left is
``size(x)`` over the others on every run, which is what ``-1`` asks onnxruntime to compute:
``Reshape(x, s) -> Reshape(x, s')`` with ``s'`` the static entries and ``-1`` in place of the
unknown one. The shape arithmetic that computed ``s`` (exporters that read the batch dim at run
time: tf2onnx's ``Shape -> Cast(int32) -> Slice -> Concat -> Cast(int64)``) goes dead.

Declined where an entry proved static is 0 (it may copy a dim of ``x``, or be a true zero with
``allowzero``), is negative (a ``-1`` already stands for another entry), or where two entries or
more are unknown.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.rules import Rule, RuleContext, RulePass


def _one_unknown(node: ir.Node, ctx: RuleContext) -> list[int] | str:
    from graphtrim.graph.passes._symbolic_dims import Dim, shape_entries

    if len(node.inputs) < 2 or node.inputs[1] is None or u.is_constant(node.inputs[1]):
        return "the target is constant (or absent)"
    entries = shape_entries(node.inputs[1])
    if entries is None:
        return "the target's entries are not known one by one"
    sizes = [e.value if isinstance(e, Dim) else e for e in entries]
    unknown = [i for i, v in enumerate(sizes) if not isinstance(v, int)]
    if len(unknown) != 1:
        return "not exactly one entry is unknown"
    if any(isinstance(v, int) and v <= 0 for v in sizes):
        return "a static entry is 0 or negative (a copy, a zero, or a -1 already)"
    return [-1 if i == unknown[0] else int(v) for i, v in enumerate(sizes)]  # type: ignore[arg-type]


def _constant_target(node: ir.Node, target: list[int], ctx: RuleContext) -> None:
    names = ctx.pass_.names(ctx.model)  # type: ignore[attr-defined]
    shape = u.add_initializer(ctx.graph, np.array(target, dtype=np.int64), names("shape"))
    node.replace_input_with(1, shape)


RULES: tuple[Rule, ...] = (
    Rule(
        "reshape-one-unknown",
        "Reshape(x, s) -> Reshape(x, s') for a computed s whose entries are static sizes > 0 "
        "but one: s' holds them and -1 for that one (a valid Reshape's entries multiply to "
        "size(x), so it is size(x) over the others, as -1 computes)",
        ("Reshape",),
        _one_unknown,
        _constant_target,
    ),
)


class ReshapeInference(RulePass):
    name = "reshape-infer"
    summary = "a computed Reshape target with one unknown entry as a constant with -1"
    rules = RULES
