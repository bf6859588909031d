"""Transposes moved through the layout-agnostic ops between them, where they then cancel.

Exporters of channels-last frameworks (tf2onnx from Keras, TFLite converters) wrap each Conv
in ``Transpose(NHWC -> NCHW)`` and ``Transpose(NCHW -> NHWC)`` and compute everything between
two Convs (normalization scales, activations, residual adds, padding, squeeze-and-excite
means) channels-last. For every op ``f`` here, ``f(Transpose(x, p)) = Transpose(f'(x), p)``:
``f'`` is ``f`` with its axes renamed through ``p`` (a reduction over axis ``a`` reduces axis
``p[a]``; a pad of axis ``a`` pads axis ``p[a]``; Softmax and Concat likewise) and its
constant operands transposed back (``c' = Transpose(c, argsort(p))`` after ``c`` is given
``x``'s rank by leading 1s: broadcasting commutes with permuting the axes). Elementwise ops
act on each element alone, so the element moves and the value do not interact.

A *region* is grown from a Transpose ``T(p)``: the ops reading a value of the region (all of
whose other inputs are constants, other ``Transpose(p)`` outputs or values of the region) join
it. Then ``T`` and the other entries are dropped (their inputs read directly), every op of the
region computes in ``x``'s layout, each Transpose ``E(q)`` reading the region takes
``Transpose(p)`` composed with its own (none at all where they cancel), and each other reader
of a region value gets ``Transpose(p)`` back. The rewrite is made only where it removes nodes:
entries dropped plus Transposes cancelled exceed the Transposes put back. Exact: data is
moved, never recomputed.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.framework import GraphtrimPass
from graphtrim.graph.rules import Rule, reroute_refusal

_UNARY = frozenset(
    {"Relu", "Sigmoid", "Tanh", "HardSigmoid", "HardSwish", "LeakyRelu", "Elu", "Selu", "Celu",
     "Neg", "Abs", "Exp", "Log", "Sqrt", "Reciprocal", "Erf", "Softplus", "Softsign", "Floor",
     "Ceil", "Round", "Sign", "Not", "Cast", "Identity", "Gelu", "Mish", "Clip"}
)  # fmt: skip
_BROADCAST = frozenset(
    {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "PRelu", "Equal", "Greater", "Less",
     "GreaterOrEqual", "LessOrEqual", "And", "Or", "Where"}
)  # fmt: skip
_REDUCE = frozenset(
    {"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
     "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"}
)  # fmt: skip
_AXIS = frozenset({"Softmax", "LogSoftmax", "Hardmax", "Concat"})

RULES: tuple[Rule, ...] = (
    Rule(
        "transpose-sink",
        "f(Transpose(x, p)) -> Transpose(f'(x), p) for elementwise, broadcasting (constants c "
        "-> Transpose(c, argsort(p)) at x's rank), Pad (pads of axis a -> axis p[a]), "
        "reductions with keepdims and Softmax/Concat (axis a -> p[a]) ops; applied to a whole "
        "region between Transposes, whose Transposes then compose or cancel, where that "
        "removes nodes (entries dropped + Transposes cancelled > Transposes put back)",
        ("Transpose",),
    ),
)


def _perm(node: ir.Node) -> list[int] | None:
    if not u.is_op(node, "Transpose") or node.inputs[0] is None:
        return None
    if "perm" in node.attributes:
        return list(node.attributes["perm"].as_ints())
    r = u.rank(node.inputs[0])
    return list(range(r))[::-1] if r is not None else None


class _Region:
    """The nodes between the entries ``Transpose(p)`` and the region's readers."""

    def __init__(self, entry: ir.Node, perm: list[int], opset: int) -> None:
        self.perm, self.opset = perm, opset
        self.entries: list[ir.Node] = []
        self.nodes: list[ir.Node] = []
        self.values: set[ir.Value] = set()
        self.exits: list[ir.Node] = []  # Transposes reading a region value
        self.leaks: dict[ir.Value, list[tuple[ir.Node, int]]] = {}
        self.failed: str | None = None
        self._grow(entry)

    def _is_entry(self, value: ir.Value | None) -> bool:
        node = value.producer() if value is not None else None
        return node is not None and node.graph is not None and _perm(node) == self.perm

    def _grow(self, first: ir.Node) -> None:
        work = [first]
        while work and self.failed is None:
            node = work.pop()
            if node in self.nodes or node in self.entries:
                continue
            if u.is_op(node, "Transpose"):
                self.entries.append(node)
            else:
                self.nodes.append(node)
            for out in node.outputs:
                if out.is_graph_output():
                    self.failed = "a region value is a graph output"
                    return
                self.values.add(out)
            entry = u.is_op(node, "Transpose")
            for out in node.outputs:
                for user, index in out.uses():
                    if user in self.nodes or user in self.exits:
                        continue
                    if user.graph is not first.graph:
                        self.failed = "a region value is read in a subgraph"
                        return
                    if u.is_op(user, "Transpose") and _perm(user) is not None:
                        self.exits.append(user)
                    elif self._admits(user, index):
                        work.append(user)
                        work.extend(
                            v.producer()  # type: ignore[misc]
                            for v in user.inputs
                            if v is not None and v not in self.values and self._is_entry(v)
                        )
                    elif not entry:  # an entry's other readers keep the entry
                        self.leaks.setdefault(out, []).append((user, index))
        # a reader taken as an exit or a leak that joined the region later is neither
        self.exits = [e for e in self.exits if e not in self.nodes and e not in self.entries]
        self.leaks = {
            v: [(n, i) for n, i in users if n not in self.nodes] for v, users in self.leaks.items()
        }
        self.leaks = {v: users for v, users in self.leaks.items() if users}

    def _operand_ok(self, value: ir.Value | None) -> bool:
        if value is None or value in self.values or self._is_entry(value):
            return True
        c = u.const_array(value)
        return c is not None and c.ndim <= len(self.perm)

    def _admits(self, node: ir.Node, index: int) -> bool:
        """An op that computes the same in ``x``'s layout once renamed (see the module), read
        at ``index``."""
        if not u.is_standard(node) or u.has_subgraph(node) or not node.outputs:
            return False
        op, ins = node.op_type, node.inputs
        if index != 0 and op not in _BROADCAST and op != "Concat":
            return False  # a region value as an op's parameter (its pads, its axes)
        if op in _UNARY:
            return all(self._operand_ok(v) for v in ins[:1]) and all(
                v is None or u.is_constant(v) for v in ins[1:]
            )
        if op in _BROADCAST or op == "Concat":
            return all(self._operand_ok(v) for v in ins)
        if op in _REDUCE:
            return node.attributes.get_int("keepdims", 1) == 1 and self._axes(node) is not None
        if op in ("Softmax", "LogSoftmax", "Hardmax"):
            return self.opset >= 13
        if op == "Pad":
            return self._pads(node) is not None
        return False

    def _axes(self, node: ir.Node) -> list[int] | None:
        return u.ints_given(node, "axes", 1)

    def _pads(self, node: ir.Node) -> list[int] | None:
        r = len(self.perm)
        if node.attributes.get_string("mode", "constant") not in ("constant", "reflect", "edge"):
            return None
        # none given, or not constant: [] fits no rank
        pads = u.ints_given(node, "pads", 1) or []
        if len(node.inputs) > 3 and node.inputs[3] is not None:
            return None  # an axes input: left alone
        return pads if len(pads) == 2 * r else None

    def gain(self) -> int:
        removable = sum(self.removable(e) for e in self.entries)
        cancelled = sum(self._composed(e) == list(range(len(self.perm))) for e in self.exits)
        return removable + cancelled - len(self.leaks)

    def removable(self, entry: ir.Node) -> bool:
        out = entry.outputs[0]
        return not out.is_graph_output() and all(
            user in self.nodes or user in self.exits for user, _ in out.uses()
        )

    def source(self, value: ir.Value) -> ir.Value:
        """What a reader of ``value`` reads in ``x``'s layout (an entry's input for its output)."""
        for e in self.entries:
            if e.outputs[0] is value and e.inputs[0] is not None:
                return e.inputs[0]
        return value

    def _composed(self, exit_node: ir.Node) -> list[int]:
        q = _perm(exit_node)
        assert q is not None
        return [self.perm[i] for i in q]


