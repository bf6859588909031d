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

import numpy as np
import onnx_ir as ir

from optimizer_core.graph import _ir_utils as u
from optimizer_core.graph.framework import GraphtrimPass

# element types every runtime's Gemm takes (onnxruntime's CPU Gemm has no float16 kernel)
_GEMM_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE})


def _elem_type(value: ir.Value | None) -> ir.DataType | None:
    if value is None:
        return None
    if value.type is not None and isinstance(value.type, ir.TensorType):
        return value.type.dtype
    if value.const_value is not None:
        return value.const_value.dtype
    return None


def _last_axis_vector(value: ir.Value | None, n: int, out_rank: int) -> np.ndarray | None:
    """The constant as a length-``n`` float64 vector when it broadcasts along the last axis
    of a rank-``out_rank`` result only (scalar, ``[n]``, ``[1, ..., 1, n]``)."""
    arr = u.const_array(value)
    if arr is None or arr.dtype.kind != "f" or arr.ndim > out_rank:
        return None
    if any(d != 1 for d in arr.shape[:-1]) or (arr.ndim and arr.shape[-1] not in (1, n)):
        return None
    return np.broadcast_to(arr.reshape(-1).astype(np.float64), (n,)).copy()


def _is_transpose_2d(node: ir.Node | None) -> bool:
    if not u.is_op(node, "Transpose") or node is None:
        return False
    if u.rank(node.inputs[0]) != 2:
        return False
    perm = node.attributes.get_ints("perm", None)
    return perm is None or list(perm) == [1, 0]


