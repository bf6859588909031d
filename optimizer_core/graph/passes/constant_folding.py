"""Constant folding with a size budget.

Every node whose inputs are all constants is evaluated once, with onnxruntime's own kernels (the
runtime that verifies the result), in one session per graph and iteration: the nodes to fold form
a small model whose inputs are the constants it reads and whose outputs are the values read by the
rest of the graph (the frontier). Each frontier value is then materialized only if the model does
not grow: its bytes must not exceed the bytes of the constants that become dead plus
``fold_max_growth_bytes`` (so ``ConstantOfShape``/``Tile``/``Expand`` blow-ups stay as nodes), and
never more than ``fold_max_tensor_bytes``.

Shape arithmetic is folded without running anything: ``Shape(x)`` and ``Size(x)`` when the dims
they read are static, and ``Gather(Shape(x), i)`` when the gathered dims are static even if
others are symbolic.

Never folded: non-deterministic ops, ``DequantizeLinear`` (quantized weights stay quantized),
ops with subgraphs, ops of non-standard domains, values that are graph outputs, and values whose
dtype numpy cannot hold.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np
import onnx
import onnx_ir as ir

from optimizer_core.graph import _ir_utils as u
from optimizer_core.graph.framework import GraphtrimPass
from optimizer_core.graph.passes import _numpy_eval

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


def _static_nbytes(value: ir.Value) -> int | None:
    shape = u.static_shape(value)
    if shape is None or value.dtype is None or value.dtype not in _NUMPY_DTYPES:
        return None
    return int(math.prod(shape) * value.dtype.itemsize)


def _shape_range(src: ir.Node, r: int) -> tuple[int, int]:
    start = src.attributes.get_int("start", 0)
    end = src.attributes.get_int("end", r)
    start = min(max(start + r if start < 0 else start, 0), r)
    end = min(max(end + r if end < 0 else end, 0), r)
    return start, end


def _slice_of_shape(node: ir.Node, src: ir.Node, d: list[int | None]) -> list[int | None] | None:
    """The dims ``Slice(Shape(x), ...)`` selects, when its arguments are constants."""
    starts, ends = u.const_ints(node.inputs[1]), u.const_ints(node.inputs[2])
    axes = (
        u.const_ints(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else [0]
    )
    steps = (
        u.const_ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else [1]
    )
    if starts is None or ends is None or axes is None or steps is None:
        return None
    if len(starts) != 1 or len(ends) != 1 or axes not in ([0], [-1]) or steps != [1]:
        return None
    start, end = _shape_range(src, len(d))
    # step 1: ONNX clamps start and end like Python slicing does
    return d[start:end][starts[0] : ends[0]]


class ConstantFolding(GraphtrimPass):
    name = "constant-folding"
    summary = "evaluate constant subgraphs (shape arithmetic included) under a byte budget"

    def apply(self, model: ir.Model) -> bool:
        changed = False
        namer: u.NameGenerator | None = None
        for graph in u.all_graphs(model):
            if namer is None:
                namer = u.NameGenerator(model)
            changed |= self._fold_shapes(graph, namer)
            changed |= self._fold_graph(model, graph, namer)
        return changed

    # ------------------------------------------------------------ shape arithmetic

    def _fold_shapes(self, graph: ir.Graph, namer: u.NameGenerator) -> bool:
        changed = False
        for node in u.nodes_in_order(graph):
            if node.graph is None or not u.is_standard(node) or not node.outputs:
                continue
            out = node.outputs[0]
            if out.is_graph_output() or u.is_constant(out):
                continue
            value: np.ndarray | None = None
            rule = ""
            if node.op_type == "Shape":
                d = u.dims(node.inputs[0])
                if d is None:
                    continue
                r = len(d)
                start = node.attributes.get_int("start", 0)
                end = node.attributes.get_int("end", r)
                start = min(max(start + r if start < 0 else start, 0), r)
                end = min(max(end + r if end < 0 else end, 0), r)
                picked = d[start:end]
                if all(x is not None for x in picked):
                    value, rule = np.array(picked, dtype=np.int64), "shape"
            elif node.op_type == "Size":
                s = u.static_shape(node.inputs[0])
                if s is not None:
                    value, rule = np.array(int(np.prod(s, dtype=np.int64)), dtype=np.int64), "size"
            elif node.op_type == "Gather" and node.inputs[0] is not None:
                src = node.inputs[0].producer()
                if (
                    src is None
                    or not u.is_op(src, "Shape")
                    or node.attributes.get_int("axis", 0) != 0
                ):
                    continue
                d = u.dims(src.inputs[0])
                idx = u.const_array(node.inputs[1])
                if d is None or idx is None or idx.dtype.kind not in "iu":
                    continue
                r = len(d)
                start = src.attributes.get_int("start", 0)
                end = src.attributes.get_int("end", r)
                start = min(max(start + r if start < 0 else start, 0), r)
                end = min(max(end + r if end < 0 else end, 0), r)
                sliced = d[start:end]
                flat = [int(i) + len(sliced) if int(i) < 0 else int(i) for i in idx.reshape(-1)]
                if not all(0 <= i < len(sliced) and sliced[i] is not None for i in flat):
                    continue
                value = np.array([sliced[i] for i in flat], dtype=np.int64).reshape(idx.shape)
                rule = "gather-shape"
            elif node.op_type == "Slice" and node.inputs[0] is not None and len(node.inputs) >= 3:
                src = node.inputs[0].producer()
                d = u.dims(src.inputs[0]) if src is not None and u.is_op(src, "Shape") else None
                if d is None or src is None:
                    continue
                sel = _slice_of_shape(node, src, d)
                if sel is None or any(x is None for x in sel):
                    continue
                value, rule = np.array(sel, dtype=np.int64), "slice-shape"
            if value is None:
                continue
            const = u.add_initializer(graph, value, namer(f"{out.name or 'shape'}_folded"))
            if u.replace_value(out, const):
                self.hit(rule)
                changed = True
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
            if not self._within_budget(array, closure, const_inputs):
                self.hit("skipped-over-budget")
                continue
            name = value.name or "folded"
            assert value.dtype is not None  # checked by _foldable
            const = u.add_initializer(
                graph, array.astype(value.dtype.numpy(), copy=False), namer(f"{name}_folded")
            )
            if u.replace_value(value, const):
                self.hit("fold")
                changed = True
            else:
                graph.initializers.pop(const.name or "")
        return changed

    def _plan(
        self, value: ir.Value, in_set: set[int], order: dict[int, int]
    ) -> tuple[ir.Value, list[ir.Node], list[ir.Value]] | None:
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
        # so it is not even computed
        if estimate is not None and estimate > const_bytes + self.options.fold_max_growth_bytes:
            self.hit("skipped-over-budget")
            return None
        nodes = sorted(closure.values(), key=lambda n: order.get(id(n), 0))
        return value, nodes, list(consts.values())

    def _within_budget(
        self, array: np.ndarray, closure: Sequence[ir.Node], consts: Sequence[ir.Value]
    ) -> bool:
        if array.nbytes > self.options.fold_max_tensor_bytes:
            return False
        members = {id(n) for n in closure}
        freed = 0
        for c in consts:
            if c.is_graph_output() or c.is_graph_input():
                continue
            if all(id(user) in members for user, _ in c.uses()):
                freed += u.const_nbytes(c)
        return array.nbytes <= freed + self.options.fold_max_growth_bytes

    def _evaluate(
        self, model: ir.Model, plans: Sequence[tuple[ir.Value, list[ir.Node], list[ir.Value]]]
    ) -> list[np.ndarray | None]:
        """Evaluate every planned value: in numpy when every op is one it computes exactly,
        else in one onnxruntime session; if that fails, one session per value."""
        exact = self._run_numpy(plans)
        if exact is not None:
            return exact
        try:
            return self._run(model, plans)
        except Exception as exc:
            logger.debug("batched folding failed (%s); folding value by value", exc)
        out: list[np.ndarray | None] = []
        for plan in plans:
            try:
                out.extend(self._run(model, [plan]))
            except Exception as exc:
                logger.debug("cannot fold %s: %s", plan[0].name, exc)
                self.hit("skipped-unevaluable")
                out.append(None)
        return out

    def _run_numpy(
        self, plans: Sequence[tuple[ir.Value, list[ir.Node], list[ir.Value]]]
    ) -> list[np.ndarray | None] | None:
        nodes: dict[int, ir.Node] = {}
        feeds: dict[int, np.ndarray] = {}
        for _, closure, const_inputs in plans:
            for n in closure:
                nodes[id(n)] = n
            for c in const_inputs:
                arr = u.const_array(c)
                if arr is None:
                    return None
                feeds[id(c)] = arr
        graph = plans[0][0].graph
        order = {id(n): i for i, n in enumerate(graph)} if graph is not None else {}
        ordered = sorted(nodes.values(), key=lambda n: order.get(id(n), 0))
        results = _numpy_eval.evaluate(ordered, feeds, [value for value, _, _ in plans])
        if results is None:
            return None
        for (value, _, _), arr in zip(plans, results, strict=True):
            if value.dtype is None or arr.dtype != value.dtype.numpy():
                return None
        logger.debug("folded %d value(s) in numpy", len(results))
        return list(results)

    def _run(
        self, model: ir.Model, plans: Sequence[tuple[ir.Value, list[ir.Node], list[ir.Value]]]
    ) -> list[np.ndarray | None]:
        import onnxruntime as ort

        names: dict[int, str] = {}

        def name_of(v: ir.Value) -> str:
            if id(v) not in names:
                names[id(v)] = f"v{len(names)}"
            return names[id(v)]

        nodes: dict[int, ir.Node] = {}
        consts: dict[int, ir.Value] = {}
        for _, closure, const_inputs in plans:
            for n in closure:
                nodes[id(n)] = n
            for c in const_inputs:
                consts[id(c)] = c
        graph = plans[0][0].graph
        order = {id(n): i for i, n in enumerate(graph)} if graph is not None else {}
        node_protos: list[onnx.NodeProto] = []
        for n in sorted(nodes.values(), key=lambda n: order.get(id(n), 0)):
            proto = ir.serde.serialize_node(n)
            proto.ClearField("input")
            proto.ClearField("output")
            proto.input.extend(name_of(v) if v is not None else "" for v in n.inputs)
            proto.output.extend(name_of(v) for v in n.outputs)
            proto.name = f"n{len(node_protos)}"
            node_protos.append(proto)
        feeds: dict[str, np.ndarray] = {}
        inputs = []
        for c in consts.values():
            arr = u.const_array(c)
            if arr is None:
                raise ValueError(f"constant {c.name} is not readable")
            feeds[name_of(c)] = np.require(arr, requirements="C")
            inputs.append(
                onnx.helper.make_tensor_value_info(
                    name_of(c), onnx.helper.np_dtype_to_tensor_dtype(arr.dtype), list(arr.shape)
                )
            )
        outputs = []
        seen_out: set[str] = set()
        for value, _, _ in plans:
            nm = name_of(value)
            if nm in seen_out:
                continue
            seen_out.add(nm)
            outputs.append(onnx.helper.make_tensor_value_info(nm, int(value.dtype), None))  # type: ignore[arg-type]
        opsets = [
            onnx.helper.make_opsetid(d if d != "ai.onnx" else "", v)
            for d, v in model.opset_imports.items()
        ]
        proto_model = onnx.helper.make_model(
            onnx.helper.make_graph(node_protos, "fold", inputs, outputs),
            opset_imports=opsets,
            ir_version=max(model.ir_version or 8, 4),
        )
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.log_severity_level = 3
        sess = ort.InferenceSession(
            proto_model.SerializeToString(), so, providers=["CPUExecutionProvider"]
        )
        results = dict(zip([o.name for o in outputs], sess.run(None, feeds), strict=True))
        return [np.asarray(results[name_of(value)]) for value, _, _ in plans]
