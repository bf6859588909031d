"""Computed shapes made constant over symbolic dims."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tests.helpers import assert_equivalent, op_types, parse, rules_fired, run_passes

DIMS = {"batch": 3, "seq": 5}

HEADS = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[batch, seq, 8] x) => (float[batch, seq, 2, 4] y) {
    s = Shape(x)
    i0 = Constant<value = int64 {0}>()
    i1 = Constant<value = int64 {1}>()
    b = Gather<axis = 0>(s, i0)
    q = Gather<axis = 0>(s, i1)
    ax = Constant<value = int64[1] {0}>()
    bu = Unsqueeze(b, ax)
    qu = Unsqueeze(q, ax)
    tail = Constant<value = int64[2] {-1, 4}>()
    shape = Concat<axis = 0>(bu, qu, tail)
    y = Reshape(x, shape)
}
"""


def test_reshape_to_heads_gets_a_constant_shape():
    proto = parse(HEADS)
    out, result = run_passes(proto, ["symbolic-shapes"])
    assert op_types(out) == ["Reshape"]
    assert rules_fired(result) == {"reshape-copy-dims": 1}
    shape = next(i for i in out.graph.initializer if i.name == out.graph.node[0].input[1])
    assert list(np.frombuffer(shape.raw_data, dtype=np.int64)) == [0, 0, -1, 4]
    # the -1 is computed from the static dims it stands for
    dims = out.graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in dims] == ["batch", "seq", 2, 4]
    assert_equivalent(proto, out, dim_values=DIMS)


def test_reshape_that_reproduces_the_input_is_removed_by_the_default_preset():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[batch, seq] x) => (float[batch, seq] y) {
            s = Shape<start = 1, end = 2>(x)
            m1 = Constant<value = int64[1] {-1}>()
            shape = Concat<axis = 0>(m1, s)
            r = Reshape(x, shape)
            y = Relu(r)
        }
        """
    )
    out, _ = run_passes(proto)
    assert op_types(out) == ["Relu"]
    assert_equivalent(proto, out, dim_values=DIMS)


def test_dims_read_from_another_tensor_with_the_same_name():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[batch, seq, 8] x, float[batch, 7] other) => (float[batch, 16, 4] y) {
            s = Shape<start = 0, end = 1>(other)
            tail = Constant<value = int64[2] {16, 4}>()
            shape = Concat<axis = 0>(s, tail)
            t = Transpose<perm = [0, 2, 1]>(x)
            r = Reshape(x, shape)
            y = Relu(r)
        }
        """
    )
    # seq is 8 here: [batch, 8, 8] -> [batch, 16, 4]
    out, result = run_passes(proto, ["symbolic-shapes", "dead-code"])
    assert rules_fired(result) == {"reshape-copy-dims": 1}
    assert "Shape" not in op_types(out)
    assert_equivalent(proto, out, dim_values={"batch": 3, "seq": 8})


def test_a_dim_at_another_position_is_not_copied():
    # the entry is x's dim 1 but sits at position 0: "0" would copy dim 0, a different size
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[batch, seq] x) => (float[seq, batch] y) {
            s1 = Shape<start = 1, end = 2>(x)
            s0 = Shape<start = 0, end = 1>(x)
            shape = Concat<axis = 0>(s1, s0)
            y = Reshape(x, shape)
        }
        """
    )
    out, result = run_passes(proto, ["symbolic-shapes"])
    assert not rules_fired(result)
    assert "Shape" in op_types(out)


def test_anonymous_dims_are_not_taken_as_equal():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[batch, seq] x, float[a, b] other) => (float[c, d] y) {
            s = Shape(other)
            y = Reshape(x, s)
        }
        """
    )
    proto.graph.input[1].type.tensor_type.shape.dim[0].ClearField("dim_param")
    proto.graph.input[0].type.tensor_type.shape.dim[0].ClearField("dim_param")
    _, result = run_passes(proto, ["symbolic-shapes"])
    assert not rules_fired(result)


def test_allowzero_reshape_copies_dims_under_allowzero_0():
    """torch's dynamo exporter writes allowzero=1: the copied entries are x's own dims, so a 0
    in them is 0 either way, and the rewrite switches the node to allowzero=0."""
    proto = parse(HEADS.replace("y = Reshape(x, shape)", "y = Reshape<allowzero = 1>(x, shape)"))
    out, result = run_passes(proto, ["symbolic-shapes", "dead-code"])
    assert rules_fired(result) == {"reshape-copy-dims": 1}
    assert op_types(out) == ["Reshape"]
    node = out.graph.node[0]
    assert [(a.name, a.i) for a in node.attribute] == [("allowzero", 0)]
    shape = next(i for i in out.graph.initializer if i.name == node.input[1])
    assert list(np.frombuffer(shape.raw_data, dtype=np.int64)) == [0, 0, -1, 4]
    assert_equivalent(proto, out, dim_values=DIMS)
    assert_equivalent(proto, out, dim_values={"batch": 1, "seq": 1})


def test_allowzero_reshape_with_a_literal_zero_is_left_alone():
    # under allowzero=1 the 0 makes an empty dim; under allowzero=0 it would copy x's dim 2
    proto = parse(
        HEADS.replace("y = Reshape(x, shape)", "y = Reshape<allowzero = 1>(x, shape)")
        .replace("int64[2] {-1, 4}", "int64[2] {0, 4}")
        .replace("float[batch, seq, 2, 4] y", "float[batch, seq, 0, 4] y")
        .replace("float[batch, seq, 8] x", "float[batch, seq, 0] x")
    )
    _, result = run_passes(proto, ["symbolic-shapes"])
    assert not rules_fired(result)


