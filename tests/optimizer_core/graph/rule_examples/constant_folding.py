"""Examples of constant folding's rules (pass ``constant-folding``)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.helpers import parse
from tests.optimizer_core.graph.rule_examples import Example


def _shape_of(expr: str, last: str = "N"):
    """``y = x * float(<expr over Shape(x)>)`` on ``x[2, 3, last]``."""

    def build() -> onnx.ModelProto:
        return parse(
            f"""
            <ir_version: 8, opset_import: ["" : 17]>
            g (float[2, 3, {last}] x) => (float[2, 3, {last}] y) {{
              {expr}
              f = Cast<to = 1>(v)
              y = Mul(x, f)
            }}
            """
        )

    return build


def _constant_subgraph() -> onnx.ModelProto:
    return parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y) <float[4] c = {1, 2, 3, 4}> {
          e = Exp(c)
          y = Add(x, e)
        }
        """
    )


def _over_budget() -> onnx.ModelProto:
    """A constant tiled to 64 KiB: folding would grow the model beyond the budget."""
    return parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[16384] x) => (float[16384] y) <float[4] c = {1, 2, 3, 4}, int64[1] r = {4096}> {
          t = Tile(c, r)
          y = Add(x, t)
        }
        """
    )


def pooled(tiles: int = 1) -> onnx.ModelProto:
    """``tiles`` constants tiled to 8 KiB each (over the 4 KiB per-value budget, not uniform)
    beside 1 MiB of weights: a growth pool of 1% of those holds one of them."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["m", "w"], ["z"])]
    inits = [
        numpy_helper.from_array(rng.standard_normal((256, 1024)).astype(np.float32), "w"),
        numpy_helper.from_array(np.array([512], np.int64), "r"),
    ]
    outputs = [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 1024])]
    for i in range(tiles):
        inits.append(numpy_helper.from_array(np.arange(4, dtype=np.float32) + i, f"c{i}"))
        nodes.append(helper.make_node("Tile", [f"c{i}", "r"], [f"t{i}"]))
        nodes.append(helper.make_node("Add", ["x", f"t{i}"], [f"y{i}"]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [2048]))
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2048]),
            helper.make_tensor_value_info("m", TensorProto.FLOAT, [1, 256]),
        ],
        outputs,
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _uniform_gather() -> onnx.ModelProto:
    """A bias table of zeros (a zero-initialized relative-position bias) gathered by a 64x64
    index table and transposed: the 64 KiB result is over the budget but all zeros, a fill."""
    rng = np.random.default_rng(0)
    idx = numpy_helper.from_array(rng.integers(0, 16, (64, 64, 1)).astype(np.int64), "idx")
    table = numpy_helper.from_array(np.zeros((16, 4), np.float32), "table")
    graph = helper.make_graph(
        [
            helper.make_node("GatherND", ["table", "idx"], ["g"]),
            helper.make_node("Transpose", ["g"], ["t"], perm=[2, 0, 1]),
            helper.make_node("Add", ["x", "t"], ["b"]),
            helper.make_node("Softmax", ["b"], ["y"], axis=-1),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 64, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 64, 64])],
        [table, idx],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _expand_test() -> onnx.ModelProto:
    """``cls_token.expand(B, -1, -1)`` as the TorchScript exporter writes it: the target is
    tested for -1 entry by entry; B is a dim, never -1."""
    return parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B, 4, 8] x) => (float[B, 5, 8] y)
          <float[1, 1, 8] cls = {1, 2, 3, 4, 5, 6, 7, 8}, int64 i0 = {0}, int64[1] ax = {0},
           int64[1] m1 = {-1}, int64[3] neg = {-1, -1, -1}, int64[3] ones = {1, 1, 1}> {
          s = Shape(x)
          b = Gather<axis = 0>(s, i0)
          bu = Unsqueeze(b, ax)
          target = Concat<axis = 0>(bu, m1, m1)
          is_neg = Equal(target, neg)
          fixed = Where(is_neg, ones, target)
          c = Expand(cls, fixed)
          y = Concat<axis = 1>(c, x)
        }
        """
    )


def _windows_per_image() -> onnx.ModelProto:
    """GC ViT's global query tiled over the windows, as the TorchScript exporter writes it: the
    repeat count is the window batch ``(4*B)`` read from one tensor over the batch ``B`` read
    from another, 4 for every B."""
    return parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B, 4, 8] x, float[B, 1, 8] q) => (float[M, 1, 8] y)
          <int64[3] flat = {-1, 1, 8}, int64 i0 = {0}, int64[1] ax = {0}, int64[2] ones = {1, 1}> {
          w = Reshape(x, flat)
          sw = Shape(w)
          n = Gather<axis = 0>(sw, i0)
          sq = Shape(q)
          b = Gather<axis = 0>(sq, i0)
          k = Div(n, b)
          ku = Unsqueeze(k, ax)
          reps = Concat<axis = 0>(ku, ones)
          t = Tile(q, reps)
          y = Add(t, w)
        }
        """
    )


def _same_length() -> onnx.ModelProto:
    """A length read from two tensors that share its dim, subtracted: 0 for every length."""
    return parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B, S] x, float[B, S] m) => (float[B, S] y) <int64 i1 = {1}> {
          sx = Shape(x)
          a = Gather<axis = 0>(sx, i1)
          sm = Shape(m)
          b = Gather<axis = 0>(sm, i1)
          d = Sub(a, b)
          f = Cast<to = 1>(d)
          y = Add(x, f)
        }
        """
    )


def _unevaluable() -> onnx.ModelProto:
    """``Erf`` of a double constant: a valid model, but onnxruntime's CPU provider has no
    double Erf kernel, so neither folding nor the comparison can run it."""
    c = numpy_helper.from_array(np.array([0.5, 1.0], dtype=np.float64), "c")
    graph = helper.make_graph(
        [helper.make_node("Erf", ["c"], ["s"]), helper.make_node("Add", ["x", "s"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2])],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [2])],
        [c],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


EXAMPLES = {
    ("constant-folding", "shape"): Example(model=_shape_of("v = Shape<end = 2>(x)")),
    ("constant-folding", "size"): Example(model=_shape_of("v = Size(x)", last="4")),
    ("constant-folding", "gather-shape"): Example(
        model=_shape_of("s = Shape(x)\n i = Constant<value = int64[1] {1}>()\n v = Gather(s, i)")
    ),
    ("constant-folding", "slice-shape"): Example(
        model=_shape_of(
            "s = Shape(x)\n a = Constant<value = int64[1] {0}>()\n"
            " b = Constant<value = int64[1] {2}>()\n v = Slice(s, a, b)"
        )
    ),
    ("constant-folding", "fold"): Example(model=_constant_subgraph),
    ("constant-folding", "skipped-over-budget"): Example(model=_over_budget),
    ("constant-folding", "fold-pooled"): Example(model=pooled),
    ("constant-folding", "fill"): Example(model=_uniform_gather),
    ("constant-folding", "equal-dims"): Example(model=_expand_test),
    ("constant-folding", "div-dims"): Example(
        model=_windows_per_image, passes=("symbolic-shapes", "constant-folding")
    ),
    ("constant-folding", "sub-dims"): Example(model=_same_length),
    ("constant-folding", "skipped-unevaluable"): Example(model=_unevaluable, compare=False),
}
