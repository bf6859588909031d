"""Identity elimination: nodes whose output equals their input.

Rules (each exact; shapes must prove the no-op, symbolic dims count only when provably equal):

- ``Identity(x) -> x``
- ``Dropout(x)`` in inference mode (no training flag, mask unused) ``-> x``
- ``Cast(x, to=T) -> x`` and ``CastLike(x, y) -> x`` when ``x`` already has type ``T``
- ``Reshape(x, s) -> x`` when ``s`` reproduces the shape of ``x`` (0 copies a dim, -1 fills)
- ``Transpose(x, perm) -> x`` when ``perm`` is the identity
- ``Squeeze(Unsqueeze(x, a), a) -> x`` and ``Unsqueeze(Squeeze(x, a), a) -> x``
- ``Squeeze(x)`` without axes when ``x`` has no dim of size 1
- ``Expand(x, s) -> x`` when broadcasting ``x`` to ``s`` keeps the shape of ``x``
- ``Slice(x, ...) -> x`` when every sliced axis keeps all its elements with step 1
- ``Pad(x, pads) -> x`` when all pads are zero
- ``Concat(x) -> x`` with one input; ``Flatten(x) -> x`` when the result has the shape of ``x``
- ``ReduceSum/Mean/Max/Min/Prod(x, axes) -> x`` with ``keepdims=1`` when every reduced axis of
  ``x`` has size 1: each output element is the one element it reduces (its sum, mean, max, min
  and product are that element)
"""

from __future__ import annotations

import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.rules import Rule, RuleContext, RulePass, replace_output, reroute_refusal

INT64_MAX = 2**63 - 1

Match = ir.Value | str  # the value the node's output equals, or why the rule declines


def _to(node: ir.Node, value: ir.Value | None) -> Match:
    """``value`` as the match, unless the node's output cannot be rerouted to it."""
    if value is None:
        return "the input is missing"
    return reroute_refusal(node.outputs[0], value) or value


def _axes(node: ir.Node, input_index: int) -> list[int] | None:
    """The axes of Squeeze/Unsqueeze/Slice/Pad whether given as attribute or input; [] if absent."""
    return u.ints_given(node, "axes", input_index)


def _same_axes(axes: list[int], other: list[int], rank: int) -> bool:
    """Whether two lists of axes name the same axes of a tensor of ``rank`` (negative ones
    counted from the end, in any order)."""
    a = u.normalize_axes(axes, rank)
    b = u.normalize_axes(other, rank)
    return a is not None and b is not None and sorted(a) == sorted(b)


def _identity(node: ir.Node, ctx: RuleContext) -> Match:
    return _to(node, node.inputs[0])


SMALL_CONSTANT_BYTES = 1024


def _constant_body_output(node: ir.Node, ctx: RuleContext) -> ir.Value | str:
    """An Identity of a small constant that is an output of a Loop/Scan/If body (a loop's
    always-true condition, mostly): the body can output a constant of its own instead."""
    out = node.outputs[0]
    if node.graph is None or node.graph is ctx.model.graph or not out.is_graph_output():
        return "not an output of a subgraph"
    x = node.inputs[0]
    if x is None or not u.is_constant(x) or u.const_nbytes(x) > SMALL_CONSTANT_BYTES:
        return "the input is not a small constant"
    if u.const_array(x) is None:
        return "the constant cannot be read"
    return x


def _to_body_constant(node: ir.Node, x: ir.Value, ctx: RuleContext) -> None:
    graph, out = node.graph, node.outputs[0]
    assert graph is not None
    name = out.name or ctx.pass_.names(ctx.model)("body_constant")  # type: ignore[attr-defined]
    out.name = ctx.pass_.names(ctx.model)(f"{name}_identity")  # type: ignore[attr-defined]
    array = u.const_array(x)
    assert array is not None
    constant = u.add_initializer(graph, array, name, like=out)
    for i, value in enumerate(graph.outputs):
        if value is out:
            graph.outputs[i] = constant