def test_expand_to_own_dims_becomes_a_no_op():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[batch, 1, seq] x, float[batch, 4, seq] z) => (float[batch, 4, seq] y) {
            sz = Shape(z)
            e = Expand(x, sz)
            y = Add(e, z)
        }
        """
    )
    out, result = run_passes(proto, ["symbolic-shapes", "dead-code"])
    assert rules_fired(result) == {"expand-keep-dims": 1}
    expand = next(n for n in out.graph.node if n.op_type == "Expand")
    shape = next(i for i in out.graph.initializer if i.name == expand.input[1])
    assert list(np.frombuffer(shape.raw_data, dtype=np.int64)) == [1, 4, 1]
    assert_equivalent(proto, out, dim_values=DIMS)


def _relative_position_model():
    # relative-position style: Range over seq, a bias computed from it, added to the scores,
    # then a Reshape whose shape reads seq from elsewhere: only names prove it copies dim 2
    return parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[batch, 4, seq, 8] x) => (float[batch, 4, seq, 8] y) {
            s = Shape(x)
            i2 = Constant<value = int64 {2}>()
            n = Gather<axis = 0>(s, i2)
            zero = Constant<value = int64 {0}>()
            one = Constant<value = int64 {1}>()
            r = Range(zero, n, one)
            ax0 = Constant<value = int64[1] {0}>()
            ax1 = Constant<value = int64[1] {1}>()
            row = Unsqueeze(r, ax0)
            col = Unsqueeze(r, ax1)
            d = Sub(row, col)
            ds = Shape(d)
            fill = ConstantOfShape<value = int64[1] {3}>(ds)
            m = Min(d, fill)
            f = Cast<to = 1>(m)
            x_t = Transpose<perm = [0, 1, 3, 2]>(x)
            sc = MatMul(x, x_t)
            b = Add(sc, f)
            p = MatMul(b, x)
            i0 = Constant<value = int64 {0}>()
            bt = Gather<axis = 0>(s, i0)
            bu = Unsqueeze(bt, ax0)
            nu = Unsqueeze(n, ax0)
            m1 = Constant<value = int64[1] {-1}>()
            e8 = Constant<value = int64[1] {8}>()
            shp = Concat<axis = 0>(bu, m1, nu, e8)
            y = Reshape(p, shp)
        }
        """
    )


def test_range_and_fill_dims_are_named_so_later_reshapes_resolve():
    proto = _relative_position_model()
    out, result = run_passes(proto)
    fired = rules_fired(result)
    # once the Range is named, inference names the fill itself (fill-dims need not fire)
    assert fired["range-dim"] == 1 and fired.get("fill-dims", 0) <= 1
    assert fired["reshape-copy-dims"] == 1
    # [0, -1, 0, 8] on [batch, 4, seq, 8]: the Reshape is a no-op and goes, its shape chain too
    assert fired["reshape-noop"] == 1
    assert "Reshape" not in op_types(out) and "Concat" not in op_types(out)
    assert_equivalent(proto, out, rtol=1e-6, atol=1e-6, dim_values={"batch": 2, "seq": 5})


def test_what_new_names_prove_is_found_in_the_same_run():
    """The name given by range-dim makes inference name the fill, the bias and the scores; the
    pass re-infers at once, so the Reshape resolves in its first run, not an iteration later."""
    _, result = run_passes(_relative_position_model(), ["symbolic-shapes"])
    first = next(r for r in result.log.records if r.pass_name == "symbolic-shapes")
    assert first.iteration == 1
    assert first.rules["range-dim"] == 1 and first.rules["reshape-copy-dims"] == 1


# K of attention as torch's dynamo exporter writes it: [b, h, s, d] -> [b*h, s, d] ->
# Transpose -> [b*h, d, s] -> [b, h, d, s], shapes computed from the tensor's own dims
RTR = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[batch, 4, seq, 8] x) => (float[batch, 4, 8, seq] y) {
    s = Shape(x)
    b = Shape<start = 0, end = 1>(x)
    q = Shape<start = 2, end = 3>(x)
    m1 = Constant<value = int64[1] {-1}>()
    d = Constant<value = int64[1] {8}>()
    h = Constant<value = int64[1] {4}>()
    shape1 = Concat<axis = 0>(m1, q, d)
    r1 = Reshape<allowzero = 1>(x, shape1)
    t = Transpose<perm = PERM>(r1)
    shape2 = Concat<axis = 0>(b, h, d, q)
    y = Reshape<allowzero = 1>(t, shape2)
}
"""


def test_reshape_transpose_reshape_becomes_one_transpose():
    proto = parse(RTR.replace("PERM", "[0, 2, 1]"))
    out, result = run_passes(proto, ["symbolic-shapes", "dead-code"])
    # the first Reshape (allowzero=1, no literal 0) is named on the way
    assert set(rules_fired(result)) <= {"reshape-transpose-reshape", "reshape-dims"}
    assert rules_fired(result)["reshape-transpose-reshape"] == 1
    assert op_types(out) == ["Transpose"]
    perm = [list(a.ints) for a in out.graph.node[0].attribute if a.name == "perm"]
    assert perm == [[0, 1, 3, 2]]
    assert_equivalent(proto, out, dim_values=DIMS)
    assert_equivalent(proto, out, dim_values={"batch": 1, "seq": 1})


def test_reshape_transpose_reshape_with_a_longer_tail():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[batch, 2, 3, 4, 5] x) => (float[batch, 2, 5, 3, 4] y) {
            shape1 = Constant<value = int64[4] {-1, 3, 4, 5}>()
            r1 = Reshape(x, shape1)
            t = Transpose<perm = [0, 3, 1, 2]>(r1)
            b = Shape<start = 0, end = 1>(x)
            rest = Constant<value = int64[4] {2, 5, 3, 4}>()
            shape2 = Concat<axis = 0>(b, rest)
            y = Reshape(t, shape2)
        }
        """
    )
    out, result = run_passes(proto, ["symbolic-shapes", "dead-code"])
    # the first Reshape's output is named [(2*batch), 3, 4, 5] on the way
    assert rules_fired(result)["reshape-transpose-reshape"] == 1
    assert op_types(out) == ["Transpose"]
    assert_equivalent(proto, out, dim_values={"batch": 3})


def test_reshape_transpose_reshape_not_when_the_merged_axis_moves():
    proto = parse(
        RTR.replace("PERM", "[1, 0, 2]")
        .replace("shape2 = Concat<axis = 0>(b, h, d, q)", "shape2 = Concat<axis = 0>(q, b, h, d)")
        .replace("float[batch, 4, 8, seq] y", "float[seq, batch, 4, 8] y")
    )
    _, result = run_passes(proto, ["symbolic-shapes"])
    assert "reshape-transpose-reshape" not in rules_fired(result)


