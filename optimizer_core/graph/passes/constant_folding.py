"""Constant folding with a size budget.

Every node whose inputs are all constants is evaluated once, with onnxruntime's own kernels (the
runtime that verifies the result), in one session per graph and iteration: the nodes to fold form
a small model whose inputs are the constants it reads and whose outputs are the values read by the
rest of the graph (the frontier). Each frontier value is then materialized only if the model does
not grow: its bytes must not exceed the bytes of the constants that become dead plus
``fold_max_growth_bytes`` (so ``ConstantOfShape``/``Tile``/``Expand`` blow-ups stay as nodes), and
never more than ``fold_max_tensor_bytes``. A value over that budget whose elements all come out
equal (a gather from a zero-initialized bias table, a mask of ones) becomes a ``ConstantOfShape``
fill instead, a few bytes whatever its size, when that replaces two nodes or more (values up to
``_FILL_PROBE_BYTES`` are evaluated to find out; each value once). Any other value over the budget
may still draw its growth from the run's pool, ``fold_max_growth_ratio`` of the model's initializer
bytes (the attention masks of a windowed transformer: a fraction of a percent of its weights),
first come first served, until the pool is spent.

Shape arithmetic is folded without running anything: ``Shape(x)`` and ``Size(x)`` when the dims
they read are static, and ``Gather(Shape(x), i)`` when the gathered dims are static even if
others are symbolic.

Never folded: non-deterministic ops, ``DequantizeLinear`` (quantized weights stay quantized),
ops with subgraphs, ops of non-standard domains, values that are graph outputs, and values whose
dtype numpy cannot hold.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

import numpy as np
import onnx_ir as ir

from graphtrim import dtypes
from graphtrim.graph import _ir_utils as u
from graphtrim.graph.passes._fold_eval import Plan, run_numpy, run_onnxruntime
from graphtrim.graph.passes._shape_values import (
    check_dims_arithmetic,
    check_equal_dims,
    check_gather_shape,
    check_shape,
    check_size,
    check_slice_shape,
)
from graphtrim.graph.rules import Rule, RuleContext, RulePass, replace

logger = logging.getLogger("graphtrim.optimizer")

_NEVER_FOLD = u.NONDETERMINISTIC_OPS | {"DequantizeLinear", "Constant", "If", "Loop", "Scan"}
# ops whose output can be far larger than their inputs: fold only with a known output size
_EXPANDING = frozenset(
    {"ConstantOfShape", "Expand", "Tile", "Range", "Resize", "Upsample", "Pad", "EyeLike", "OneHot"}
)
_NUMPY_DTYPES = frozenset(
    {
        ir.DataType.FLOAT,
        ir.DataType.DOUBLE,
        ir.DataType.FLOAT16,
        ir.DataType.INT8,
        ir.DataType.INT16,
        ir.DataType.INT32,
        ir.DataType.INT64,
        ir.DataType.UINT8,
        ir.DataType.UINT16,
        ir.DataType.UINT32,
        ir.DataType.UINT64,
        ir.DataType.BOOL,
    }
)


# over-budget values up to this size are evaluated to see whether they are a uniform fill
_FILL_PROBE_BYTES = 16 * 1024 * 1024


def _static_nbytes(value: ir.Value) -> int | None:
    shape = u.static_shape(value)
    if shape is None or value.dtype not in _NUMPY_DTYPES:
        return None
    return dtypes.nbytes(value.dtype, shape)


def _materialize(node: ir.Node, value: np.ndarray, ctx: RuleContext) -> None:
    """``node``'s output becomes the initializer ``value`` (int64 shape values, bool tests)."""
    out = node.outputs[0]
    namer = cast("ConstantFolding", ctx.pass_).namer
    assert namer is not None
    const = u.add_initializer(ctx.graph, value, namer(f"{out.name or 'shape'}_folded"))
    replace(out, const, node.op_type)