def _dropout(node: ir.Node, ctx: RuleContext) -> Match:
    if len(node.outputs) > 1 and (node.outputs[1].uses() or node.outputs[1].is_graph_output()):
        return "the mask is read"
    if u.node_opset(node, ctx.model) < 12:
        is_test = node.attributes.get_int("is_test", 0)
        if u.node_opset(node, ctx.model) < 7 and not is_test:
            return "is_test is not set (opset < 7)"
        return _to(node, node.inputs[0])
    training = node.inputs[2] if len(node.inputs) > 2 else None
    if training is None:
        return _to(node, node.inputs[0])
    flag = u.const_array(training)
    if flag is not None and not bool(flag.reshape(-1)[0]):
        return _to(node, node.inputs[0])
    return "training mode may be on"


def _cast_same_type(node: ir.Node, ctx: RuleContext) -> Match:
    if node.op_type == "CastLike":
        x, like = node.inputs[0], node.inputs[1]
        if x is None or like is None or x.dtype is None or like.dtype is None:
            return "a type is unknown"
        return _to(node, x) if x.dtype == like.dtype else "the types differ"
    x = node.inputs[0]
    to = node.attributes.get_int("to", None)
    if x is None or x.dtype is None or to is None:
        return "a type is unknown"
    return _to(node, x) if int(x.dtype) == int(to) else "the types differ"


def _reshape_noop(node: ir.Node, ctx: RuleContext) -> Match:
    if len(node.inputs) < 2:
        return "no shape input"
    x_dims = u.symbolic_dims(node.inputs[0])
    target = u.const_ints(node.inputs[1])
    if x_dims is None or target is None or len(target) != len(x_dims):
        return "shapes unknown or of different ranks"
    allowzero = node.attributes.get_int("allowzero", 0)
    minus_one = 0
    for t, d in zip(target, x_dims, strict=True):
        if t == -1:
            minus_one += 1
        elif t == 0 and not allowzero:
            continue
        elif not (isinstance(d, int) and d == t):
            return "an entry is not provably the input's dim"
    # with every other dim equal, a single -1 can only be the remaining dim
    return _to(node, node.inputs[0]) if minus_one <= 1 else "more than one -1"


def _transpose_noop(node: ir.Node, ctx: RuleContext) -> Match:
    r = u.rank(node.inputs[0])
    if node.attributes.get_ints("perm", None) is None and (r is None or r > 1):
        return "reverses the axes of a tensor of rank > 1 or unknown"
    perm = u.perm_of(node, r)
    if perm is None:
        return "perm is no permutation of the input's axes"
    if perm == list(range(len(perm))):
        return _to(node, node.inputs[0])
    return "perm is not the identity"


def _squeezed(node: ir.Node) -> tuple[ir.Value, list[int]] | str:
    """A Squeeze's input and its axes ([] if absent), or why they are not known."""
    x = node.inputs[0]
    axes = _axes(node, 1)
    if axes is None or x is None:
        return "axes not constant"
    return x, axes


def _unsqueeze_squeeze(node: ir.Node, ctx: RuleContext) -> Match:
    found = _squeezed(node)
    if isinstance(found, str):
        return found
    x, axes = found
    producer = x.producer()
    if not axes or not u.is_op(producer, "Unsqueeze") or producer is None:
        return "not a Squeeze with axes of an Unsqueeze"
    inner = _axes(producer, 1)
    r = u.rank(x)
    if inner is not None and r is not None and _same_axes(axes, inner, r):
        src = producer.inputs[0]
        if src is not None:
            return _to(node, src)
    return "the axes differ or are unknown"


def _squeeze_noop(node: ir.Node, ctx: RuleContext) -> Match:
    found = _squeezed(node)
    if isinstance(found, str):
        return found
    x, axes = found
    if axes:
        return "has axes"
    d = u.dims(x)
    if d is not None and all(v is not None and v != 1 for v in d):
        return _to(node, x)
    return "a dim may be 1"