def test_reshape_transpose_reshape_not_when_the_split_differs():
    # [b*4] split back as [4, b]: the same count, another order of the elements
    proto = parse(
        RTR.replace("PERM", "[0, 2, 1]")
        .replace("shape2 = Concat<axis = 0>(b, h, d, q)", "shape2 = Concat<axis = 0>(h, b, d, q)")
        .replace("float[batch, 4, 8, seq] y", "float[4, batch, 8, seq] y")
    )
    _, result = run_passes(proto, ["symbolic-shapes"])
    assert "reshape-transpose-reshape" not in rules_fired(result)


def test_reshape_transpose_reshape_not_when_the_intermediate_is_read_elsewhere():
    proto = parse(
        RTR.replace("PERM", "[0, 2, 1]").replace(
            "=> (float[batch, 4, 8, seq] y)", "=> (float[batch, 4, 8, seq] y, float[c, 8, seq] t)"
        )
    )
    _, result = run_passes(proto, ["symbolic-shapes"])
    assert "reshape-transpose-reshape" not in rules_fired(result)


def test_reshape_transpose_reshape_not_over_unproved_dims():
    # the tail's seq is read from another tensor whose dim has another name
    proto = parse(
        RTR.replace("PERM", "[0, 2, 1]")
        .replace("(float[batch, 4, seq, 8] x)", "(float[batch, 4, seq, 8] x, float[other] z)")
        .replace("q = Shape<start = 2, end = 3>(x)", "q = Shape(z)")
    )
    _, result = run_passes(proto, ["symbolic-shapes"])
    assert "reshape-transpose-reshape" not in rules_fired(result)


def test_inference_runs_again_once_a_pass_learned_a_shape_it_could_not():
    """A pass that learned a shape inference had not found (a Reshape target made constant):
    the values after it are inferred again, and ``learned`` says so."""
    import onnx_ir as ir

    from graphtrim.graph.shape_inference import ShapeInference

    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[N, 4] x, int64[P] s) => (float[M, K] z) {
          y = Reshape(x, s)
          r = Relu(y)
          z = Neg(r)
        }
        """
    )
    model = ir.serde.deserialize_model(proto)
    infer = ShapeInference(only_if_unknown=True)
    infer.call(model)
    reshape, relu, _ = list(model.graph)
    assert reshape.outputs[0].shape is None and relu.outputs[0].shape is None
    infer.call(model)  # nothing learned: nothing to retry
    assert relu.outputs[0].shape is None
    assert not infer.learned
    reshape.outputs[0].shape = ir.Shape(["N", 4])  # what symbolic-shapes proves
    infer.call(model)
    assert relu.outputs[0].shape is not None and list(relu.outputs[0].shape) == ["N", 4]
    assert infer.learned


def test_a_reshape_inference_cannot_read_keeps_its_rank_and_the_reads_after_it_resolve():
    """A Reshape to dims read from another value, with a -1 among them, defeats onnx's Reshape
    inference: its output has no shape at all, nor has anything after it. Its rank is the
    length of its shape tensor; with it the values downstream get their ranks, and a Reshape
    there whose entries read the input's own dims gets a constant shape."""
    import onnx_ir as ir

    from graphtrim.graph.shape_inference import ShapeInference

    text = """
        <ir_version: 8, opset_import: ["" : 13]>
        g (float[n, m, 2, 2] x, float[a, b, 4] y) => (float[p, q, 2, 3] z) {
            i0 = Constant<value = int64 {0}>()
            i1 = Constant<value = int64 {1}>()
            ax = Constant<value = int64[1] {0}>()
            sy = Shape(y)
            g0 = Gather<axis = 0>(sy, i0)
            g1 = Gather<axis = 0>(sy, i1)
            y0 = Unsqueeze(g0, ax)
            y1 = Unsqueeze(g1, ax)
            m1 = Constant<value = int64[1] {-1}>()
            ys = Concat<axis = 0>(y0, y1, m1)
            r = Reshape(x, ys)
            w = Constant<value = float[4, 6] {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                              13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24}>()
            o = MatMul(r, w)
            so = Shape(o)
            h0 = Gather<axis = 0>(so, i0)
            h1 = Gather<axis = 0>(so, i1)
            o0 = Unsqueeze(h0, ax)
            o1 = Unsqueeze(h1, ax)
            tail = Constant<value = int64[2] {2, 3}>()
            os = Concat<axis = 0>(o0, o1, tail)
            z = Reshape(o, os)
        }
    """
    proto = parse(text)
    model = ir.serde.deserialize_model(proto)
    ShapeInference().call(model)
    by_name = {n.outputs[0].name: n.outputs[0] for n in model.graph}
    assert by_name["r"].shape is not None and len(by_name["r"].shape) == 3
    assert by_name["o"].shape is not None and _dims(by_name["o"])[2] == 6

    out, result = run_passes(proto)
    assert rules_fired(result).get("reshape-copy-dims") == 1
    last = out.graph.node[-1]
    assert last.op_type == "Reshape"
    shape = next(i for i in out.graph.initializer if i.name == last.input[1])
    assert numpy_helper.to_array(shape).tolist() == [0, 0, 2, 3]
    # the first Reshape's entries are y's dims, which nothing proves equal to x's: it stays
    assert op_types(out).count("Shape") == 1
    assert_equivalent(proto, out, dim_values={"n": 3, "m": 5, "a": 3, "b": 5})


def _dims(value) -> list:
    return [d if isinstance(d, int) else d.value for d in value.shape.dims]