_BUDGET = (
    "its bytes exceed fold_max_tensor_bytes, or the bytes of the constants it makes dead plus "
    "fold_max_growth_bytes (a ConstantOfShape/Tile/Expand blow-up stays a node)"
)

RULES: tuple[Rule, ...] = (
    Rule(
        "shape",
        "Shape(x, start, end) -> the constant dims[start:end] when they are all static",
        ("Shape",),
        check_shape,
        _materialize,
    ),
    Rule(
        "size",
        "Size(x) -> the constant prod(dims) when x's shape is static",
        ("Size",),
        check_size,
        _materialize,
    ),
    Rule(
        "gather-shape",
        "Gather(Shape(x, start, end), i, axis=0) -> the constant dims[start:end][i] when the "
        "gathered dims are static (others may be symbolic)",
        ("Gather",),
        check_gather_shape,
        _materialize,
    ),
    Rule(
        "slice-shape",
        "Slice(Shape(x, start, end), [s], [e], axes=[0], steps=[1]) -> the constant "
        "dims[start:end][s:e] when those dims are static",
        ("Slice",),
        check_slice_shape,
        _materialize,
    ),
    *(
        Rule(
            f"{op.lower()}-dims",
            f"{op}(a, b) of int64 shape entries (dims read from tensors, sizes) -> the constant "
            "result when it is a size for every value of the dims (a sum whose names cancel, "
            "(64*batch) / batch): nothing else is folded from a symbolic dim",
            (op,),
            check_dims_arithmetic,
            _materialize,
        )
        for op in ("Sub", "Div")
    ),
    Rule(
        "equal-dims",
        "Equal(s, c) -> the constant it is, for a shape s read entry by entry and a constant "
        "int64 c, where each entry is constant, a static dim, or a dim compared with a negative "
        "number (dims are never negative)",
        ("Equal",),
        check_equal_dims,
        _materialize,
    ),
    Rule(
        "fold",
        "f(c1, ..., cn) -> the constant it evaluates to (in numpy where exact, else with "
        "onnxruntime's kernels) for deterministic standard ops of numpy-held dtypes whose inputs "
        "are all constants, except DequantizeLinear and ops with subgraphs; a value that is a "
        "graph output stays; counted per value the rest of the graph reads",
    ),
    Rule(
        "fill",
        "f(c1, ..., cn) -> ConstantOfShape(shape, v) for a constant value over the growth budget "
        "whose elements all equal v (static shape; two nodes or more replaced): the same tensor "
        "in a few bytes",
    ),
    Rule(
        "fold-pooled",
        "f(c1, ..., cn) -> the constant it evaluates to, for a value over the per-value growth "
        "budget (and no uniform fill) whose growth the run's pool still holds "
        "(fold_max_growth_ratio of the model's initializer bytes); counted per value",
    ),
    Rule(
        "skipped-over-budget",
        f"not folded (the nodes stay, results unchanged): a constant value whose {_BUDGET}",
    ),
    Rule(
        "skipped-unevaluable",
        "not folded (the nodes stay, results unchanged): a constant value onnxruntime cannot "
        "evaluate",
    ),
)
_SHAPE_RULES = {rule.ops[0]: rule for rule in RULES if rule.ops}