def _rewrite(region: _Region, graph: ir.Graph, names: u.NameGenerator) -> None:
    p = region.perm
    r = len(p)
    back = [int(i) for i in np.argsort(p)]  # Transpose(c', p) == c for c' = Transpose(c, back)
    moved = [0] * r  # axis a of the transposed layout is axis moved[a] = p[a] of x's
    for a in range(r):
        moved[a] = p[a]
    entry_inputs = {e.outputs[0]: e.inputs[0] for e in region.entries}

    def operand(value: ir.Value) -> ir.Value:
        if value in entry_inputs:
            return entry_inputs[value]  # type: ignore[return-value]
        if value in region.values:
            return value
        c = u.const_array(value)
        assert c is not None
        if c.ndim == 0 or (c.size == 1 and c.ndim <= 1):
            return value
        full = c.reshape((1,) * (r - c.ndim) + c.shape)
        return u.add_initializer(graph, np.transpose(full, back), names(f"{value.name}_moved"))

    for node in region.nodes:
        op = node.op_type
        data = (
            range(len(node.inputs))
            if op in _BROADCAST or op == "Concat"
            else range(min(1, len(node.inputs)))
        )
        for i in data:
            v = node.inputs[i]
            if v is not None:
                node.replace_input_with(i, operand(v))
        if op in _REDUCE:
            axes = region._axes(node)
            assert axes is not None
            if axes:
                new = [moved[a % r] for a in axes]
                if "axes" in node.attributes:
                    node.attributes["axes"] = ir.AttrInt64s("axes", new)
                else:
                    arr = np.array(new, dtype=np.int64)
                    node.replace_input_with(1, u.add_initializer(graph, arr, names("axes_moved")))
        elif op in _AXIS:
            axis = node.attributes.get_int("axis", -1 if op != "Concat" else 0)
            node.attributes["axis"] = ir.AttrInt64("axis", moved[axis % r])
        elif op == "Pad":
            pads = region._pads(node)
            assert pads is not None
            new_pads = [0] * (2 * r)
            for a in range(r):
                new_pads[moved[a]], new_pads[r + moved[a]] = pads[a], pads[r + a]
            if "pads" in node.attributes:
                node.attributes["pads"] = ir.AttrInt64s("pads", new_pads)
            else:
                arr = np.array(new_pads, dtype=np.int64)
                node.replace_input_with(1, u.add_initializer(graph, arr, names("pads_moved")))
        for out in node.outputs:  # its dims in x's layout
            if out.shape is not None and len(out.shape) == r:
                dims = list(out.shape.dims)
                out.shape = ir.Shape([dims[back[j]] for j in range(r)])
    identity = list(range(r))
    for e in region.exits:
        composed = region._composed(e)
        src = operand(e.inputs[0])  # type: ignore[arg-type]
        if composed == identity:
            u.replace_value(e.outputs[0], src)
        else:
            e.replace_input_with(0, src)
            e.attributes["perm"] = ir.AttrInt64s("perm", composed)
    for value, users in region.leaks.items():
        t = ir.node("Transpose", [value], attributes={"perm": p}, name=names("Transpose_back"))
        t.outputs[0].name = names(f"{value.name}_back")
        graph.insert_after(value.producer(), t)  # type: ignore[arg-type]
        for user, index in users:
            user.replace_input_with(index, t.outputs[0])
    dead = [e for e in region.entries if not e.outputs[0].uses()]
    dead += [e for e in region.exits if not e.outputs[0].uses()]
    u.remove_nodes(graph, [n for n in dead if not n.outputs[0].is_graph_output()])


class TransposeSinking(GraphtrimPass):
    name = "transpose-sink"
    summary = "move Transposes through layout-agnostic ops to where they cancel"
    rules = RULES

    def apply(self, model: ir.Model) -> bool:
        changed = False
        names: u.NameGenerator | None = None
        opset = u.opset_version(model)
        graph = model.graph
        for node in list(graph):
            if node.graph is not graph:
                continue  # removed by an earlier rewrite
            p = _perm(node)
            if p is None or p == list(range(len(p))):
                continue
            region = _Region(node, p, opset)
            if region.failed is not None or not region.nodes or region.gain() <= 0:
                continue
            if any(
                reroute_refusal(e.outputs[0], region.source(e.inputs[0])) is not None  # type: ignore[arg-type]
                for e in region.exits
                if e.outputs[0].is_graph_output()
            ):
                continue
            names = names or u.NameGenerator(model)
            self.hit("transpose-sink")
            _rewrite(region, graph, names)
            changed = True
        return changed