def test_a_dim_inference_could_only_name_unk_is_named_once_it_can_be():
    """A value carries ``unk__3`` where an earlier inference could not compute the dim (its
    input was unknown then): the next inference replaces it with what it computes now, and
    keeps the dims already known."""
    import onnx_ir as ir

    from graphtrim.graph.shape_inference import ShapeInference

    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[batch, 8] x) => (float[batch, 8] z) {
          r = Relu(x)
          z = Neg(r)
        }
        """
    )
    model = ir.serde.deserialize_model(proto)
    relu = next(iter(model.graph))
    relu.outputs[0].shape = ir.Shape(["unk__3", 8])
    infer = ShapeInference(only_if_unknown=True)
    infer.call(model)
    assert _dims(relu.outputs[0]) == ["batch", 8] and infer.learned


def test_dims_named_in_different_inference_runs_never_look_equal():
    """onnx names each dim it cannot compute ``unk__<n>``, counting from 0 in every run, and a
    value keeps the name it got until its dim is known: without names of their own run, a value
    named in a later run could carry the very names of another named earlier, and be taken as
    equal to it."""
    import onnx_ir as ir

    from graphtrim.graph.shape_inference import ShapeInference

    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[N, 4] x, int64[2] s) => (float[A, B] y) {
          r = Reshape(x, s)
          r1 = Relu(r)
          y = Neg(r1)
        }
        """
    )
    model = ir.serde.deserialize_model(proto)
    reshape, relu, _ = list(model.graph)
    infer = ShapeInference()
    names = []
    for _ in range(2):
        reshape.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
        reshape.outputs[0].shape = ir.Shape([None, None])  # rank known, sizes not
        relu.outputs[0].shape = None
        infer.call(model)
        names.append(_dims(relu.outputs[0]))
    assert all(isinstance(d, str) and d.startswith("unk__") for d in names[0] + names[1])
    assert not set(names[0]) & set(names[1]), names


def test_one_entry_nothing_proves_is_inferred_by_the_reshape():
    """The target's first entry is read from another tensor's dim, which nothing relates to the
    input's: as the only unproved entry it becomes -1 (the element count fixes it)."""
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[N, 64] x, float[K, 3] z) => (float[A, 8, 8] y) <int64[2] tail = {8, 8}, int64 zero = {0}, int64[1] ax = {0}> {
          s = Shape(z)
          k = Gather(s, zero)
          k1 = Unsqueeze(k, ax)
          target = Concat<axis = 0>(k1, tail)
          y = Reshape(x, target)
        }
        """
    )
    out, _ = run_passes(proto, passes=["symbolic-shapes", "dead-code"])
    assert op_types(out) == ["Reshape"]
    rng = np.random.default_rng(0)
    feeds = [
        {"x": rng.standard_normal((3, 64)).astype(np.float32), "z": np.zeros((3, 3), np.float32)}
    ]
    assert_equivalent(proto, out, inputs=feeds)
    # two unproved entries are left alone: the element count fixes only one
    two = parse(
        """
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[N, 64] x, float[K, J] z) => (float[A, B, 8] y) <int64[1] tail = {8}, int64[1] ax = {0}> {
          s = Shape(z)
          target = Concat<axis = 0>(s, tail)
          y = Reshape(x, target)
        }
        """
    )
    out, _ = run_passes(two, passes=["symbolic-shapes", "dead-code"])
    assert "Shape" in op_types(out)


def _same_padding_chain(links: int) -> onnx.ModelProto:
    """``links`` blocks of TensorFlow-style "same" padding computed from the input's height and
    width (Shape, Gather, Mod, Sub, Concat -> Pad), then a Conv: each block's padding
    depends on the shape the block before it produced, which inference computes only once that
    block's pads are constant."""
    rng = np.random.default_rng(0)
    nodes: list[onnx.NodeProto] = []
    inits = [
        numpy_helper.from_array(np.array(2, np.int64), "two"),
        numpy_helper.from_array(np.array([2], np.int64), "i2"),
        numpy_helper.from_array(np.array([3], np.int64), "i3"),
        numpy_helper.from_array(np.zeros(2, np.int64), "zeros2"),
        numpy_helper.from_array(np.zeros(4, np.int64), "zeros4"),
    ]
    y = "x"
    for k in range(links):
        w = rng.standard_normal((4, 4, 3, 3)).astype(np.float32) / 6
        inits.append(numpy_helper.from_array(w, f"w{k}"))
        nodes += [
            helper.make_node("Shape", [y], [f"s{k}"]),
            helper.make_node("Gather", [f"s{k}", "i2"], [f"h{k}"], axis=0),
            helper.make_node("Gather", [f"s{k}", "i3"], [f"w{k}_"], axis=0),
            # pad after = 2 - (size mod 2): an even size stays as it is through the 3x3 window
            helper.make_node("Mod", [f"h{k}", "two"], [f"hm{k}"]),
            helper.make_node("Mod", [f"w{k}_", "two"], [f"wm{k}"]),
            helper.make_node("Sub", ["two", f"hm{k}"], [f"ph{k}"]),
            helper.make_node("Sub", ["two", f"wm{k}"], [f"pw{k}"]),
            helper.make_node(
                "Concat", ["zeros2", "zeros4", f"ph{k}", f"pw{k}"], [f"pads{k}"], axis=0
            ),
            helper.make_node("Pad", [y, f"pads{k}"], [f"p{k}"]),
            helper.make_node(
                "Conv", [f"p{k}", f"w{k}"], [f"c{k}"], kernel_shape=[3, 3], strides=[1, 1]
            ),
        ]
        y = f"c{k}"
    nodes.append(helper.make_node("Relu", [y], ["y"]))
    graph = helper.make_graph(
        nodes,
        "same-padding",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 4, 16, 16])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 4, None, None])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def test_a_chain_of_computed_paddings_resolves_link_by_link_within_an_iteration():
    """Each link's pads fold once inference knows the previous Conv's output, which it knows
    only once that link's pads are constant: inference and the shape-resolving passes follow
    the chain at once instead of one fixed-point iteration per link (12 links: the 10-iteration
    cap would leave most of them)."""
    proto = _same_padding_chain(12)
    out, result = run_passes(proto)
    assert op_types(out) == ["Conv"] * 12 + ["Relu"], op_types(out)
    assert result.log.converged and result.log.iterations <= 3
    assert_equivalent(proto, out, dim_values={"batch": 2})


def test_sums_of_dims_get_one_canonical_name():
    from graphtrim.graph.passes import _dim_exprs as x

    assert x.add("past", 1) == "(past+1)"
    assert x.add(1, "past") == x.add("past", 1)  # the same sum, the same name
    assert x.add(x.add("past", 1), "seq") == "(past+seq+1)" == x.add(x.add("seq", "past"), 1)
    assert x.add(x.add("past", 1), 1, -1) == "past"  # back to the plain name
    assert x.add("past", "past", -1) == 0  # names that cancel leave a size
    assert x.scale(x.add("h", -1), 2) == "(2*h+-2)"
    assert x.terms("(a+b)") == {"a": 1, "b": 1} and x.terms("(not ours") == {"(not ours": 1}