def _squeeze_unsqueeze(node: ir.Node, ctx: RuleContext) -> Match:
    x = node.inputs[0]
    axes = _axes(node, 1)
    producer = x.producer() if x is not None else None
    if not axes or not u.is_op(producer, "Squeeze") or producer is None:
        return "not an Unsqueeze of a Squeeze"
    inner = _axes(producer, 1)
    out_rank = u.rank(node.outputs[0])
    src = producer.inputs[0]
    if not inner or out_rank is None or src is None:
        return "the Squeeze's axes or the rank unknown"
    if _same_axes(axes, inner, out_rank):
        return _to(node, src)
    return "the axes differ"


def _expand_noop(node: ir.Node, ctx: RuleContext) -> Match:
    x_dims = u.symbolic_dims(node.inputs[0])
    shape = u.const_ints(node.inputs[1]) if len(node.inputs) > 1 else None
    if x_dims is None or shape is None or len(shape) > len(x_dims):
        return "shape not constant, input shape unknown or the rank grows"
    for s, d in zip(reversed(shape), reversed(x_dims), strict=False):
        if s == 1:
            continue
        if not (isinstance(d, int) and d == s):
            return "an entry may broadcast a dim"
    return _to(node, node.inputs[0])


def _slice_noop(node: ir.Node, ctx: RuleContext) -> Match:
    if u.node_opset(node, ctx.model) < 10 or len(node.inputs) < 3:
        return "bounds are attributes (opset < 10)"
    x_dims = u.dims(node.inputs[0])
    starts = u.const_ints(node.inputs[1])
    ends = u.const_ints(node.inputs[2])
    if x_dims is None or starts is None or ends is None:
        return "input shape or bounds unknown"
    r = len(x_dims)
    axes = _axes(node, 3) or list(range(len(starts)))
    steps = (
        u.const_ints(node.inputs[4])
        if len(node.inputs) > 4 and node.inputs[4] is not None
        else None
    )
    if len(node.inputs) > 4 and node.inputs[4] is not None and steps is None:
        return "steps not constant"
    steps = steps or [1] * len(starts)
    norm = u.normalize_axes(axes, r)
    if norm is None or not (len(norm) == len(starts) == len(ends) == len(steps)):
        return "malformed axes or bounds"
    for ax, s, e, st in zip(norm, starts, ends, steps, strict=True):
        if st != 1:
            return "a step is not 1"
        d = x_dims[ax]
        if s != 0 and not (d is not None and s <= -d):
            return "a start may drop elements"
        if e < INT64_MAX // 2 and not (d is not None and e >= d):
            return "an end may drop elements"
    return _to(node, node.inputs[0])


def _pad_noop(node: ir.Node, ctx: RuleContext) -> Match:
    if "pads" in node.attributes:
        pads: list[int] | None = list(node.attributes["pads"].as_ints())
    elif len(node.inputs) > 1:
        pads = u.const_ints(node.inputs[1])
    else:
        return "no pads"
    if pads is None:
        return "pads not constant"
    return _to(node, node.inputs[0]) if all(p == 0 for p in pads) else "a pad is not zero"


def _concat_single(node: ir.Node, ctx: RuleContext) -> Match:
    if len(node.inputs) == 1 and node.inputs[0] is not None:
        return _to(node, node.inputs[0])
    return "more than one input"


def _flatten_noop(node: ir.Node, ctx: RuleContext) -> Match:
    x_dims = u.symbolic_dims(node.inputs[0])
    if x_dims is None or len(x_dims) != 2:
        return "the input is not of rank 2"
    axis = node.attributes.get_int("axis", 1)
    # rank-2 input: axis 1 keeps (d0, d1); axis 0 gives (1, d0*d1); axis 2 gives (d0*d1, 1)
    if axis in (1, -1):
        return _to(node, node.inputs[0])
    if axis in (0, -2) and x_dims[0] == 1:
        return _to(node, node.inputs[0])
    if axis == 2 and x_dims[1] == 1:
        return _to(node, node.inputs[0])
    return "the result's shape differs"


# reductions whose value over a single element is that element
_UNIT_REDUCTIONS = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd")