class ConstantFolding(RulePass):
    name = "constant-folding"
    summary = "evaluate constant subgraphs (shape arithmetic included) under a byte budget"
    rules = RULES
    resolves_shapes = True

    def __init__(self, options: object = None) -> None:
        super().__init__(options)
        # values evaluated over budget that are no uniform fill: not evaluated again (the pass
        # instance lives for one optimization)
        self.not_fills: set[int] = set()
        # bytes the folds of this run may still grow the model by beyond the per-value budget
        self.pool: int | None = None

    def apply(self, model: ir.Model) -> bool:
        changed = False
        if self.pool is None:
            weights = sum(
                u.const_nbytes(v) for g in u.all_graphs(model) for v in g.initializers.values()
            )
            self.pool = int(weights * self.options.fold_max_growth_ratio)
        self.namer: u.NameGenerator | None = None
        for graph in u.all_graphs(model):
            if self.namer is None:
                self.namer = u.NameGenerator(model)
            changed |= self._fold_shapes(model, graph)
            changed |= self._fold_graph(model, graph, self.namer)
        return changed

    def _fold_shapes(self, model: ir.Model, graph: ir.Graph) -> bool:
        """Shape arithmetic, node by node in graph order."""
        changed = False
        for node in u.nodes_in_order(graph):
            if node.graph is None or not u.is_standard(node):
                continue
            rule = _SHAPE_RULES.get(node.op_type)
            if rule is not None:
                changed |= self.try_rule(rule, node, RuleContext(model, graph, self))
        return changed

    # ------------------------------------------------------------ evaluation with onnxruntime

    def _foldable(self, node: ir.Node, folded: set[int]) -> bool:
        if not u.is_standard(node) or node.op_type in _NEVER_FOLD or u.has_subgraph(node):
            return False
        if not node.inputs or not node.outputs:
            return False
        for v in node.inputs:
            if v is None:
                continue
            if id(v) in folded:
                continue
            if not u.is_constant(v) or (v.dtype is not None and v.dtype not in _NUMPY_DTYPES):
                return False
        for out in node.outputs:
            if not u.is_tensor_value(out) or out.dtype is None or out.dtype not in _NUMPY_DTYPES:
                return False
        if node.op_type in _EXPANDING:
            sizes = [_static_nbytes(o) for o in node.outputs]
            if any(s is None or s > self.options.fold_max_tensor_bytes for s in sizes):
                return False
        return True

    def _fold_graph(self, model: ir.Model, graph: ir.Graph, namer: u.NameGenerator) -> bool:
        foldable: list[ir.Node] = []
        produced: set[int] = set()
        for node in graph:
            if self._foldable(node, produced):
                foldable.append(node)
                produced.update(id(o) for o in node.outputs)
        if not foldable:
            return False
        in_set = {id(n) for n in foldable}
        frontier: list[ir.Value] = []
        for node in foldable:
            for out in node.outputs:
                if out.is_graph_output():
                    continue
                if any(id(user) not in in_set for user, _ in out.uses()):
                    frontier.append(out)
        if not frontier:
            return False
        order = {id(n): i for i, n in enumerate(graph)}
        plans = [p for p in (self._plan(v, in_set, order) for v in frontier) if p is not None]
        if not plans:
            return False
        results = self._evaluate(model, plans)
        changed = False
        for (value, closure, const_inputs), array in zip(plans, results, strict=True):
            if array is None:
                continue
            growth = self._growth(array, closure, const_inputs)
            pooled = False
            if growth is None or growth > self.options.fold_max_growth_bytes:
                if self._fill(graph, value, array, closure, namer):
                    changed = True
                    continue
                if growth is None or growth > (self.pool or 0):
                    self.hit("skipped-over-budget")
                    continue
                pooled = True
            name = value.name or "folded"
            assert value.dtype is not None  # checked by _foldable
            const = u.add_initializer(
                graph, array.astype(value.dtype.numpy(), copy=False), namer(f"{name}_folded")
            )
            if u.replace_value(value, const):
                if pooled:
                    assert growth is not None and self.pool is not None
                    self.pool -= growth
                    logger.debug("folded %s from the growth pool: %d bytes", name, growth)
                self.hit("fold-pooled" if pooled else "fold")
                changed = True
            else:
                graph.initializers.pop(const.name or "")
        return changed

    def _plan(self, value: ir.Value, in_set: set[int], order: dict[int, int]) -> Plan | None:
        """The nodes computing ``value`` (in graph order) and the constants they read."""
        closure: dict[int, ir.Node] = {}
        consts: dict[int, ir.Value] = {}
        stack = [value.producer()]
        while stack:
            node = stack.pop()
            if node is None or id(node) in closure or id(node) not in in_set:
                continue
            closure[id(node)] = node
            for v in node.inputs:
                if v is None:
                    continue
                p = v.producer()
                if p is not None and id(p) in in_set:
                    stack.append(p)
                else:
                    consts[id(v)] = v
        const_bytes = sum(u.const_nbytes(v) for v in consts.values())
        if const_bytes > self.options.fold_max_input_bytes:
            return None
        estimate = _static_nbytes(value)
        if estimate is not None and estimate > self.options.fold_max_tensor_bytes:
            return None
        # at most the constants read can become dead: a larger result would grow the model,
        # so it is not even computed, unless it may be a fill (computed once to find out)
        allowance = self.options.fold_max_growth_bytes + (self.pool or 0)
        if estimate is not None and estimate > const_bytes + allowance:
            if (
                len(closure) < 2
                or estimate > _FILL_PROBE_BYTES
                or id(value) in self.not_fills
                or u.static_shape(value) is None
            ):
                self.hit("skipped-over-budget")
                return None
        nodes = sorted(closure.values(), key=lambda n: order.get(id(n), 0))
        return value, nodes, list(consts.values())

    def _fill(
        self,
        graph: ir.Graph,
        value: ir.Value,
        array: np.ndarray,
        closure: Sequence[ir.Node],
        namer: u.NameGenerator,
    ) -> bool:
        """``value`` as a ``ConstantOfShape`` fill when every element of ``array`` is equal and
        that replaces two nodes or more; remembers the values that are no fill."""
        shape = u.static_shape(value)
        flat = array.reshape(-1)
        uniform = (
            len(closure) >= 2
            and shape is not None
            and list(array.shape) == list(shape)
            and flat.size > 0
            and bool(np.all(flat == flat[0]))  # NaN is never equal: no NaN fill
        )
        if not uniform:
            self.not_fills.add(id(value))
            return False
        assert value.dtype is not None and shape is not None
        dims = u.add_initializer(graph, np.array(shape, dtype=np.int64), namer("fill_shape"))
        element = dtypes.tensor(flat[:1].astype(value.dtype.numpy(), copy=True))
        node = ir.Node(
            "",
            "ConstantOfShape",
            [dims],
            [ir.AttrTensor("value", element)],
            name=namer(f"{value.name or 'value'}_fill"),
        )
        graph.insert_before(closure[-1], node)
        out = node.outputs[0]
        out.name = namer(f"{value.name or 'value'}_fill")
        out.shape = ir.Shape(shape)
        out.type = ir.TensorType(value.dtype)
        if not u.replace_value(value, out):
            graph.remove(node)
            graph.initializers.pop(dims.name or "")
            self.not_fills.add(id(value))
            return False
        self.hit("fill")
        return True

    def _growth(
        self, array: np.ndarray, closure: Sequence[ir.Node], consts: Sequence[ir.Value]
    ) -> int | None:
        """The bytes folding ``array`` adds to the model (those of the constants it makes dead
        subtracted); ``None`` when it is over ``fold_max_tensor_bytes``."""
        if array.nbytes > self.options.fold_max_tensor_bytes:
            return None
        members = {id(n) for n in closure}
        freed = 0
        for c in consts:
            if c.is_graph_output() or c.is_graph_input():
                continue
            if all(id(user) in members for user, _ in c.uses()):
                freed += u.const_nbytes(c)
        return int(array.nbytes) - freed

    def _evaluate(self, model: ir.Model, plans: Sequence[Plan]) -> list[np.ndarray | None]:
        """Evaluate every planned value: in numpy when every op is one it computes exactly,
        else in one onnxruntime session; if that fails, one session per value."""
        exact = run_numpy(plans)
        if exact is not None:
            return exact
        try:
            return run_onnxruntime(model, plans)
        except Exception as exc:
            logger.debug("batched folding failed (%s); folding value by value", exc)
        out: list[np.ndarray | None] = []
        for plan in plans:
            try:
                out.extend(run_onnxruntime(model, [plan]))
            except Exception as exc:
                logger.debug("cannot fold %s: %s", plan[0].name, exc)
                self.hit("skipped-unevaluable")
                out.append(None)
        return out