KV = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[B, 4, P, 8] past, float[B, 4, 1, 8] cur) => (float[B, 4, T, 8] y, float[T] m)
  <int64 i0 = {0}, int64 i2 = {2}, int64 one = {1}, int64 zero = {0}, int64[1] ax = {0},
   int64[1] heads = {4}, int64[1] dim = {8}> {
    k = Concat<axis = 2>(past, cur)
    s = Shape(past)
    p = Gather<axis = 0>(s, i2)
    n = Add(p, one)
    r = Range(zero, n, one)
    m = Cast<to = 1>(r)
    sk = Shape(k)
    b = Gather<axis = 0>(sk, i0)
    bu = Unsqueeze(b, ax)
    nu = Unsqueeze(n, ax)
    target = Concat<axis = 0>(bu, heads, nu, dim)
    y = Reshape(k, target)
}
"""


def test_a_kv_cache_length_is_named_past_plus_one_and_proves_the_reshape_a_no_op():
    """The cache's length is past + 1, read once from the Concat and once from the past's
    Shape plus one: both are named ``(P+1)``, so the Reshape that rebuilds the cache's own shape
    proves a no-op and goes, with the arithmetic feeding it."""
    proto = parse(KV)
    out, result = run_passes(proto)
    fired = rules_fired(result)
    assert fired.get("concat-dims", 0) >= 1 and fired.get("range-dim", 0) >= 1
    assert "Reshape" not in op_types(out), op_types(out)
    # the outputs keep the names they were declared with
    dims = [
        [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in out.graph.output
    ]
    assert dims == [["B", 4, "T", 8], ["T"]]
    assert_equivalent(proto, out, dim_values={"B": 2, "P": 3})


def test_a_slice_keeps_the_dims_it_does_not_slice():
    from tests.optimizer_core.graph.rule_examples.shapes import SLICE_DIMS

    proto = parse(SLICE_DIMS)
    out, result = run_passes(proto)
    assert rules_fired(result)["slice-dims"] >= 1
    # the batch read back from the sliced table is its constant 1: Shape, Gather, Cast and Mul
    # of it are gone
    assert op_types(out) == ["Shape", "Gather", "Unsqueeze", "Slice", "Add"]
    assert_equivalent(proto, out, dim_values={"B": 2, "S": 8})


def test_a_sliced_axis_of_unknown_length_stays_unknown():
    # the axis sliced to a computed end has no size the rule can prove: it stays unnamed
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B, S] x, int64[1] e) => (float[B, S] y)
          <float[4, 16] t = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                             0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                             0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                             0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
           int64[1] z = {0}, int64[1] one = {1}, int64 i1 = {1}> {
            p = Slice(t, z, e, one)
            ps = Shape(p)
            n = Gather<axis = 0>(ps, i1)
            nf = Cast<to = 1>(n)
            y = Mul(x, nf)
        }
        """
    )
    out, _ = run_passes(proto)
    assert "Cast" in op_types(out)  # dim 1 of the slice is not known: nothing folds


def test_a_slice_of_a_computed_tensor_is_not_renamed():
    """A channel split of an activation (TorchScript's chunk: the half read from its Shape) has
    the dims inference gives it: renaming it would only cost another inference round."""
    proto = parse(
        """
<ir_version: 8, opset_import: ["" : 17]>
g (float[B, 3, H, W] x, float[8, 3, 3, 3] w) => (float[B, 4, H, W] y) {
    r = Conv<pads = [1, 1, 1, 1]>(x, w)
    s = Shape(r)
    i1 = Constant<value = int64[1] {1}>()
    two = Constant<value = int64[1] {2}>()
    lo = Constant<value = int64[1] {0}>()
    c = Gather<axis = 0>(s, i1)
    c1 = Add(c, i1)
    half = Div(c1, two)
    y = Slice(r, lo, half, i1)
}
"""
    )
    out, result = run_passes(proto)
    assert "slice-dims" not in rules_fired(result)
    assert op_types(out) == ["Conv", "Slice"]
    assert_equivalent(proto, out, dim_values={"B": 2, "H": 3, "W": 3})


# MobileViT's unfold into patches and back, as the TorchScript exporter writes it: the batch is
# merged into the patch axis, and the targets that split it off again read it from the input
UNFOLD = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[batch, 32, 8, 8] x) => (float[batch, 4, 16, 32] y)
  <int64[4] patches = {-1, 2, 4, 2}, int64[4] back = {-1, 32, 16, 4}, int64 zero = {0},
   int64[1] ax = {0}, int64 four = {4}, int64[2] t3 = {16, -1}, int64[3] t4 = {4, 16, -1}> {
    s = Shape(x)
    b = Gather(s, zero)
    bu = Unsqueeze(b, ax)
    b4 = Mul(b, four)
    b4u = Unsqueeze(b4, ax)
    r1 = Reshape(x, patches)
    t1 = Transpose<perm = [0, 2, 1, 3]>(r1)
    r2 = Reshape(t1, back)
    t2 = Transpose<perm = [0, 3, 2, 1]>(r2)
    s3 = Concat<axis = 0>(b4u, t3)
    r3 = Reshape(t2, s3)
    s4 = Concat<axis = 0>(bu, t4)
    y = Reshape(r3, s4)
}
"""


def test_a_minus_one_over_a_multiple_of_a_dim_is_named_and_the_batch_split_resolves():
    """[(128*batch), 4, 2, 2] reshaped to [-1, 32, 16, 4] has batch in front (the element count
    over the other entries); with it, both targets computed from the batch become constants:
    [4*batch, 16, -1] of [batch, 4, 16, 32] is [-1, 16, 32], and [batch, 4, 16, -1] of
    [4*batch, 16, 32] is [-1, 4, 16, 32]."""
    proto = parse(UNFOLD)
    out, result = run_passes(proto, ["symbolic-shapes", "dead-code"])
    assert "Shape" not in op_types(out), op_types(out)
    assert rules_fired(result)["reshape-copy-dims"] == 2
    consts = {i.name: list(numpy_helper.to_array(i)) for i in out.graph.initializer}
    targets = [consts[n.input[1]] for n in out.graph.node if n.op_type == "Reshape"]
    assert targets[-2:] == [[-1, 16, 32], [-1, 4, 16, 32]]
    assert_equivalent(proto, out, dim_values={"batch": 3})


def test_a_minus_one_that_is_no_whole_dim_stays_unnamed():
    from graphtrim.graph.passes import _dim_exprs as x

    assert x.quotient(x.product(["(128*batch)", 4, 2, 2]), x.product([32, 16, 4])) == "batch"
    assert x.quotient(x.product(["batch", 64]), x.product([16])) == "(4*batch)"
    assert x.quotient(x.product(["(past+1)", 8]), x.product([4])) == "(2*past+2)"
    assert x.quotient(x.product(["batch", 4]), x.product([8])) is None  # half a batch
    assert x.quotient(x.product(["batch", "seq"]), x.product([1])) is None  # no dim name
    assert x.quotient(x.product(["batch", 4]), x.product(["seq"])) is None
    assert x.quotient(x.product(["batch", 0]), x.product([4])) is None  # empty: undetermined
    # the pass leaves such a Reshape's output as inference had it
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[batch, 4] x) => (float[A, 8] y) <int64[2] t = {-1, 8}> {
            y = Reshape(x, t)
        }
        """
    )
    _, result = run_passes(proto, ["symbolic-shapes"])
    assert "reshape-dims" not in rules_fired(result)


