"""Property test: the ``default`` preset keeps random valid graphs valid and equivalent.

Hypothesis builds graphs with ``onnx.helper`` over one float input of shape ``[N, 4]`` (``N``
symbolic) or ``[2, 3, 4]``: chains and DAGs of elementwise ops with constants (0 and 1 often, so
the algebraic rules fire, and shapes that broadcast, sometimes growing the result), activations,
``Exp`` of clipped inputs, ``Cast`` round trips (exact and lossy), ``Transpose`` (pairs too),
``Reshape`` with constant or ``Shape``/``Gather``-computed targets, ``Squeeze``/``Unsqueeze``,
``Concat``, ``Clip``, ``Dropout``, repeated subexpressions and dead branches, and sums or
differences of a 1-D ``Conv`` with another Conv, the input itself or its ``BatchNormalization``
(what ``fuse-affine``'s re-parameterization merges; later ops may read a branch too, which
must stop the merge).

For every graph the optimized model must pass the full ONNX checker, compute the same outputs in
onnxruntime (rtol 1e-5, atol 1e-6: ``reassociate`` may round differently) and have no more nodes.

Rounding differences stay below the tolerance by construction:

- every value's magnitude is tracked and kept at or below 4, so one float32 rounding is at most
  2.4e-7 absolute and a reassociated ``(x + c1) + c2`` differs from ``x + (c1 + c2)`` by at most
  about 3.6e-7 (two roundings against one);
- ops that would amplify such a difference are not generated (no product of two variables, no
  scaling by more than 1 in magnitude; ``Exp`` only of values clipped to [-4, 0]);
- constants are multiples of 1/8, so merged constants ``c1 + c2`` and ``c1 * c2`` are exact;
- lossy casts (to float16 or int32 and back) are discontinuous, so they are applied only to
  values that both models compute exactly: inputs on a 1/64 grid and exact arithmetic on them
  (tracked as ``grid``: the value is a multiple of 2**-grid that float32 represents exactly).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnx_ir as ir
from hypothesis import given, settings
from hypothesis import strategies as st

from graphtrim.graph.optimizer import optimize_model
from graphtrim.verify import Session, Tolerance, verify

FLOAT = onnx.TensorProto.FLOAT
MAX_BOUND = 4.0
MAX_RANK = 5
MAX_ELEMENTS = 512

Dim = int | str  # "N" is the only symbolic dim
Shape = tuple[Dim, ...]


@dataclasses.dataclass(frozen=True)
class Val:
    name: str
    shape: Shape
    bound: float  # upper bound of |value| for the inputs fed below
    grid: int | None  # value is an exact multiple of 2**-grid; None: it may carry rounding


def exact_grid(*grids: int | None, extra: int = 0) -> int | None:
    """The grid of a result computed exactly from values on ``grids`` (None if any is inexact)."""
    if any(g is None for g in grids):
        return None
    g = max([0, *(int(g) for g in grids if g is not None)]) + extra
    # |value| <= 4 = 2**2: float32's 24-bit significand holds multiples of 2**-22 exactly
    return g if g <= 22 else None


def broadcast(a: Shape, b: Shape) -> Shape | None:
    """Numpy broadcasting of two tracked shapes; None when ``N`` would meet a size other than 1."""
    out: list[Dim] = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            return None
    return tuple(reversed(out))


def static_size(shape: Shape) -> int:
    return math.prod(d for d in shape if isinstance(d, int))


def factorizations(total: int, parts: int) -> list[tuple[int, ...]]:
    if parts == 1:
        return [(total,)]
    out = []
    for f in range(1, total + 1):
        if total % f == 0:
            out.extend((f, *rest) for rest in factorizations(total // f, parts - 1))
    return out


class Builder:
    """Collects nodes, initializers and values; every method returns the new Val."""

    def __init__(self, draw: Callable, x: Val):
        self.draw = draw
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.pool: list[Val] = [x]
        self.counter = 0

    def name(self, hint: str) -> str:
        self.counter += 1
        return f"{hint}_{self.counter}"

    def const(self, array: np.ndarray, hint: str = "c") -> str:
        name = self.name(hint)
        if self.draw(st.booleans()):
            self.inits.append(onh.from_array(array, name))
        else:
            self.nodes.append(
                oh.make_node("Constant", [], [name], value=onh.from_array(array, name + "_t"))
            )
        return name

    def node(
        self, op: str, inputs: list[str], shape: Shape, bound: float, grid: int | None, **attrs
    ) -> Val:
        out = Val(self.name(op.lower()), shape, bound, grid)
        self.nodes.append(oh.make_node(op, inputs, [out.name], **attrs))
        self.pool.append(out)
        return out


# constants: multiples of 1/8, so sums and products of two are exact in float32
SMALL = [0.0, 1.0, -1.0, 0.5, -0.5, 0.25, 0.125, -0.375, 0.75]
SCALES = [0.0, 1.0, -1.0, 0.5, -0.5, 0.25, -0.75, 0.875]  # |c| <= 1: never amplifies
DIVISORS = [1.0, -1.0, 2.0, -2.0, 4.0, 1.25]  # |c| >= 1: never amplifies
TINY = [0.0, 0.125, -0.125, 0.25, -0.25]  # Conv biases, BatchNormalization means and shifts


@dataclasses.dataclass(frozen=True)
class Step:
    """An op to emit; replaying one with the same inputs makes a duplicated subexpression."""

    kind: str
    inputs: tuple[Val, ...]
    params: tuple


KINDS = [
    *["arith"] * 4,
    *["chain"] * 2,
    *["unary"] * 2,
    "identity",
    "binary",
    "exp",
    "cast",
    "transpose",
    "transpose-pair",
    "reshape",
    "shape-reshape",
    "unsqueeze",
    "squeeze",
    "concat",
    "clip",
    "dropout",
    "duplicate",
    *["conv-sum"] * 2,
]


def plan(
    draw, b: Builder, history: list[Step], v: Val | None = None, op: str | None = None
) -> Step | None:
    """Draw one op on a pool value; None when the drawn op does not apply to it."""
    pool = b.pool
    if v is None:
        # prefer recent values (long chains) but reach back sometimes (DAGs, dead branches)
        v = pool[-1 - draw(st.integers(0, len(pool) - 1))] if draw(st.booleans()) else pool[-1]
    r = len(v.shape)
    kind = "arith" if op is not None else draw(st.sampled_from(KINDS))
    if kind == "duplicate":
        # the same op on the same inputs again (its constants are fresh copies)
        return draw(st.sampled_from(history)) if history else None
    if kind == "chain":
        # op(op(v, c1), c2): what reassociation merges; the caller plans the second half
        return Step("chain", (v,), (draw(st.sampled_from(["Add", "Mul"])),))
    if kind in ("identity", "exp"):
        return Step(kind, (v,), ())
    if kind == "dropout":
        return Step(kind, (v,), (draw(st.booleans()),))  # with a ratio input or not
    if kind == "unary":
        return Step(kind, (v,), (draw(st.sampled_from(["Relu", "Sigmoid", "Neg", "Abs"])),))
    if kind == "arith":
        op = op or draw(st.sampled_from(["Add", "Sub", "Mul", "Div"]))
        choices: list[tuple[int, ...]] = [
            (),
            (1,) * r,
            tuple(d if isinstance(d, int) else 1 for d in v.shape),
        ]
        if isinstance(v.shape[-1], int):
            choices.append((v.shape[-1],))
        if r < MAX_RANK:
            choices.append((1,) * (r + 1))  # broadcasting grows the rank: x * 1 is not a no-op
            choices.append((2,) + (1,) * r)  # and the size
        cshape = draw(st.sampled_from(choices))
        out_shape = broadcast(v.shape, cshape)
        if out_shape is None or static_size(out_shape) > MAX_ELEMENTS:
            return None
        table = {"Add": SMALL, "Sub": SMALL, "Mul": SCALES, "Div": DIVISORS}[op]
        fill = draw(st.sampled_from(["neutral", "random", "random"]))
        if fill == "neutral":
            values = np.full(cshape, 0.0 if op in ("Add", "Sub") else 1.0, np.float32)
        else:
            seed = draw(st.integers(0, 2**16))
            values = np.random.default_rng(seed).choice(table, size=cshape).astype(np.float32)
        c_first = op in ("Add", "Mul") and draw(st.booleans())
        return Step(kind, (v,), (op, values, c_first))
    if kind == "binary":
        op = draw(st.sampled_from(["Add", "Sub", "Max", "Min"]))
        w = pool[draw(st.integers(0, len(pool) - 1))]
        if broadcast(v.shape, w.shape) is None:
            w = v
        return Step(kind, (v, w), (op,))
    if kind == "cast":
        targets = [onnx.TensorProto.DOUBLE, FLOAT]  # exact round trips
        if v.grid is not None:
            targets += [onnx.TensorProto.FLOAT16, onnx.TensorProto.INT32]  # lossy ones
        return Step(kind, (v,), (draw(st.sampled_from(targets)),))
    if kind in ("transpose", "transpose-pair"):
        if r < 2:
            return None
        perm = tuple(draw(st.permutations(list(range(r)))))
        return Step(kind, (v,), (perm,))
    if kind == "reshape":
        # a copied or inferred first dim can stand for N only when N is first and alone
        # (broadcasting [N, 1, 4] with [N, 4] makes [N, N, 4])
        if "N" in v.shape and (v.shape[0] != "N" or v.shape.count("N") > 1):
            return None
        rest = static_size(v.shape)
        if "N" in v.shape:
            tail = draw(st.sampled_from(factorizations(rest, draw(st.integers(1, 3)))))
            first = draw(st.sampled_from([0, -1]))
            return Step(kind, (v,), (("N", *tail), (first, *tail)))
        dims = draw(st.sampled_from(factorizations(rest, draw(st.integers(1, 4)))))
        target = list(dims)
        if draw(st.booleans()):
            target[draw(st.integers(0, len(dims) - 1))] = -1
        return Step(kind, (v,), (dims, tuple(target)))
    if kind == "shape-reshape":
        if r < 2 or ("N" in v.shape and (v.shape[0] != "N" or v.shape.count("N") > 1)):
            return None
        return Step(kind, (v,), ())
    if kind == "unsqueeze":
        if r >= MAX_RANK:
            return None
        return Step(kind, (v,), (draw(st.integers(-(r + 1), r)),))
    if kind == "squeeze":
        ones = [i for i, d in enumerate(v.shape) if d == 1]
        if not ones or r == 1:
            return None
        axis = draw(st.sampled_from(ones))
        return Step(kind, (v,), (axis - r if draw(st.booleans()) else axis,))
    if kind == "concat":
        axes = [i for i, d in enumerate(v.shape) if isinstance(d, int)]
        if not axes or static_size(v.shape) * 2 > MAX_ELEMENTS:
            return None
        same = [w for w in pool if w.shape == v.shape]
        others = tuple(draw(st.sampled_from(same)) for _ in range(draw(st.integers(1, 2))))
        return Step(kind, (v, *others), (draw(st.sampled_from(axes)),))
    if kind == "conv-sum":
        # Conv1d over [batch, channels, length]: static channels and length
        if r != 3 or not all(isinstance(d, int) for d in v.shape[1:]):
            return None
        channels = v.shape[1]
        assert isinstance(channels, int)
        group = draw(st.sampled_from([1, channels]))
        kernels = (draw(st.sampled_from([1, 3])), draw(st.sampled_from([1, 3])))
        other = draw(st.sampled_from(["conv", "identity", "bn"]))
        op = draw(st.sampled_from(["Add", "Sub"]))
        return Step(
            kind,
            (v,),
            (group, kernels, other, op, draw(st.booleans()), draw(st.integers(0, 2**16))),
        )
    if kind == "clip":
        lo = draw(st.sampled_from([None, -1.0, 0.0, -0.5, -10.0]))
        hi = draw(st.sampled_from([None, 1.0, 0.5, 6.0]))
        return Step(kind, (v,), (lo, hi))
    return None  # duplicate: handled by the caller


def _pow2_exponent(values: np.ndarray) -> int | None:
    """log2 of the largest |c| when every |c| is a power of two (exact division), else None."""
    mags = np.abs(values.astype(np.float64)).reshape(-1)
    if mags.size == 0:
        return 0
    exps = np.log2(mags)
    if not np.all(exps == np.round(exps)):
        return None
    return int(np.max(exps))


def emit(b: Builder, step: Step) -> Val:
    v = step.inputs[0]
    r = len(v.shape)
    if step.kind == "identity":
        return b.node("Identity", [v.name], v.shape, v.bound, v.grid)
    if step.kind == "dropout":
        inputs = [v.name]
        if step.params[0]:
            inputs.append(b.const(np.array(0.25, np.float32), "ratio"))
        return b.node("Dropout", inputs, v.shape, v.bound, v.grid)
    if step.kind == "unary":
        (op,) = step.params
        if op == "Sigmoid":
            return b.node(op, [v.name], v.shape, 1.0, None)
        return b.node(op, [v.name], v.shape, v.bound, v.grid)
    if step.kind == "exp":
        # exp is 1-Lipschitz on [-4, 0] and bounded by 1 there
        lo = b.const(np.array(-4.0, np.float32), "lo")
        hi = b.const(np.array(0.0, np.float32), "hi")
        clipped = b.node("Clip", [v.name, lo, hi], v.shape, min(v.bound, 4.0), v.grid)
        return b.node("Exp", [clipped.name], v.shape, 1.0, None)
    if step.kind == "arith":
        op, values, c_first = step.params
        c = b.const(values)
        scale = float(np.max(np.abs(values))) if values.size else 0.0
        grid: int | None
        if op in ("Add", "Sub"):
            bound, grid = v.bound + scale, exact_grid(v.grid, 3)
        elif op == "Mul":
            bound, grid = v.bound * scale, exact_grid(v.grid, extra=3)
        else:
            smallest = float(np.min(np.abs(values))) if values.size else 1.0
            exponent = _pow2_exponent(values)
            bound = v.bound / smallest
            grid = None if exponent is None else exact_grid(v.grid, extra=exponent)
        shape = broadcast(v.shape, values.shape)
        assert shape is not None
        return b.node(op, [c, v.name] if c_first else [v.name, c], shape, bound, grid)
    if step.kind == "binary":
        (op,) = step.params
        w = step.inputs[1]
        shape = broadcast(v.shape, w.shape)
        assert shape is not None
        bound = v.bound + w.bound if op in ("Add", "Sub") else max(v.bound, w.bound)
        return b.node(op, [v.name, w.name], shape, bound, exact_grid(v.grid, w.grid))
    if step.kind == "cast":
        (to,) = step.params
        mid = b.node("Cast", [v.name], v.shape, v.bound, v.grid, to=to)
        b.pool.pop()  # not a float value: keep it out of the pool
        # rounding an exact multiple of 2**-g to float16 or int32 gives a multiple of 2**-g again
        return b.node("Cast", [mid.name], v.shape, v.bound, v.grid, to=FLOAT)
    if step.kind in ("transpose", "transpose-pair"):
        (perm,) = step.params
        shape = tuple(v.shape[p] for p in perm)
        t = b.node("Transpose", [v.name], shape, v.bound, v.grid, perm=list(perm))
        if step.kind == "transpose":
            return t
        inverse = [perm.index(i) for i in range(r)]
        return b.node("Transpose", [t.name], v.shape, v.bound, v.grid, perm=inverse)
    if step.kind == "reshape":
        shape, target = step.params
        s = b.const(np.array(target, np.int64), "shape")
        return b.node("Reshape", [v.name, s], tuple(shape), v.bound, v.grid)
    if step.kind == "shape-reshape":
        shape_of = b.node("Shape", [v.name], (r,), 0.0, 0)
        idx = b.const(np.array([0], np.int64), "idx")
        first = b.node("Gather", [shape_of.name, idx], (1,), 0.0, 0, axis=0)
        minus_one = b.const(np.array([-1], np.int64), "minus_one")
        target = b.node("Concat", [first.name, minus_one], (2,), 0.0, 0, axis=0)
        del b.pool[-3:]  # int64 shape values: keep them out of the pool
        shape = (v.shape[0], static_size(v.shape[1:]))
        return b.node("Reshape", [v.name, target.name], shape, v.bound, v.grid)
    if step.kind == "unsqueeze":
        (axis,) = step.params
        a = b.const(np.array([axis], np.int64), "axes")
        pos = axis + r + 1 if axis < 0 else axis
        shape = (*v.shape[:pos], 1, *v.shape[pos:])
        return b.node("Unsqueeze", [v.name, a], shape, v.bound, v.grid)
    if step.kind == "squeeze":
        (axis,) = step.params
        a = b.const(np.array([axis], np.int64), "axes")
        pos = axis + r if axis < 0 else axis
        shape = v.shape[:pos] + v.shape[pos + 1 :]
        return b.node("Squeeze", [v.name, a], shape, v.bound, v.grid)
    if step.kind == "concat":
        (axis,) = step.params
        dim = v.shape[axis]
        assert isinstance(dim, int)
        shape = (*v.shape[:axis], dim * len(step.inputs), *v.shape[axis + 1 :])
        bound = max(w.bound for w in step.inputs)
        grid = exact_grid(*(w.grid for w in step.inputs))
        return b.node("Concat", [w.name for w in step.inputs], shape, bound, grid, axis=axis)
    if step.kind == "conv-sum":
        group, kernels, other, op, conv_first, seed = step.params
        rng = np.random.default_rng(seed)
        channels = v.shape[1]
        assert isinstance(channels, int)

        def conv(k: int) -> Val:
            # taps in {-1/16, 0, 1/16}: |Conv(x)| <= (C / group) * k / 16 * |x| + |bias|
            w = (rng.integers(-1, 2, size=(channels, channels // group, k)) / 16).astype(np.float32)
            bias = rng.choice(TINY, size=channels).astype(np.float32)
            bound = float(np.abs(w).reshape(channels, -1).sum(axis=1).max()) * v.bound + float(
                np.abs(bias).max()
            )
            names = [v.name, b.const(w, "w"), b.const(bias, "bias")]
            pads = [k // 2, k // 2]
            return b.node("Conv", names, v.shape, bound, None, pads=pads, group=group)

        first = conv(kernels[0])
        if other == "conv":
            second = conv(kernels[1])
        elif other == "identity":
            second = v
        else:
            gamma = rng.choice([0.5, 0.75, 1.0], size=channels).astype(np.float32)
            params = [gamma, *(rng.choice(TINY, size=channels).astype(np.float32) for _ in "bm")]
            names = [b.const(p, "bn") for p in params]
            var = b.const(np.ones(channels, np.float32), "var")
            # |k| <= 1 (var 1): |BN(x)| <= |x| + |mean| + |beta|
            second = b.node(
                "BatchNormalization", [v.name, *names, var], v.shape, v.bound + 0.5, None
            )
        terms = (first, second) if conv_first else (second, first)
        return b.node(op, [t.name for t in terms], v.shape, first.bound + second.bound, None)
    if step.kind == "clip":
        lo, hi = step.params
        inputs = [v.name, "" if lo is None else b.const(np.array(lo, np.float32), "lo")]
        if hi is not None:
            inputs.append(b.const(np.array(hi, np.float32), "hi"))
        bound = v.bound
        if lo is not None and hi is not None:
            bound = min(v.bound, max(abs(lo), abs(hi)))
        return b.node("Clip", inputs, v.shape, bound, exact_grid(v.grid, 3))
    raise AssertionError(step.kind)


def _emits_within_bound(step: Step) -> bool:
    """Whether the step's result magnitude stays within MAX_BOUND (computed before emitting)."""
    v = step.inputs[0]
    if step.kind == "arith":
        op, values, _ = step.params
        scale = float(np.max(np.abs(values))) if values.size else 0.0
        if op in ("Add", "Sub"):
            return v.bound + scale <= MAX_BOUND
        return True  # |scale| <= 1 and |divisor| >= 1
    if step.kind == "binary":
        w = step.inputs[1]
        return step.params[0] in ("Max", "Min") or v.bound + w.bound <= MAX_BOUND
    if step.kind == "conv-sum":
        group, kernels, other, _, _, _ = step.params
        channels = v.shape[1]
        assert isinstance(channels, int)
        widest = (channels // group) * max(kernels) / 16 * v.bound + 0.25
        second = {"conv": widest, "identity": v.bound, "bn": v.bound + 0.5}[other]
        return widest + second <= MAX_BOUND
    return True


@st.composite
def random_models(draw) -> tuple[onnx.ModelProto, list[dict[str, np.ndarray]]]:
    symbolic = draw(st.booleans())
    x = Val("x", ("N", 4) if symbolic else (2, 3, 4), 2.0, 6)
    b = Builder(draw, x)
    history: list[Step] = []
    for _ in range(draw(st.integers(2, 24))):
        step: Step | None = None
        for _attempt in range(5):
            step = plan(draw, b, history)
            if step is not None and step.kind == "chain":
                step = plan(draw, b, history, v=step.inputs[0], op=step.params[0])
                if step is not None and _emits_within_bound(step):
                    history.append(step)
                    step = plan(draw, b, history, v=emit(b, step), op=step.params[0])
            if step is not None and _emits_within_bound(step):
                break
        else:
            step = Step("unary", (b.pool[-1],), ("Relu",))
        assert step is not None
        history.append(step)
        emit(b, step)

    produced = [v for v in b.pool if v.name != "x"]
    outputs = [produced[-1]]
    if len(produced) > 1 and draw(st.booleans()):
        extra = draw(st.sampled_from(produced[:-1]))
        outputs.append(extra)
    graph = oh.make_graph(
        b.nodes,
        "random",
        [oh.make_tensor_value_info("x", FLOAT, list(x.shape))],
        [oh.make_tensor_value_info(v.name, FLOAT, list(v.shape)) for v in outputs],
        b.inits,
    )
    opset = draw(st.sampled_from([13, 17, 21]))
    model = oh.make_model(
        graph, opset_imports=[oh.make_opsetid("", opset)], ir_version=10 if opset == 21 else 8
    )
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    sizes = [3, 1] if symbolic else [2]
    feeds = []
    for n in sizes:
        shape = [n, 4] if symbolic else [2, 3, 4]
        # in [-2, 2] (the bound of x) on a 1/64 grid, with exact zeros for Relu/Abs/Clip edges
        feeds.append({"x": (rng.integers(-128, 129, size=shape) / 64).astype(np.float32)})
    return model, feeds


@settings(max_examples=60, deadline=None, derandomize=True)
@given(random_models())
def test_default_preset_keeps_random_graphs_valid_and_equivalent(case):
    proto, feeds = case
    # the generator makes valid models whose outputs have the shapes it tracked
    onnx.checker.check_model(proto, full_check=True)
    reference = Session(proto)
    for feed in feeds:
        n = feed["x"].shape[0]
        got = [list(a.shape) for a in reference.run(feed).values()]
        declared = [
            [n if d.dim_param == "N" else d.dim_value for d in o.type.tensor_type.shape.dim]
            for o in proto.graph.output
        ]
        assert got == declared

    model = ir.serde.deserialize_model(proto)
    result = optimize_model(model, preset="default")
    out = ir.serde.serialize_model(result.model)

    onnx.checker.check_model(out, full_check=True)
    assert [o.name for o in out.graph.output] == [o.name for o in proto.graph.output]
    assert len(out.graph.node) <= len(proto.graph.node)
    record = verify(proto, out, inputs=feeds, tolerance=Tolerance(rtol=1e-5, atol=1e-6))
    assert record.ok, record.summary()
