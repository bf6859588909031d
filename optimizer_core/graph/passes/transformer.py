"""Decomposed transformer blocks replaced by the standard fused ops the model's opset has.

Each rule matches what exporters emit for the block (operands of commutative ops in either
order, intermediate values read by the pattern alone) and fires only when the model imports an
opset that defines the fused op; ``graphtrim optimize --opset N`` raises the opset first.

- ``layernorm`` (LayerNormalization, opset 17)::

      m = ReduceMean(x, axes=[-1]);  d = x - m;  v = ReduceMean(d * d  or  d ** 2, axes=[-1])
      y = d / Sqrt(v + eps)  (or d * Reciprocal(Sqrt(v + eps)))  [* gamma] [+ beta]

  equals ``LayerNormalization(x, gamma, beta, axis=-1, epsilon=eps)``: the op computes the
  same mean and biased variance, in float32 (``stash_type=1``). Tolerance: relative 1e-5
  (the fused kernel sums in another order).

- ``rmsnorm`` (RMSNormalization, opset 23)::

      y = x / Sqrt(ReduceMean(x ** 2, axes=[-1]) + eps)  [* w]

  equals ``RMSNormalization(x, w, axis=-1, epsilon=eps)``. Tolerance: relative 1e-5.

- ``attention`` (Attention, opset 23)::

      Softmax(Q @ Transpose(K) * scale  [+ mask], axis=-1) @ V

  on rank-4 ``[batch, heads, seq, head]`` float tensors (the scale may sit on the product or
  be split between ``Q`` and ``K``, as exporters of scaled dot-product attention write it;
  ``K`` may arrive as ``[batch, seq, heads, head]`` transposed in one step) equals
  ``Attention(Q, K, V, mask, scale=scale)``. A mask must span the query and key lengths in its
  last two dims (onnxruntime's kernel broadcasts it over batch and heads only). Patterns guarded against fully masked rows
  (``Where(IsNaN(p), 0, p)``) are left alone: the op does not promise that guard. Tolerance:
  relative 1e-5.

- ``gelu-erf`` (Gelu, opset 20): ``x * 0.5 * (1 + Erf(x / sqrt(2)))`` in any association of the
  two products equals ``Gelu(x)``; ``gelu-tanh``:
  ``x * 0.5 * (1 + Tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3)))`` equals
  ``Gelu(x, approximate="tanh")``. Constants must match to 1e-4 relative (exporters round them
  to float32). Tolerance: relative 1e-5.

For the ``tensorrt`` target the Gelu and RMSNormalization rules stay off (TensorRT's parser
does not take those ops and fuses the decomposed patterns itself).

The rewritten model differs from the decomposed one by rounding only; the pass is not in the
``safe`` preset.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from optimizer_core.graph import _ir_utils as u
from optimizer_core.graph.framework import GraphtrimPass
from optimizer_core.graph.targets import emits_allowed

_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE})


def _scalar(value: ir.Value | None) -> float | None:
    arr = u.const_array(value)
    if arr is None or arr.size != 1 or arr.dtype.kind != "f":
        return None
    return float(arr.reshape(-1)[0])


def _close(a: float | None, b: float, rel: float = 1e-4) -> bool:
    return a is not None and abs(a - b) <= rel * abs(b)


def _split_const(node: ir.Node) -> tuple[ir.Value, ir.Value] | None:
    """(variable operand, constant operand) of a binary node with exactly one constant input."""
    if len(node.inputs) != 2:
        return None
    a, b = node.inputs
    if a is None or b is None:
        return None
    if u.is_constant(b) and not u.is_constant(a):
        return a, b
    if u.is_constant(a) and not u.is_constant(b) and node.op_type in ("Mul", "Add"):
        return b, a
    return None


def _producer(value: ir.Value | None, *ops: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    return node if node is not None and u.is_op(node, *ops) else None


def _only_reader(value: ir.Value, reader: ir.Node) -> bool:
    return not value.is_graph_output() and all(user is reader for user, _ in value.uses())


def _elem_type(value: ir.Value | None) -> ir.DataType | None:
    if value is None or value.type is None or not isinstance(value.type, ir.TensorType):
        return None
    return value.type.dtype


class TransformerFusion(GraphtrimPass):
    name = "fuse-transformer"
    exact = False
    summary = (
        "decomposed LayerNormalization (opset 17), Gelu (20), RMSNormalization and Attention "
        "(23) replaced by the fused op"
    )

    def apply(self, model: ir.Model) -> bool:
        opset = u.opset_version(model)
        if opset < 17:
            return False
        changed = False
        self._namer: u.NameGenerator | None = None
        self._model = model
        for graph, node in u.standard_nodes(model):
            if node.graph is not graph:
                continue
            if node.op_type == "ReduceMean":
                changed |= self._norm(node, graph, opset)
            elif (
                node.op_type in ("Erf", "Tanh")
                and opset >= 20
                and emits_allowed(self.options.target, "Gelu")
            ):
                changed |= self._gelu(node, graph)
            elif (
                node.op_type == "Softmax"
                and opset >= 23
                and emits_allowed(self.options.target, "Attention")
            ):
                changed |= self._attention(node, graph)
        return changed

    def _name(self, hint: str) -> str:
        if self._namer is None:
            self._namer = u.NameGenerator(self._model)
        return self._namer(hint)

    # ------------------------------------------------------------ normalizations

    @staticmethod
    def _last_axis_mean(node: ir.Node, x: ir.Value | None) -> bool:
        """``node`` is ReduceMean over the last axis of ``x`` with keepdims."""
        if node.attributes.get_int("keepdims", 1) != 1 or x is None:
            return False
        if "axes" in node.attributes:
            axes = list(node.attributes["axes"].as_ints())
        elif len(node.inputs) > 1 and node.inputs[1] is not None:
            axes = u.const_ints(node.inputs[1]) or []
        else:
            return False
        r = u.rank(x)
        return r is not None and len(axes) == 1 and axes[0] in (-1, r - 1)

    @staticmethod
    def _square_of(value: ir.Value | None) -> tuple[ir.Value, ir.Node] | None:
        """``(x, node)`` when ``value`` is ``x * x`` or ``x ** 2``."""
        node = _producer(value, "Mul", "Pow")
        if node is None or len(node.inputs) != 2:
            return None
        a, b = node.inputs
        if node.op_type == "Mul":
            return (a, node) if a is not None and a is b else None
        return (a, node) if a is not None and _scalar(b) == 2.0 else None

    def _norm(self, mean2: ir.Node, graph: ir.Graph, opset: int) -> bool:
        """Match from the ReduceMean of the squares (the variance, or the mean square)."""
        sq = self._square_of(mean2.inputs[0])
        if sq is None:
            return False
        d, sq_node = sq
        if not self._last_axis_mean(mean2, d) or _elem_type(d) not in _FLOATS:
            return False
        # Add(eps) -> Sqrt -> Div(d, .) or Mul(d, Reciprocal(.))
        v = mean2.outputs[0]
        if len(v.uses()) != 1:
            return False
        add = next(iter(v.uses()))[0]
        split = _split_const(add) if u.is_op(add, "Add") else None
        eps = _scalar(split[1]) if split is not None else None
        if split is None or eps is None or eps < 0 or len(add.outputs[0].uses()) != 1:
            return False
        sqrt = next(iter(add.outputs[0].uses()))[0]
        if not u.is_op(sqrt, "Sqrt") or len(sqrt.outputs[0].uses()) != 1:
            return False
        nxt = next(iter(sqrt.outputs[0].uses()))[0]
        chain = [mean2, add, sqrt]
        if u.is_op(nxt, "Div") and nxt.inputs[0] is d and nxt.inputs[1] is sqrt.outputs[0]:
            scaled = nxt
        elif u.is_op(nxt, "Reciprocal") and len(nxt.outputs[0].uses()) == 1:
            recip_reader = next(iter(nxt.outputs[0].uses()))[0]
            if not u.is_op(recip_reader, "Mul") or d not in recip_reader.inputs:
                return False
            chain.append(nxt)
            scaled = recip_reader
        else:
            return False
        chain += [sq_node, scaled]
        # centered (LayerNormalization) or not (RMSNormalization)
        sub = _producer(d, "Sub")
        mean1 = _producer(sub.inputs[1], "ReduceMean") if sub is not None else None
        if (
            sub is not None
            and mean1 is not None
            and sub.inputs[0] is mean1.inputs[0]
            and self._last_axis_mean(mean1, sub.inputs[0])
            and len(mean1.outputs[0].uses()) == 1
        ):
            x = sub.inputs[0]
            kind = "layernorm"
            chain += [sub, mean1]
            inner = {id(n) for n in chain}
            if any(id(user) not in inner for user, _ in d.uses()) or d.is_graph_output():
                return False
        else:
            if opset < 23 or not emits_allowed(self.options.target, "RMSNormalization"):
                return False
            x, kind = d, "rmsnorm"
        inner = {id(n) for n in chain}
        for n in chain:
            if n is scaled:
                continue
            for out in n.outputs:
                if out.is_graph_output() or any(id(user) not in inner for user, _ in out.uses()):
                    return False
        assert x is not None
        dims = u.dims(x)
        if dims is None or dims[-1] is None:
            return False
        channels = dims[-1]
        dtype = _elem_type(x)
        assert dtype is not None
        np_dtype = dtype.numpy()
        # optional affine tail: * gamma, + beta (per-channel constants of x's dtype)
        y = scaled.outputs[0]
        gamma = beta = None
        tail: list[ir.Node] = []
        mul = self._sole_reader(y, "Mul")
        if mul is not None:
            g = self._channel_const(mul, y, channels, np_dtype)
            if g is not None:
                gamma, y = g, mul.outputs[0]
                tail.append(mul)
        if kind == "layernorm":
            add2 = self._sole_reader(y, "Add")
            if add2 is not None:
                b = self._channel_const(add2, y, channels, np_dtype)
                if b is not None:
                    beta, y = b, add2.outputs[0]
                    tail.append(add2)
        if gamma is None:
            gamma = u.add_initializer(graph, np.ones(channels, np_dtype), self._name("norm_scale"))
        inputs = [x, gamma] + ([beta] if beta is not None else [])
        op = "LayerNormalization" if kind == "layernorm" else "RMSNormalization"
        fused = ir.Node(
            "",
            op,
            inputs,
            [ir.AttrInt64("axis", -1), ir.AttrFloat32("epsilon", eps)],
            name=self._name(op),
            version=None,
        )
        last = tail[-1] if tail else scaled
        graph.insert_before(last, fused)
        fused.outputs[0].shape = y.shape
        fused.outputs[0].type = y.type
        if not u.replace_value(y, fused.outputs[0]):  # pragma: no cover - has a producer
            raise RuntimeError(f"cannot reroute the output of {op}")
        self.hit(kind)
        return True

    @staticmethod
    def _sole_reader(value: ir.Value, op: str) -> ir.Node | None:
        if value.is_graph_output() or len(value.uses()) != 1:
            return None
        node = next(iter(value.uses()))[0]
        return node if u.is_op(node, op) else None

    @staticmethod
    def _channel_const(
        node: ir.Node, y: ir.Value, channels: int, dtype: np.dtype
    ) -> ir.Value | None:
        other = node.inputs[1] if node.inputs[0] is y else node.inputs[0]
        arr = u.const_array(other)
        if other is None or arr is None or arr.dtype != dtype:
            return None
        return other if arr.shape == (channels,) else None

    # ------------------------------------------------------------ attention

    @staticmethod
    def _scaled(value: ir.Value | None) -> tuple[ir.Value | None, float, list[ir.Node]]:
        """``(x, c, nodes)`` when ``value`` is ``x * c`` (or ``x / (1/c)``) for a scalar ``c``,
        else ``(value, 1.0, [])``."""
        node = _producer(value, "Mul", "Div")
        split = _split_const(node) if node is not None else None
        if node is None or split is None or value is None or len(value.uses()) != 1:
            return value, 1.0, []
        c = _scalar(split[1])
        if c is None or c == 0.0:
            return value, 1.0, []
        return split[0], (c if node.op_type == "Mul" else 1.0 / c), [node]

    @staticmethod
    def _mask_fits(mask: ir.Value, q: ir.Value, k: ir.Value, k_perm: list[int] | None) -> bool:
        """onnxruntime's Attention broadcasts a mask over batch and heads only: its last two
        dims must be the query and key lengths (provably, by static size or dim name)."""
        md, qd, kd = u.symbolic_dims(mask), u.symbolic_dims(q), u.symbolic_dims(k)
        if md is None or qd is None or kd is None or not 2 <= len(md) <= 4:
            return False
        k_seq = kd[1] if k_perm is not None else kd[2]
        return all(m is not None and m == want for m, want in ((md[-2], qd[2]), (md[-1], k_seq)))

    def _attention(self, softmax: ir.Node, graph: ir.Graph) -> bool:
        """``Softmax(Q @ K^T * scale [+ mask]) @ V`` on rank-4 ``[batch, heads, seq, head]``
        values -> ``Attention(Q, K, V, mask, scale=scale)`` (opset 23)."""
        x = softmax.inputs[0]
        axis = softmax.attributes.get_int("axis", -1)
        if x is None or u.rank(x) != 4 or axis not in (-1, 3):
            return False
        p = softmax.outputs[0]
        out_mm = self._sole_reader(p, "MatMul")
        if out_mm is None or out_mm.inputs[0] is not p:
            return False
        v = out_mm.inputs[1]
        nodes: list[ir.Node] = [softmax, out_mm]
        mask = None
        scores: ir.Value | None = x
        add = _producer(x, "Add")
        if add is not None and len(x.uses()) == 1:
            a, b = add.inputs
            mm_side = a if _producer(a, "MatMul", "Mul", "Div") is not None else b
            mask = b if mm_side is a else a
            if mask is None or mm_side is None or _producer(mask, "MatMul") is not None:
                return False
            scores, nodes = mm_side, [*nodes, add]
        scores, post, post_nodes = self._scaled(scores)
        mm = _producer(scores, "MatMul")
        if mm is None or scores is None or len(scores.uses()) != 1:
            return False
        q, q_scale, q_nodes = self._scaled(mm.inputs[0])
        kt, k_scale, k_nodes = self._scaled(mm.inputs[1])
        trans = _producer(kt, "Transpose")
        if trans is None or kt is None or len(kt.uses()) != 1:
            return False
        perm = list(trans.attributes.get_ints("perm", []))
        k_src = trans.inputs[0]
        if perm == [0, 1, 3, 2]:
            k_perm = None  # K is [batch, heads, seq, head] already
        elif perm == [0, 2, 3, 1]:
            k_perm = [0, 2, 1, 3]  # K is [batch, seq, heads, head]: move heads forward
        else:
            return False
        if any(u.rank(t) != 4 for t in (q, k_src, v)) or q is None or k_src is None or v is None:
            return False
        if not all(_elem_type(t) == ir.DataType.FLOAT for t in (q, k_src, v)):
            return False
        if mask is not None and _elem_type(mask) not in (ir.DataType.FLOAT, ir.DataType.BOOL):
            return False
        if mask is not None and not self._mask_fits(mask, q, k_src, k_perm):
            return False
        pattern = [*nodes, *post_nodes, mm, *q_nodes, *k_nodes, trans]
        ids = {id(n) for n in pattern}
        y = out_mm.outputs[0]
        for n in pattern:
            for o in n.outputs:
                if o is y:
                    continue
                if o.is_graph_output() or any(id(user) not in ids for user, _ in o.uses()):
                    return False
        scale = post * q_scale * k_scale
        if k_perm is not None:
            move = ir.Node("", "Transpose", [k_src], [ir.AttrInt64s("perm", k_perm)])
            graph.insert_before(out_mm, move)
            kd = u.symbolic_dims(k_src)
            if kd is not None:
                move.outputs[0].shape = ir.Shape([kd[i] for i in k_perm])
            move.outputs[0].type = k_src.type
            k_src = move.outputs[0]
        inputs: list[ir.Value | None] = [q, k_src, v]
        if mask is not None:
            inputs.append(mask)
        fused = ir.Node(
            "",
            "Attention",
            inputs,
            [ir.AttrFloat32("scale", scale)],
            name=self._name("Attention"),
        )
        graph.insert_before(out_mm, fused)
        fused.outputs[0].shape = y.shape
        fused.outputs[0].type = y.type
        if not u.replace_value(y, fused.outputs[0]):  # pragma: no cover - has a producer
            raise RuntimeError("cannot reroute the output of an attention pattern")
        self.hit("attention")
        return True

    # ------------------------------------------------------------ Gelu

    def _gelu(self, act: ir.Node, graph: ir.Graph) -> bool:
        inner = act.inputs[0]
        x = self._erf_arg(inner) if act.op_type == "Erf" else self._tanh_arg(inner)
        if x is None or _elem_type(x) not in _FLOATS:
            return False
        t = act.outputs[0]
        add = self._sole_reader(t, "Add")
        if add is None or not _close(_scalar(self._other(add, t)), 1.0, 0.0):
            return False
        a = add.outputs[0]
        found = self._half_product(x, a)
        if found is None:
            return False
        out, nodes = found
        pattern = [act, add, *nodes, *self._arg_nodes(inner, x)]
        ids = {id(n) for n in pattern}
        for n in pattern:
            for o in n.outputs:
                if o is out:
                    continue
                if o.is_graph_output() or any(id(user) not in ids for user, _ in o.uses()):
                    return False
        attrs = [] if act.op_type == "Erf" else [ir.AttrString("approximate", "tanh")]
        fused = ir.Node("", "Gelu", [x], attrs, name=self._name("Gelu"))
        graph.insert_before(out.producer() or act, fused)
        fused.outputs[0].shape = out.shape
        fused.outputs[0].type = out.type
        if not u.replace_value(out, fused.outputs[0]):  # pragma: no cover - has a producer
            raise RuntimeError("cannot reroute the output of a Gelu pattern")
        self.hit("gelu-erf" if act.op_type == "Erf" else "gelu-tanh")
        return True

    @staticmethod
    def _other(node: ir.Node, value: ir.Value) -> ir.Value | None:
        return node.inputs[1] if node.inputs[0] is value else node.inputs[0]

    def _erf_arg(self, value: ir.Value | None) -> ir.Value | None:
        node = _producer(value, "Div", "Mul")
        split = _split_const(node) if node is not None else None
        if node is None or split is None:
            return None
        c = _scalar(split[1])
        want = math.sqrt(2.0) if node.op_type == "Div" else 1.0 / math.sqrt(2.0)
        return split[0] if _close(c, want) else None

    def _tanh_arg(self, value: ir.Value | None) -> ir.Value | None:
        # sqrt(2/pi) * (x + 0.044715 * x**3)
        outer = _producer(value, "Mul")
        split = _split_const(outer) if outer is not None else None
        if split is None or not _close(_scalar(split[1]), math.sqrt(2.0 / math.pi)):
            return None
        s = _producer(split[0], "Add")
        if s is None or len(s.inputs) != 2:
            return None
        for x, cube_term in ((s.inputs[0], s.inputs[1]), (s.inputs[1], s.inputs[0])):
            m = _producer(cube_term, "Mul")
            msplit = _split_const(m) if m is not None else None
            if msplit is None or not _close(_scalar(msplit[1]), 0.044715):
                continue
            if self._is_cube(msplit[0], x):
                return x
        return None

    @staticmethod
    def _is_cube(value: ir.Value | None, x: ir.Value | None) -> bool:
        """``value`` is ``x ** 3`` or ``x * x * x`` (any association)."""
        p = _producer(value, "Pow", "Mul")
        if p is None or x is None or len(p.inputs) != 2:
            return False
        if p.op_type == "Pow":
            return p.inputs[0] is x and _scalar(p.inputs[1]) == 3.0
        a, b = p.inputs
        for sq, lone in ((a, b), (b, a)):
            inner = _producer(sq, "Mul")
            if lone is x and inner is not None and inner.inputs[0] is x and inner.inputs[1] is x:
                return True
        return False

    @staticmethod
    def _arg_nodes(value: ir.Value | None, x: ir.Value) -> list[ir.Node]:
        """Nodes between ``x`` and the activation's argument (exclusive of ``x``'s producer)."""
        out: list[ir.Node] = []
        pending = [value]
        while pending:
            v = pending.pop()
            if v is None or v is x or u.is_constant(v):
                continue
            node = v.producer()
            if node is None or node in out:
                continue
            out.append(node)
            pending.extend(node.inputs)
        return out

    def _half_product(self, x: ir.Value, a: ir.Value) -> tuple[ir.Value, list[ir.Node]] | None:
        """The value ``x * a * 0.5`` (in any association) and its Mul nodes."""
        m = self._sole_reader(a, "Mul")
        if m is None:
            return None
        o = self._other(m, a)
        if o is None:
            return None
        if o is x:  # (x * a) * 0.5
            m2 = self._sole_reader(m.outputs[0], "Mul")
            if m2 is not None and _close(_scalar(self._other(m2, m.outputs[0])), 0.5, 0.0):
                return m2.outputs[0], [m, m2]
            return None
        if _close(_scalar(o), 0.5, 0.0):  # x * (a * 0.5)
            m2 = self._sole_reader(m.outputs[0], "Mul")
            if m2 is not None and self._other(m2, m.outputs[0]) is x:
                return m2.outputs[0], [m, m2]
            return None
        half = _producer(o, "Mul")  # (x * 0.5) * a
        if half is not None and _only_reader(o, m):
            split = _split_const(half)
            if split is not None and split[0] is x and _close(_scalar(split[1]), 0.5, 0.0):
                return m.outputs[0], [m, half]
        return None