def test_renamed_dims_are_carried_through_ops_that_keep_permute_or_broadcast_them():
    """A dim named by a rewrite reaches the values after it at once through Transpose, unary
    and broadcasting ops and MatMul (computed as the op does), with no inference round between:
    only what those ops cannot compute is forgotten for inference to redo."""
    import onnx_ir as ir

    from graphtrim.graph.passes._symbolic_dims import _broadcast, rename

    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[batch, 8, 4] x, float[4, 6] w) => (float[M, 8, 6] y, float[M, 4, 1, 8] z)
          <int64[3] s = {-1, 4, 8}, float[8, 1] bias = {1, 2, 3, 4, 5, 6, 7, 8}, int64[1] ax = {2}> {
          r = Reshape(x, s)
          t = Transpose<perm = [0, 2, 1]>(r)
          a = Relu(t)
          b = Add(a, bias)
          c = Transpose<perm = [0, 2, 1]>(b)
          y = MatMul(b, w)
          z = Unsqueeze(c, ax)
        }
        """
    )
    model = ir.serde.deserialize_model(proto)
    values = {v.name: v for n in model.graph for v in n.outputs}
    tails = {
        "r": [4, 8],
        "t": [8, 4],
        "a": [8, 4],
        "b": [8, 4],
        "c": [4, 8],
        "y": [8, 6],
        "z": [4, 1, 8],
    }
    for name, tail in tails.items():  # as inference left them, not knowing r's first dim
        values[name].shape = ir.Shape(["unk__1_0", *tail])
    forgotten: list[ir.Value] = []
    assert rename(values["r"], ["batch", 4, 8], forgotten)
    assert _dims(values["t"]) == ["batch", 8, 4]
    assert _dims(values["b"]) == ["batch", 8, 4]
    assert _dims(values["c"]) == ["batch", 4, 8]
    assert _dims(values["y"]) == ["batch", 8, 6]
    # Unsqueeze is not computed here: its output is left to inference
    assert values["z"] in forgotten and values["z"].shape is None
    assert forgotten == [values["z"]]
    # a broadcast decides a dim from a 1, an equal dim, or a size against a name, never from
    # two different names (either may be 1)
    assert [_broadcast(1, "a"), _broadcast("a", 4), _broadcast(4, 4), _broadcast("a", "b")] == [
        "a",
        4,
        4,
        None,
    ]


def test_no_name_is_built_on_a_dim_inference_could_not_compute():
    """``(64*unk__4_5)`` would name a multiple of a placeholder: inference forgets and
    recomputes ``unk__`` dims each run, but a name built on one would stay and hide what it
    computes later (a Swin TorchScript export stopped resolving its window shapes)."""
    import onnx_ir as ir

    from graphtrim.graph.passes._symbolic_dims import rename

    value = ir.Value(name="v", shape=ir.Shape(["unk__4_5", 3]))
    forgotten: list[ir.Value] = []
    assert not rename(value, ["(64*unk__4_5)", 3], forgotten)
    assert _dims(value) == ["unk__4_5", 3]
    assert rename(value, ["(64*batch)", 3], forgotten)


def test_a_tile_by_constant_repeats_multiplies_the_named_dims():
    """onnx's inference cannot name ``Tile([B, 8], [4, 1])``'s first dim; named ``(4*B)``, it
    is the windows' own, and what is computed from both knows it (GC ViT's global query)."""
    import onnx_ir as ir

    from graphtrim.graph.passes.shapes import SymbolicShapes
    from graphtrim.graph.shape_inference import ShapeInference
    from tests.optimizer_core.graph.rule_examples.shapes import TILE_DIMS

    model = ir.serde.deserialize_model(parse(TILE_DIMS))
    ShapeInference().call(model)
    values = {v.name: v for n in model.graph for v in n.outputs}
    assert _dims(values["s"])[0] != "(4*B)"
    SymbolicShapes().call(model)
    assert _dims(values["t"]) == ["(4*B)", 8]
    assert _dims(values["s"]) == ["(4*B)", 8]


def test_a_reshape_to_a_sum_of_dims_with_allowzero_is_named():
    """torch's dynamo exporter: ``Reshape<allowzero=1>(x, [batch, 4, past + seq, 8])`` with the
    sum computed from two shapes and made 1-D by a Reshape; the output is named entry by entry,
    so the transpose after it resolves."""
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[batch, 2, 2, T, 8] x, float[batch, past, 1] p, float[batch, seq, 1] s)
            => (float[batch, 4, 8, T] y) {
            b = Shape<start = 0, end = 1>(x)
            pl = Shape<start = 1, end = 2>(p)
            sl = Shape<start = 1, end = 2>(s)
            ps = Squeeze(pl)
            ss = Squeeze(sl)
            total = Add(ps, ss)
            flat = Constant<value = int64[1] {-1}>()
            t1 = Reshape(total, flat)
            four = Constant<value = int64[1] {4}>()
            eight = Constant<value = int64[1] {8}>()
            shape = Concat<axis = 0>(b, four, t1, eight)
            r = Reshape<allowzero = 1>(x, shape)
            y = Transpose<perm = [0, 1, 3, 2]>(r)
        }
        """
    )
    import onnx_ir as ir

    from graphtrim.graph.passes._symbolic_dims import named
    from graphtrim.graph.passes.shapes import SymbolicShapes
    from graphtrim.graph.shape_inference import ShapeInference

    model = ir.from_proto(proto)
    ShapeInference().call(model)
    SymbolicShapes().call(model)
    r = next(n for n in model.graph if n.op_type == "Reshape" and n.outputs[0].name == "r")
    assert named(r.outputs[0]) == ["batch", 4, "(past+seq)", 8]