class GemmFusion(GraphtrimPass):
    _model: ir.Model
    _names: u.NameGenerator | None = None
    name = "fuse-gemm"
    exact = False
    summary = (
        "MatMul+Add into Gemm; rank-2 Transpose into Gemm's transA/transB; BatchNormalization "
        "and per-column Mul/Add into Gemm and MatMul weights"
    )

    def apply(self, model: ir.Model) -> bool:
        if u.opset_version(model) < 11:  # Gemm's C became optional in opset 11
            return False
        changed = False
        for graph in u.all_graphs(model):
            for node in u.nodes_in_order(graph):
                if node.graph is not graph or not u.is_standard(node):
                    continue
                op = node.op_type
                if op == "Gemm":
                    done = self._absorb_transposes(node, graph)
                elif op == "MatMul":
                    done = self._matmul_transpose(node, graph)
                elif op == "Add":
                    done = self._matmul_add(node, graph) or self._after_gemm(node, graph)
                elif op in ("Mul", "Div"):
                    done = self._after_gemm(node, graph) or self._matmul_scale(node, graph)
                elif op == "BatchNormalization":
                    done = self._after_gemm(node, graph)
                else:
                    continue
                changed |= done
        return changed

    # ------------------------------------------------------------ Transpose into Gemm

    def _absorb_transposes(self, gemm: ir.Node, graph: ir.Graph) -> bool:
        done = False
        for index, attr in ((0, "transA"), (1, "transB")):
            x = gemm.inputs[index]
            producer = x.producer() if x is not None else None
            if x is None or not _is_transpose_2d(producer) or not u.single_consumer(x):
                continue
            assert producer is not None
            gemm.replace_input_with(index, producer.inputs[0])
            gemm.attributes[attr] = ir.AttrInt64(attr, 1 - gemm.attributes.get_int(attr, 0))
            u.remove_nodes(graph, [producer])
            self.hit("transpose-gemm")
            done = True
        return done

    def _matmul_transpose(self, matmul: ir.Node, graph: ir.Graph) -> bool:
        a, b = matmul.inputs[0], matmul.inputs[1]
        if u.rank(a) != 2 or u.rank(b) != 2 or _elem_type(matmul.outputs[0]) not in _GEMM_TYPES:
            return False
        if a is None or b is None:
            return False
        trans = []
        for x in (a, b):
            producer = x.producer()
            trans.append(_is_transpose_2d(producer) and u.single_consumer(x))
        if not any(trans):
            return False
        inputs = []
        for x, t in zip((a, b), trans, strict=True):
            producer = x.producer()
            inputs.append(producer.inputs[0] if t and producer is not None else x)
        gemm = ir.Node(
            "",
            "Gemm",
            inputs,
            [ir.AttrInt64("transA", int(trans[0])), ir.AttrInt64("transB", int(trans[1]))],
            name=matmul.name,
        )
        self._replace(matmul, gemm, graph)
        self.hit("matmul-transpose-gemm")
        return True

    # ------------------------------------------------------------ MatMul + Add -> Gemm

    def _matmul_add(self, add: ir.Node, graph: ir.Graph) -> bool:
        if len(add.inputs) != 2 or add.inputs[0] is None or add.inputs[1] is None:
            return False
        for mm_index in (0, 1):
            m = add.inputs[mm_index]
            c = add.inputs[1 - mm_index]
            producer = m.producer() if m is not None else None
            if m is None or c is None or not u.is_op(producer, "MatMul") or producer is None:
                continue
            if not u.single_consumer(m):
                continue
            a, b = producer.inputs[0], producer.inputs[1]
            if u.rank(a) != 2 or u.rank(b) != 2 or _elem_type(m) not in _GEMM_TYPES:
                continue
            # a constant bias only: a computed C (a residual) could still be merged by CSE
            if not u.is_constant(c) or _elem_type(c) != _elem_type(m):
                continue
            if not self._broadcasts_to(c, m):
                continue
            gemm = ir.Node("", "Gemm", [a, b, c], name=producer.name)
            graph.insert_before(producer, gemm)
            gemm.outputs[0].shape = m.shape
            gemm.outputs[0].type = m.type
            u.replace_value(add.outputs[0], gemm.outputs[0]) or self._fail(add)
            u.remove_nodes(graph, [add, producer])
            self.hit("matmul-add-gemm")
            return True
        return False

    @staticmethod
    def _broadcasts_to(c: ir.Value, y: ir.Value) -> bool:
        """``c`` broadcasts unidirectionally to ``y`` (rank 2) without widening it."""
        cd, yd = u.symbolic_dims(c), u.symbolic_dims(y)
        if cd is None or yd is None or len(yd) != 2 or len(cd) > 2:
            return False
        for cdim, ydim in zip(reversed(cd), reversed(yd), strict=False):
            if cdim == 1:
                continue
            if cdim is None or cdim != ydim:
                return False
        return True

    # ------------------------------------------------------------ affine maps after Gemm

    def _after_gemm(self, node: ir.Node, graph: ir.Graph) -> bool:
        x = self._affine_input(node)
        gemm = x.producer() if x is not None else None
        if x is None or gemm is None or not u.single_consumer(x):
            return False
        if not u.is_op(gemm, "Gemm"):
            return False
        b_val = gemm.inputs[1]
        c_val = gemm.inputs[2] if len(gemm.inputs) > 2 else None
        b = u.const_array(b_val)
        trans_b = gemm.attributes.get_int("transB", 0)
        if b is None or b.ndim != 2 or b.dtype.kind != "f":
            return False
        n = b.shape[0] if trans_b else b.shape[1]
        found = self._affine(node, x, n)
        if found is None:
            return False
        scale, shift, rule = found
        new_b_val = None
        if not np.all(scale == 1.0):
            assert b_val is not None
            if not all(user is gemm for user, _ in b_val.uses()) or b_val.is_graph_output():
                return False  # a tied weight: rewriting it would need a copy
            col = scale.reshape(-1, 1) if trans_b else scale.reshape(1, -1)
            new_b = (b.astype(np.float64) * col).astype(b.dtype)
            new_b_val = u.add_initializer(graph, new_b, self._namer(graph)(f"{b_val.name}_fused"))
        beta = gemm.attributes.get_float("beta", 1.0)
        if c_val is None:
            c64 = np.zeros(n)
        else:
            c = u.const_array(c_val)
            if c is None or c.dtype != b.dtype or c.ndim > 2 or c.size not in (1, n):
                return False
            if c.ndim == 2 and c.shape[0] != 1:
                return False  # a [M, 1] or [M, N] bias would have to be materialized per row
            c64 = np.broadcast_to(c.reshape(-1).astype(np.float64), (n,))
        new_c = (beta * c64 * scale + shift).astype(b.dtype)
        new_c_val = u.add_initializer(graph, new_c, self._namer(graph)("gemm_bias_fused"))
        if new_b_val is not None:
            gemm.replace_input_with(1, new_b_val)
        if len(gemm.inputs) < 3:
            gemm.resize_inputs(3)
        gemm.replace_input_with(2, new_c_val)
        gemm.attributes["beta"] = ir.AttrFloat32("beta", 1.0)
        u.replace_value(node.outputs[0], x) or self._fail(node)
        u.remove_nodes(graph, [node])
        self.hit(rule)
        return True

    @staticmethod
    def _affine_input(node: ir.Node) -> ir.Value | None:
        if node.op_type == "BatchNormalization":
            if node.attributes.get_int("training_mode", 0) or len(node.inputs) < 5:
                return None
            if any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
                return None
            return node.inputs[0] if u.rank(node.inputs[0]) == 2 else None
        if len(node.inputs) != 2 or node.inputs[0] is None or node.inputs[1] is None:
            return None
        a, b = node.inputs
        if u.is_constant(b) and not u.is_constant(a):
            return a
        if node.op_type != "Div" and u.is_constant(a) and not u.is_constant(b):
            return b
        return None

    @staticmethod
    def _affine(node: ir.Node, x: ir.Value, n: int) -> tuple[np.ndarray, np.ndarray, str] | None:
        if node.op_type == "BatchNormalization":
            params = [u.const_array(v) for v in node.inputs[1:5]]
            if any(p is None or p.size != n or p.dtype.kind != "f" for p in params):
                return None
            gamma, beta, mean, var = (p.astype(np.float64).reshape(-1) for p in params)  # type: ignore[union-attr]
            k = gamma / np.sqrt(var + node.attributes.get_float("epsilon", 1e-5))
            return k, beta - mean * k, "gemm-bn"
        other = node.inputs[1] if node.inputs[0] is x else node.inputs[0]
        c = _last_axis_vector(other, n, 2)
        if c is None:
            return None
        if node.op_type == "Mul":
            return c, np.zeros(n), "gemm-mul"
        if node.op_type == "Div":
            return (1.0 / c if np.all(c != 0) else None), np.zeros(n), "gemm-div"  # type: ignore[return-value]
        return np.ones(n), c, "gemm-add"

    # ------------------------------------------------------------ MatMul(A, W) * c

    def _matmul_scale(self, node: ir.Node, graph: ir.Graph) -> bool:
        x = self._affine_input(node)
        mm = x.producer() if x is not None else None
        if x is None or mm is None or not u.is_op(mm, "MatMul") or not u.single_consumer(x):
            return False
        w_val = mm.inputs[1]
        w = u.const_array(w_val)
        if w_val is None or w is None or w.ndim != 2 or w.dtype.kind != "f":
            return False
        if not all(user is mm for user, _ in w_val.uses()) or w_val.is_graph_output():
            return False
        out_rank = u.rank(x)
        if out_rank is None:
            return False
        other = node.inputs[1] if node.inputs[0] is x else node.inputs[0]
        c = _last_axis_vector(other, w.shape[1], out_rank)
        if c is None or (node.op_type == "Div" and not np.all(c != 0)):
            return False
        arr = u.const_array(other)
        if arr is None or arr.dtype != w.dtype:
            return False
        k = 1.0 / c if node.op_type == "Div" else c
        new_w = (w.astype(np.float64) * k.reshape(1, -1)).astype(w.dtype)
        mm.replace_input_with(
            1, u.add_initializer(graph, new_w, self._namer(graph)(f"{w_val.name}_fused"))
        )
        u.replace_value(node.outputs[0], x) or self._fail(node)
        u.remove_nodes(graph, [node])
        self.hit("matmul-div" if node.op_type == "Div" else "matmul-mul")
        return True

    # ------------------------------------------------------------ helpers

    def _namer(self, graph: ir.Graph) -> u.NameGenerator:
        if self._names is None:
            self._names = u.NameGenerator(self._model)
        return self._names

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self._model = model
        self._names = None
        return super().call(model)

    @staticmethod
    def _replace(old: ir.Node, new: ir.Node, graph: ir.Graph) -> None:
        graph.insert_before(old, new)
        new.outputs[0].shape = old.outputs[0].shape
        new.outputs[0].type = old.outputs[0].type
        if not u.replace_value(old.outputs[0], new.outputs[0]):  # pragma: no cover
            raise RuntimeError(f"cannot reroute the output of {old.op_type}")
        u.remove_nodes(graph, [old])

    @staticmethod
    def _fail(node: ir.Node) -> bool:  # pragma: no cover - the value has a producer
        raise RuntimeError(f"cannot reroute the output of {node.op_type}")