def _reduce_unit_axes(node: ir.Node, ctx: RuleContext) -> Match:
    if node.attributes.get_int("keepdims", 1) != 1:
        return "keepdims=0 drops the axes (a Squeeze, not a no-op)"
    x_dims = u.dims(node.inputs[0])
    if x_dims is None:
        return "the input's rank is unknown"
    # axes: an attribute before ReduceSum-13 / the others' opset 18, an input since
    axes = _axes(node, 1)
    if axes is None:
        return "the axes are not constant"
    if not axes:
        if node.attributes.get_int("noop_with_empty_axes", 0):
            return "no axes with noop_with_empty_axes (the identity rule of that op)"
        axes = list(range(len(x_dims)))  # every axis
    norm = u.normalize_axes(axes, len(x_dims))
    if norm is None:
        return "malformed axes"
    if any(x_dims[a] != 1 for a in norm):
        return "a reduced axis may have more than one element"
    x = node.inputs[0]
    if x is None or (node.outputs[0].dtype is not None and node.outputs[0].dtype != x.dtype):
        return "the output's type differs"
    return _to(node, x)


_RULES = (  # name, op types, check, math
    ("identity", ("Identity",), _identity, "Identity(x) -> x"),
    ("dropout-inference", ("Dropout",), _dropout, "Dropout(x) -> x without training (no or a "
     "false constant training flag, is_test before opset 7) when the mask is unread"),
    ("cast-same-type", ("Cast", "CastLike"), _cast_same_type,
     "Cast(x, to=T) -> x and CastLike(x, y) -> x when x already has type T (y's type)"),
    ("reshape-noop", ("Reshape",), _reshape_noop, "Reshape(x, s) -> x when each entry of s is "
     "x's dim at its position (0 copies a dim unless allowzero=1, one -1 fills)"),
    ("transpose-noop", ("Transpose",), _transpose_noop,
     "Transpose(x, perm) -> x when perm is the identity (or absent and rank(x) <= 1)"),
    ("unsqueeze-squeeze", ("Squeeze",), _unsqueeze_squeeze,
     "Squeeze(Unsqueeze(x, a), a) -> x for the same constant axes"),
    ("squeeze-noop", ("Squeeze",), _squeeze_noop, "Squeeze(x) -> x without axes when no dim is 1"),
    ("squeeze-unsqueeze", ("Unsqueeze",), _squeeze_unsqueeze,
     "Unsqueeze(Squeeze(x, a), a) -> x for the same constant axes"),
    ("expand-noop", ("Expand",), _expand_noop,
     "Expand(x, s) -> x when each entry of s is 1 or x's dim (right-aligned), rank kept"),
    ("slice-noop", ("Slice",), _slice_noop,
     "Slice(x, starts, ends, axes, 1) -> x when every sliced axis keeps all its elements"),
    ("pad-noop", ("Pad",), _pad_noop, "Pad(x, pads) -> x when all pads are zero"),
    ("concat-single", ("Concat",), _concat_single, "Concat(x) -> x (one input)"),
    ("flatten-noop", ("Flatten",), _flatten_noop, "Flatten(x, axis) -> x for x of rank 2 when "
     "the result has x's shape (axis 1, or the dim it merges with is 1)"),
    ("reduce-unit-axes", _UNIT_REDUCTIONS, _reduce_unit_axes, "Reduce{Sum,Mean,Max,Min,Prod}"
     "(x, axes, keepdims=1) -> x when every reduced axis of x has size 1 (a reduction of one "
     "element is that element)"),
)  # fmt: skip

RULES: tuple[Rule, ...] = (
    *(Rule(name, math, ops, check, replace_output) for name, ops, check, math in _RULES),
    Rule(
        "identity-of-constant-body-output",
        "a Loop/Scan/If body output Identity(c) of a small constant c -> a constant of the "
        "body (the body's outputs cannot name a value of the outer scope)",
        ("Identity",),
        _constant_body_output,
        _to_body_constant,
    ),
)


class IdentityElimination(RulePass):
    name = "identity"
    summary = "remove Identity, inference Dropout and no-op Cast/Reshape/Transpose/... nodes"
    rules = RULES