# tf2onnx writes TensorFlow's int32 shapes: Shape -> Cast(int32) -> StridedSlice -> Pack -> Cast
INT32_SHAPE = """
<ir_version: 8, opset_import: ["" : 13]>
g (float[batch, 8] x) => (float[batch, 2, 4] y) {
    s = Shape(x)
    s32 = Cast<to = {to}>(s)
    st = Constant<value = int64[1] {0}>()
    en = Constant<value = int64[1] {1}>()
    b = Slice(s32, st, en, st)
    tail = Constant<value = {dtype}[2] {2, 4}>()
    shape32 = Concat<axis = 0>(b, tail)
    shape = Cast<to = 7>(shape32)
    y = Reshape(x, shape)
}
"""


def test_a_shape_computed_in_int32_gets_a_constant_shape():
    proto = parse(INT32_SHAPE.replace("{to}", "6").replace("{dtype}", "int32"))
    out, result = run_passes(proto, ["symbolic-shapes", "dead-code"])
    assert op_types(out) == ["Reshape"]
    assert rules_fired(result) == {"reshape-copy-dims": 1}
    shape = next(i for i in out.graph.initializer if i.name == out.graph.node[0].input[1])
    assert list(numpy_helper.to_array(shape)) == [0, 2, 4]
    assert_equivalent(proto, out, dim_values={"batch": 3})


def test_a_shape_cast_through_float_is_not_read():
    proto = parse(INT32_SHAPE.replace("{to}", "1").replace("{dtype}", "float"))
    out, result = run_passes(proto, ["symbolic-shapes"])
    assert "reshape-copy-dims" not in rules_fired(result)
    assert op_types(out) == op_types(proto)


def test_a_constant_entry_outside_int32_is_not_read_through_the_cast():
    import onnx_ir as ir

    from graphtrim.graph.passes._symbolic_dims import Dim, shape_entries

    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 15]>
        g (float[batch, 8] x) => (int64[3] y) {
            s = Shape<end = 1>(x)
            big = Constant<value = int64[2] {4294967298, 4}>()
            c = Concat<axis = 0>(s, big)
            c32 = Cast<to = 6>(c)
            y = Cast<to = 7>(c32)
        }
        """
    )
    from graphtrim.graph.shape_inference import ShapeInference

    model = ir.serde.deserialize_model(proto)
    ShapeInference().call(model)
    assert shape_entries(model.graph.outputs[0]) == [Dim("batch"), None, 4]


# SqueezeBERT's attention: query, key and value are 1x1 Convs of one input over an unnamed
# sequence dim, and each head split reads that dim back from its own projection
QKV_READS = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[B, 4, ?] x) => (float[B, 2, 2, ?] q, float[B, 2, 2, ?] k, float[B, 2, 2, ?] v)
  <float[4, 4, 1] wq = {1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1},
   float[4, 4, 1] wk = {0, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 0},
   float[4, 4, 3] wv = {WV},
   int64 i0 = {0}, int64 i2 = {2}, int64[1] ax = {0}, int64[2] heads = {2, 2}> {
    t = Relu(x)
    cq = Conv<kernel_shape = [1]>(t, wq)
    ck = Conv<kernel_shape = [1]>(t, wk)
    cv = Conv<kernel_shape = [3], pads = [1, 1]>(t, wv)
    sq = Shape(cq)
    sk = Shape(ck)
    sv = Shape(cv)
    bq = Gather<axis = 0>(sq, i0)
    nq = Gather<axis = 0>(sq, i2)
    bk = Gather<axis = 0>(sk, i0)
    nk = Gather<axis = 0>(sk, i2)
    bv = Gather<axis = 0>(sv, i0)
    nv = Gather<axis = 0>(sv, i2)
    bqu = Unsqueeze(bq, ax)
    nqu = Unsqueeze(nq, ax)
    bku = Unsqueeze(bk, ax)
    nku = Unsqueeze(nk, ax)
    bvu = Unsqueeze(bv, ax)
    nvu = Unsqueeze(nv, ax)
    shq = Concat<axis = 0>(bqu, heads, nqu)
    shk = Concat<axis = 0>(bku, heads, nku)
    shv = Concat<axis = 0>(bvu, heads, nvu)
    q = Reshape(cq, shq)
    k = Reshape(ck, shk)
    v = Reshape(cv, shv)
}
"""


def _qkv(window: str = "same") -> onnx.ModelProto:
    weights = ", ".join(f"{w:.3f}" for w in np.linspace(-1, 1, 48))
    text = QKV_READS.replace("WV", weights)
    if window != "same":
        text = text.replace("pads = [1, 1]", "pads = [0, 0]")
    return parse(text)


def _shape_inputs(model: onnx.ModelProto) -> list[str]:
    return sorted(n.input[0] for n in model.graph.node if n.op_type == "Shape")


def test_reads_of_one_unnamed_dim_through_different_convs_become_one_read():
    proto = _qkv()
    out, result = run_passes(proto)
    assert rules_fired(result)["shape-read-origin"] == 3
    # the batch and the sequence are read from the Relu's input once, for all three splits
    assert _shape_inputs(out) == ["x"]
    assert op_types(out).count("Concat") == 1
    assert (
        len(out.graph.node) == len(proto.graph.node) - 12
    )  # 3 Shapes, 6 Gathers, 6 Unsqueezes, 3 Concats: 1, 2, 2, 1
    assert_equivalent(proto, out, dim_values={"B": 2})
    for n in (5, 9):
        feeds = {"x": np.random.default_rng(n).standard_normal((2, 4, n)).astype(np.float32)}
        assert_equivalent(proto, out, inputs=[feeds])


def test_a_window_that_shortens_the_dim_keeps_its_own_read():
    # a 3-wide window without pads: the value's sequence is 2 shorter than the input's
    proto = _qkv(window="valid")
    out, _ = run_passes(proto)
    reads = _shape_inputs(out)
    assert "x" in reads and len(reads) == 2
    assert next(r for r in reads if r != "x") != "x"
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 4, 7)).astype(np.float32)}
    assert_equivalent(proto, out, inputs=[feeds])


def _one_read_moved(text: str) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """The model of ``text`` and its ``symbolic-shapes`` output, where one read moved."""
    proto = parse(text)
    out, result = run_passes(proto, ["symbolic-shapes"])
    assert rules_fired(result) == {"shape-read-origin": 1}
    return proto, out


def test_a_broadcast_of_two_unrelated_unnamed_dims_is_not_followed():
    # Add([B, ?a], [B, ?b]) is one of the two at run time, but nothing says which
    proto, out = _one_read_moved(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B, ?] a, float[B, ?] b) => (int64[1] y, float[B, ?] z) <int64[1] i1 = {1}> {
            s = Add(a, b)
            r = Relu(s)
            z = Neg(s)
            sh = Shape(r)
            y = Gather<axis = 0>(sh, i1)
        }
        """
    )
    # the read moves up to the sum, not to either side of it
    shape = next(n for n in out.graph.node if n.op_type == "Shape")
    assert shape.input[0] == "s"
    feeds = {"a": np.ones((2, 3), np.float32), "b": np.ones((2, 1), np.float32)}
    assert_equivalent(proto, out, inputs=[feeds])


def test_a_moved_read_is_placed_next_to_the_value_it_reads():
    # the read of x's dims no longer waits for the last Relu, so x's buffer is not kept for it
    proto, out = _one_read_moved(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, ?] a) => (float[2, ?] y, int64[1] n) <int64[1] i1 = {1}> {
            x = Neg(a)
            r1 = Relu(x)
            r2 = Sigmoid(r1)
            y = Relu(r2)
            sh = Shape(r2)
            n = Gather<axis = 0>(sh, i1)
        }
        """
    )
    assert [n.op_type for n in out.graph.node][:2] == ["Shape", "Neg"]
    assert out.graph.node[0].input[0] == "a"
    feeds = {"a": np.ones((2, 5), np.float32)}
    assert_equivalent(proto, out, inputs=[feeds])


def test_an_unnamed_dim_read_from_the_value_it_comes_from_is_copied():
    # the batch of x read from x itself, for a Reshape of Relu(x): unnamed, but one dim
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[?, 4, 8] x) => (float[?, 32] y) <int64 i0 = {0}, int64[1] ax = {0}, int64[1] m1 = {-1}> {
            r = Relu(x)
            s = Shape(x)
            b = Gather<axis = 0>(s, i0)
            bu = Unsqueeze(b, ax)
            shape = Concat<axis = 0>(bu, m1)
            y = Reshape(r, shape)
        }
        """
    )
    out, result = run_passes(proto, ["symbolic-shapes"])
    assert rules_fired(result)["reshape-copy-dims"] == 1
    reshape = next(n for n in out.graph.node if n.op_type == "Reshape")
    shape = next(i for i in out.graph.initializer if i.name == reshape.input[1])
    assert list(numpy_helper.to_array(shape)) == [0, -1]
    feeds = {"x": np.ones((3, 4, 8), np.float32)}
    assert_equivalent(proto, out, inputs=[feeds])


def test_a_read_does_not_branch_a_value_that_feeds_one_node():
    # the strided Conv's length is its own (the origin); reading it there would give the Conv
    # a second reader, and runtimes fuse a Conv into its activation only when it has one
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 4, ?] x) => (float[2, 4, ?] y, int64[1] n)
          <float[4, 4, 3] w = {WV}, int64[1] i2 = {2}> {
            c = Conv<kernel_shape = [3], strides = [2]>(x, w)
            r = Relu(c)
            y = Sigmoid(r)
            sh = Shape(y)
            n = Gather<axis = 0>(sh, i2)
        }
        """.replace("WV", ", ".join(f"{w:.3f}" for w in np.linspace(-1, 1, 48)))
    )
    out, result = run_passes(proto, ["symbolic-shapes"])
    assert "shape-read-origin" not in rules_fired(result)
    readers = [n.op_type for n in out.graph.node if "c" in n.input]
    assert readers == ["Relu"]
    # given a second reader, the Conv's output is where the read goes
    two = onnx.ModelProto()
    two.CopyFrom(proto)
    two.graph.node.append(helper.make_node("Neg", ["c"], ["m"]))
    two.graph.output.append(helper.make_tensor_value_info("m", onnx.TensorProto.FLOAT, None))
    out, result = run_passes(two, ["symbolic-shapes"])
    assert rules_fired(result) == {"shape-read-origin": 1}
    assert next(n for n in out.graph.node if n.op_type == "Shape").input[0] == "c"
    feeds = {"x": np.ones((2, 4, 9), np.float32)}
    assert_equivalent(two, out, inputs=[feeds])


def test_the_shape_of_a_scalar_is_left_where_it_is_read():
    # torchvision's detectors read the shape of a computed scalar (an empty list)
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N] x) => (float[N] y) <int64[1] i0 = {0}> {
            m = ReduceMax<keepdims = 0>(x)
            s = Shape(m)
            f = ConstantOfShape<value = float[1] {1.0}>(s)
            t = Mul(m, f)
            y = Add(x, t)
        }
        """
    )
    out, result = run_passes(proto, ["symbolic-shapes"])
    assert "shape-read-origin" not in rules_fired(result)
    assert_equivalent(proto, out, inputs=[{"x": np.arange(4, dtype=np.float32)}])
