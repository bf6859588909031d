"""Affine fusions into Conv and BatchNormalization."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper, numpy_helper

from graphtrim.graph.passes.fusion import AffineFusion
from tests.helpers import assert_equivalent, op_types, rules_fired, run_passes

RNG = np.random.default_rng(0)


def _init(name, arr):
    return numpy_helper.from_array(np.asarray(arr, dtype=np.float32), name)


def _x_to_y(nodes: list, inits: list, shape: list) -> onnx.ModelProto:
    """An opset-17 model of ``nodes`` from float input ``x`` to output ``y`` of one ``shape``."""
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, shape)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _conv_model(
    follow: list[str], *, shared_weight: bool = False, bias: bool = True
) -> onnx.ModelProto:
    """x -> Conv(W, B) -> [BN] [Mul c] [Add c] -> Relu -> y (and optionally a second Conv on W)."""
    inits = [_init("W", RNG.standard_normal((4, 3, 3, 3)))]
    if bias:
        inits.append(_init("B", RNG.standard_normal(4)))
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"] if bias else ["x", "W"], ["c"], pads=[1, 1, 1, 1])
    ]
    cur = "c"
    for i, op in enumerate(follow):
        out = f"f{i}"
        if op == "BN":
            inits += [
                _init("g", RNG.uniform(0.5, 1.5, 4)),
                _init("b", RNG.standard_normal(4)),
                _init("m", RNG.standard_normal(4)),
                _init("v", RNG.uniform(0.5, 2.0, 4)),
            ]
            nodes.append(
                helper.make_node(
                    "BatchNormalization", [cur, "g", "b", "m", "v"], [out], epsilon=1e-3
                )
            )
        else:
            inits.append(_init(f"k{i}", RNG.standard_normal((4, 1, 1))))
            nodes.append(helper.make_node(op, [cur, f"k{i}"], [out]))
        cur = out
    nodes.append(helper.make_node("Relu", [cur], ["y"]))
    outputs = [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 4, 8, 8])]
    if shared_weight:
        nodes.append(helper.make_node("Conv", ["x", "W"], ["z"], pads=[1, 1, 1, 1]))
        outputs.append(helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, ["N", 4, 8, 8]))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 3, 8, 8])],
        outputs,
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(
    ("follow", "rules"),
    [
        (["BN"], {"conv-bn"}),
        (["Mul"], {"conv-mul"}),
        (["Add"], {"conv-add"}),
        (["BN", "Mul", "Add"], {"conv-bn", "conv-mul", "conv-add"}),
    ],
    ids=["conv-bn", "conv-mul", "conv-add", "conv-bn-mul-add"],
)
def test_affine_ops_fold_into_conv(follow, rules):
    proto = _conv_model(follow)
    out, result = run_passes(proto, ["fuse-affine", "dead-code"])
    assert op_types(out) == ["Conv", "Relu"]
    assert rules <= set(rules_fired(result))
    assert_equivalent(proto, out, rtol=1e-5, atol=1e-5)


def test_conv_without_bias_gets_one():
    proto = _conv_model(["BN"], bias=False)
    out, _ = run_passes(proto, ["fuse-affine", "dead-code"])
    assert op_types(out) == ["Conv", "Relu"]
    assert len(out.graph.node[0].input) == 3
    assert_equivalent(proto, out, rtol=1e-5, atol=1e-5)


def test_tied_weight_with_a_different_reader_is_not_untied():
    proto = _conv_model(["BN"], shared_weight=True)
    out, result = run_passes(proto, ["fuse-affine", "dead-code"])
    # the weight also feeds a plain Conv: fusing would need a second copy of it
    assert "BatchNormalization" in op_types(out)
    assert "conv-bn" not in rules_fired(result)
    assert len(out.graph.initializer) == len(proto.graph.initializer)


def test_mul_that_broadcasts_beyond_channels_is_not_folded():
    proto = _conv_model(["Mul"])
    k = next(i for i in proto.graph.initializer if i.name == "k0")
    k.CopyFrom(_init("k0", RNG.standard_normal((4, 8, 1))))  # varies along H: not per channel
    out, _ = run_passes(proto, ["fuse-affine", "dead-code"])
    assert "Mul" in op_types(out)
    assert_equivalent(proto, out)


def test_mul_and_add_fold_into_batchnorm():
    nodes = [
        helper.make_node("BatchNormalization", ["x", "g", "b", "m", "v"], ["n"]),
        helper.make_node("Mul", ["n", "s"], ["p"]),
        helper.make_node("Add", ["p", "t"], ["y"]),
    ]
    inits = [
        _init("g", RNG.uniform(0.5, 1.5, 3)),
        _init("b", RNG.standard_normal(3)),
        _init("m", RNG.standard_normal(3)),
        _init("v", RNG.uniform(0.5, 2, 3)),
        _init("s", RNG.standard_normal((3, 1, 1))),
        _init("t", RNG.standard_normal((1, 3, 1, 1))),
    ]
    proto = _x_to_y(nodes, inits, ["N", 3, 4, 4])
    out, result = run_passes(proto, ["fuse-affine", "dead-code"])
    assert op_types(out) == ["BatchNormalization"]
    assert {"bn-mul", "bn-add"} <= set(rules_fired(result))
    assert_equivalent(proto, out, rtol=1e-5, atol=1e-5)


def test_uniform_fill_weights_stay_fills():
    """A weight made by ConstantOfShape is scaled by rewriting the fill value, not materialized."""
    shape_init = numpy_helper.from_array(np.array([64, 3, 3, 3], dtype=np.int64), "wshape")
    fill = helper.make_tensor("fill", onnx.TensorProto.FLOAT, [1], [0.02])
    nodes = [
        helper.make_node("ConstantOfShape", ["wshape"], ["W"], value=fill),
        helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["y"]),
    ]
    inits = [
        shape_init,
        _init("g", np.full(64, 1.5)),
        _init("b", np.full(64, 0.25)),
        _init("m", np.full(64, 0.1)),
        _init("v", np.full(64, 2.0)),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 64, 8, 8])],
        inits,
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    out, result = run_passes(proto, preset="default")
    assert "BatchNormalization" not in op_types(out)
    assert "ConstantOfShape" in op_types(out)  # the 64x3x3x3 weight was not materialized
    assert "conv-bn" in rules_fired(result)
    assert_equivalent(proto, out, rtol=1e-5, atol=1e-5)


def test_fusion_is_not_in_the_safe_preset():
    from graphtrim.graph.presets import PRESETS

    assert "fuse-affine" not in PRESETS["safe"]
    assert "fuse-affine" in PRESETS["default"]


def _conv_transpose_model(
    follow: list[str],
    *,
    group: int = 1,
    c_out: int = 6,
    bias: bool = True,
    second_reader: str | None = None,
    second_follow: str | None = None,
) -> onnx.ModelProto:
    """x [N, 4, 5, 5] -> ConvTranspose(W [4, c_out / group, 3, 3], B) -> [BN] [Mul c] [Add c] -> y.

    ``second_reader`` adds a second node on ``W`` (a "ConvTranspose" of the same group, or a
    "Conv" reading it with the other layout), followed by ``second_follow`` ("Mul": the same
    per-channel constant as the first Mul) when given.
    """
    c_in = 4
    inits = [_init("W", RNG.standard_normal((c_in, c_out // group, 3, 3)))]
    if bias:
        inits.append(_init("B", RNG.standard_normal(c_out)))
    attrs = {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 0], "group": group}
    nodes = [
        helper.make_node("ConvTranspose", ["x", "W", "B"] if bias else ["x", "W"], ["c"], **attrs)
    ]
    cur = "c"
    for i, op in enumerate(follow):
        out = f"f{i}"
        if op == "BN":
            inits += [
                _init("g", RNG.uniform(0.5, 1.5, c_out)),
                _init("b", RNG.standard_normal(c_out)),
                _init("m", RNG.standard_normal(c_out)),
                _init("v", RNG.uniform(0.5, 2.0, c_out)),
            ]
            nodes.append(
                helper.make_node(
                    "BatchNormalization", [cur, "g", "b", "m", "v"], [out], epsilon=1e-3
                )
            )
        else:
            inits.append(_init(f"k{i}", RNG.standard_normal((c_out, 1, 1))))
            nodes.append(helper.make_node(op, [cur, f"k{i}"], [out]))
        cur = out
    nodes.append(helper.make_node("Relu", [cur], ["y"]))
    outputs = [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", c_out, 10, 9])]
    if second_reader == "ConvTranspose":
        nodes.append(helper.make_node("ConvTranspose", ["x", "W"], ["z0"], **attrs))
        out_dims = ["N", c_out, 10, 9]
    elif second_reader == "Conv":
        assert group == 1
        nodes.append(helper.make_node("Conv", ["x", "W"], ["z0"], pads=[1, 1, 1, 1]))
        out_dims = ["N", c_in, 5, 5]
    if second_reader is not None:
        if second_follow == "Mul":
            nodes.append(helper.make_node("Mul", ["z0", "k0"], ["z"]))
        else:
            nodes.append(helper.make_node("Identity", ["z0"], ["z"]))
        outputs.append(helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, out_dims))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", c_in, 5, 5])],
        outputs,
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize(
    ("follow", "rules"),
    [
        (["BN"], {"convtranspose-bn"}),
        (["Mul"], {"convtranspose-mul"}),
        (["Add"], {"convtranspose-add"}),
        (["BN", "Mul", "Add"], {"convtranspose-bn", "convtranspose-mul", "convtranspose-add"}),
    ],
    ids=["bn", "mul", "add", "bn-mul-add"],
)
def test_affine_ops_fold_into_conv_transpose(follow, rules, group):
    proto = _conv_transpose_model(follow, group=group)
    out, result = run_passes(proto, ["fuse-affine", "dead-code"])
    assert op_types(out) == ["ConvTranspose", "Relu"]
    assert set(rules_fired(result)) == rules
    assert_equivalent(proto, out, rtol=1e-5, atol=1e-5, dim_values={"N": 2})


@pytest.mark.parametrize("group", [1, 2])
def test_conv_transpose_without_bias_gets_one(group):
    proto = _conv_transpose_model(["BN"], group=group, bias=False)
    out, result = run_passes(proto, ["fuse-affine", "dead-code"])
    assert op_types(out) == ["ConvTranspose", "Relu"]
    assert len(out.graph.node[0].input) == 3
    assert rules_fired(result) == {"convtranspose-bn": 1}
    assert_equivalent(proto, out, rtol=1e-5, atol=1e-5, dim_values={"N": 2})


@pytest.mark.parametrize("group", [1, 2])
def test_conv_transpose_weight_shared_with_another_node_is_kept(group):
    proto = _conv_transpose_model(["BN"], group=group, second_reader="ConvTranspose")
    out, result = run_passes(proto, ["fuse-affine", "dead-code"])
    assert "BatchNormalization" in op_types(out)
    assert not rules_fired(result)
    assert len(out.graph.initializer) == len(proto.graph.initializer)
    assert_equivalent(proto, out, dim_values={"N": 2})


def test_tied_conv_transpose_weights_with_the_same_scale_stay_tied():
    proto = _conv_transpose_model(
        ["Mul"], group=2, second_reader="ConvTranspose", second_follow="Mul"
    )
    out, result = run_passes(proto, ["fuse-affine", "dead-code"])
    assert "Mul" not in op_types(out)
    assert rules_fired(result) == {"convtranspose-mul": 2}
    weights = {n.input[1] for n in out.graph.node if n.op_type == "ConvTranspose"}
    assert len(weights) == 1  # both read the one rewritten weight
    assert_equivalent(proto, out, rtol=1e-5, atol=1e-5, dim_values={"N": 2})


def test_weight_read_by_conv_and_conv_transpose_is_kept():
    # W [4, 4, 3, 3] read with both layouts: no single rewritten weight serves both
    proto = _conv_transpose_model(["Mul"], c_out=4, second_reader="Conv", second_follow="Mul")
    out, result = run_passes(proto, ["fuse-affine", "dead-code"])
    assert op_types(out).count("Mul") == 2
    assert not rules_fired(result)
    assert_equivalent(proto, out, dim_values={"N": 2})


@pytest.mark.parametrize(("uniform", "fused"), [(True, True), (False, False)])
def test_conv_transpose_fill_weight_needs_a_uniform_scale(uniform, fused):
    shape_init = numpy_helper.from_array(np.array([4, 3, 3, 3], dtype=np.int64), "wshape")
    fill = helper.make_tensor("fill", onnx.TensorProto.FLOAT, [1], [0.02])
    scale = np.full((6, 1, 1), 1.5) if uniform else RNG.uniform(0.5, 1.5, (6, 1, 1))
    nodes = [
        helper.make_node("ConstantOfShape", ["wshape"], ["W"], value=fill),
        helper.make_node("ConvTranspose", ["x", "W"], ["c"], group=2),
        helper.make_node("Mul", ["c", "s"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4, 5, 5])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 6, 7, 7])],
        [shape_init, _init("s", scale)],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(proto, full_check=True)
    out, result = run_passes(proto, ["fuse-affine", "dead-code"])
    assert "ConstantOfShape" in op_types(out)  # the weight is never materialized
    assert ("Mul" not in op_types(out)) == fused
    assert ("convtranspose-mul" in rules_fired(result)) == fused
    assert_equivalent(proto, out, rtol=1e-5, atol=1e-5, dim_values={"N": 2})


def _scaled_input_conv(
    c_shape: tuple[int, ...], *, group: int = 1, extra_reader: bool = False
) -> onnx.ModelProto:
    """x -> Relu -> Mul c -> Conv(W, B, group) -> y: a scale in front of a Conv (NF-ResNet's
    scaled activations, a normalization folded into the next layer's input)."""
    c_in, c_out = 4, 8
    inits = [
        _init("W", RNG.standard_normal((c_out, c_in // group, 3, 3))),
        _init("B", RNG.standard_normal(c_out)),
        _init("c", RNG.uniform(0.5, 2.0, c_shape)),
    ]
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Mul", ["r", "c"], ["s"]),
        helper.make_node("Conv", ["s", "W", "B"], ["y"], pads=[1, 1, 1, 1], group=group),
    ]
    outputs = [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", c_out, 8, 8])]
    if extra_reader:
        nodes.append(helper.make_node("Neg", ["s"], ["z"]))
        outputs.append(
            helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, ["N", c_in, 8, 8])
        )
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", c_in, 8, 8])],
        outputs,
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize(
    ("c_shape", "group"),
    [((), 1), ((1,), 1), ((4, 1, 1), 1), ((1, 4, 1, 1), 2), ((4, 1, 1), 4)],
    ids=["scalar", "scalar-1d", "per-channel", "per-channel-groups", "per-channel-depthwise"],
)
def test_a_scale_in_front_of_a_conv_goes_into_its_weight(c_shape, group):
    proto = _scaled_input_conv(c_shape, group=group)
    out, result = run_passes(proto, ["fuse-affine"])
    assert rules_fired(result) == {"mul-conv": 1}
    assert op_types(out) == ["Relu", "Conv"]
    onnx.checker.check_model(out, full_check=True)
    assert_equivalent(proto, out, rtol=1e-5, atol=1e-5, dim_values={"N": 2})


def test_the_half_of_a_gelu_stays_in_front_of_a_conv():
    # TorchScript's Gelu: x * (1 + erf(x / sqrt 2)) * 0.5, the 0.5 last: onnxruntime fuses the
    # pattern only as it stands, so the scale is not moved into the next Conv's weight
    graph = helper.make_graph(
        [
            helper.make_node("Div", ["x", "sqrt2"], ["d"]),
            helper.make_node("Erf", ["d"], ["e"]),
            helper.make_node("Add", ["e", "one"], ["a"]),
            helper.make_node("Mul", ["x", "a"], ["m"]),
            helper.make_node("Mul", ["m", "half"], ["g"]),
            helper.make_node("Conv", ["g", "W", "B"], ["y"], pads=[1, 1, 1, 1]),
        ],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4, 8, 8])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 8, 8, 8])],
        [
            _init("sqrt2", np.array(1.4142135)),
            _init("one", np.array(1.0)),
            _init("half", np.array(0.5)),
            _init("W", RNG.standard_normal((8, 4, 3, 3))),
            _init("B", RNG.standard_normal(8)),
        ],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    _out, result = run_passes(proto, ["fuse-affine"])
    assert "mul-conv" not in rules_fired(result)
    # the same scale after a Relu does go into the weight
    _out, result = run_passes(_scaled_input_conv(()), ["fuse-affine"])
    assert rules_fired(result) == {"mul-conv": 1}


def test_a_scale_with_another_reader_or_over_space_stays():
    _out, result = run_passes(_scaled_input_conv((4, 1, 1), extra_reader=True), ["fuse-affine"])
    assert "mul-conv" not in rules_fired(result)
    # a scale that varies over the width is no per-channel map
    _out, result = run_passes(_scaled_input_conv((1, 1, 8)), ["fuse-affine"])
    assert "mul-conv" not in rules_fired(result)


@pytest.mark.parametrize("same", [True, False], ids=["same-scale", "other-scale"])
def test_a_weight_shared_by_scaled_inputs_is_rewritten_once_or_not_at_all(same):
    """Two Convs share W (CSE merges equal weights), each reading its input through a scale:
    with the same scale both fold into one rewritten weight, still shared; with different
    scales neither does (a private copy of W would grow the model)."""
    w = RNG.standard_normal((4, 4, 1, 1))
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Mul", ["r", "c1"], ["s1"]),
        helper.make_node("Conv", ["s1", "W"], ["a"]),
        helper.make_node("Sigmoid", ["a"], ["h"]),
        helper.make_node("Mul", ["h", "c2"], ["s2"]),
        helper.make_node("Conv", ["s2", "W"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4, 3, 3])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 4, 3, 3])],
        [_init("W", w), _init("c1", np.array(0.5)), _init("c2", np.array(0.5 if same else 2.0))],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    out, result = run_passes(proto, ["fuse-affine", "dead-code"])
    fired = rules_fired(result).get("mul-conv", 0)
    assert fired == (2 if same else 0)
    weights = [i for i in out.graph.initializer if len(i.dims) == 4]
    assert len(weights) == 1  # tied weights stay tied; no copy
    assert op_types(out).count("Mul") == (0 if same else 2)
    assert_equivalent(proto, out, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- parallel branches of one input


def _branches_model(
    branches: list[dict],
    *,
    channels: int = 4,
    group: int = 1,
    size: int = 8,
    opset: int = 17,
) -> onnx.ModelProto:
    """``y = Relu(sum of branches of x)``; a branch is ``{"k": (kh, kw), "pads": [...], ...}``
    for a Conv, ``{"identity": True}`` for x itself or ``{"bn": True}`` for a
    BatchNormalization of x; ``"sub": True`` subtracts it from the sum so far."""
    rng = np.random.default_rng(7)
    nodes, inits, terms = [], [], []
    for i, br in enumerate(branches):
        out = f"t{i}"
        if br.get("identity"):
            terms.append("x")
            continue
        if br.get("bn"):
            inits += [
                _init(f"g{i}", rng.uniform(0.5, 1.5, channels)),
                _init(f"b{i}", rng.standard_normal(channels)),
                _init(f"m{i}", rng.standard_normal(channels)),
                _init(f"v{i}", rng.uniform(0.5, 2.0, channels)),
            ]
            nodes.append(
                helper.make_node(
                    "BatchNormalization", ["x", f"g{i}", f"b{i}", f"m{i}", f"v{i}"], [out]
                )
            )
        else:
            kh, kw = br["k"]
            c_out, g = channels, br.get("group", group)
            inits.append(_init(f"W{i}", rng.standard_normal((c_out, channels // g, kh, kw))))
            ins = ["x", f"W{i}"]
            if br.get("bias", True):
                inits.append(_init(f"B{i}", rng.standard_normal(c_out)))
                ins.append(f"B{i}")
            attrs = {"group": g, "pads": br.get("pads", [kh // 2, kw // 2, kh // 2, kw // 2])}
            for key in ("strides", "dilations"):
                if key in br:
                    attrs[key] = br[key]
            nodes.append(helper.make_node("Conv", ins, [out], **attrs))
        terms.append(out)
    acc = terms[0]
    for i, (t, br) in enumerate(zip(terms[1:], branches[1:], strict=True)):
        nodes.append(helper.make_node("Sub" if br.get("sub") else "Add", [acc, t], [f"s{i}"]))
        acc = f"s{i}"
    nodes.append(helper.make_node("Relu", [acc], ["y"]))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", channels, size, size])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", channels, None, None])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize(
    ("branches", "group", "rules"),
    [
        # RepVGG: 3x3 + 1x1 + BatchNormalization of the input
        ([{"k": (3, 3)}, {"k": (1, 1)}, {"bn": True}], 1, {"conv-sum-conv", "conv-sum-bn"}),
        # RepViT's token mixer: depthwise 3x3 + depthwise 1x1 + the input
        (
            [{"k": (3, 3)}, {"k": (1, 1)}, {"identity": True}],
            4,
            {"conv-sum-conv", "conv-sum-identity"},
        ),
        # the small kernel first, without biases, the identity in the middle
        (
            [{"k": (1, 1), "bias": False}, {"identity": True}, {"k": (5, 5), "bias": False}],
            2,
            {"conv-sum-conv", "conv-sum-identity"},
        ),
        # strided: 3x3 pad 1 and 1x1 pad 0 read the same centre
        (
            [{"k": (3, 3), "strides": [2, 2]}, {"k": (1, 1), "strides": [2, 2]}],
            1,
            {"conv-sum-conv"},
        ),
        # dilated, a 1x3 inside a 3x3
        (
            [
                {"k": (3, 3), "dilations": [2, 2], "pads": [2, 2, 2, 2]},
                {"k": (1, 3), "dilations": [2, 2], "pads": [0, 2, 0, 2]},
                {"identity": True},
            ],
            1,
            {"conv-sum-conv", "conv-sum-identity"},
        ),
        # a window off centre: a 2x2 at the top left of a 3x3
        ([{"k": (3, 3)}, {"k": (2, 2), "pads": [1, 1, 0, 0]}], 1, {"conv-sum-conv"}),
        # FastViT's RepMixer: mixer(x) - norm(x)
        ([{"k": (3, 3)}, {"bn": True, "sub": True}], 4, {"conv-sum-bn"}),
        # the Conv subtracted: its weight and bias change sign
        ([{"identity": True}, {"k": (3, 3), "sub": True}], 2, {"conv-sum-identity"}),
        ([{"k": (1, 1)}, {"k": (3, 3), "sub": True}], 1, {"conv-sum-conv"}),
    ],
    ids=[
        "repvgg",
        "repvit",
        "small-first",
        "strided",
        "dilated",
        "off-centre",
        "fastvit",
        "input-minus-conv",
        "difference-of-convs",
    ],
)
def test_parallel_branches_of_one_input_become_one_conv(branches, group, rules):
    proto = _branches_model(branches, group=group)
    out, result = run_passes(proto, ["fuse-affine", "dead-code"])
    assert op_types(out) == ["Conv", "Relu"]
    assert rules <= set(rules_fired(result))
    # the weights of the branches that went are gone: the model does not grow
    assert len(out.graph.initializer) <= 2
    assert_equivalent(proto, out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("branches", "size", "reason"),
    [
        # neither window contains the other: the merge would be a 3x3 costing more than both
        ([{"k": (1, 3)}, {"k": (3, 1)}], 8, "neither Conv's window contains the other's"),
        # the outputs differ in size and the sum broadcasts (1x1 and 3x3 from a 1x1 input):
        # the 1x1 reads a padded input, its window is not inside the 3x3's
        ([{"k": (3, 3)}, {"k": (1, 1), "pads": [1, 1, 1, 1]}], 1, "neither Conv's window"),
        # 2x2 and 1x1 outputs (broadcast)
        ([{"k": (3, 3)}, {"k": (1, 1), "strides": [2, 2]}], 2, "differ in strides"),
        ([{"k": (3, 3), "strides": [2, 2]}, {"identity": True}], 2, "strided"),
        # the output keeps the input's size, but no tap reads input position i at output i
        (
            [{"k": (3, 3), "dilations": [2, 2], "pads": [1, 1, 3, 3]}, {"identity": True}],
            8,
            "not aligned",
        ),
        ([{"k": (3, 3), "group": 4}, {"k": (1, 1)}], 8, "differ in group or channels"),
        # the control: an identity read off centre (pads 2 before, 0 after) still merges
        ([{"k": (3, 3), "pads": [2, 2, 0, 0]}, {"identity": True}], 8, None),
    ],
    ids=[
        "crossed-windows",
        "misaligned-pads",
        "strides-differ",
        "strided-identity",
        "misaligned-identity",
        "groups-differ",
        "off-centre-identity",
    ],
)
def test_parallel_branches_that_cannot_merge_stay(branches, size, reason):
    proto = _branches_model(branches, size=size)
    model = ir.serde.deserialize_model(copy.deepcopy(proto))
    fusion = AffineFusion()
    fusion.apply(model)
    if reason is None:
        assert {"conv-sum-conv", "conv-sum-identity"} & set(fusion.rule_counts)
    else:
        assert not {"conv-sum-conv", "conv-sum-identity"} & set(fusion.rule_counts)
        declines = {why for (rule, why) in fusion.declines if rule.startswith("conv-sum-")}
        assert any(reason in why for why in declines), declines
    out, _ = run_passes(proto, ["fuse-affine", "dead-code"])
    assert_equivalent(proto, out, rtol=1e-5, atol=1e-5)


def test_a_normalization_with_other_readers_stays_for_them():
    """FastViT's exports share one BatchNormalization of x between the mixer's identity branch
    and the ``- norm(x)`` (equal random-init parameters, merged by CSE): the first sum takes
    it in and leaves it for the difference, which takes it in and removes it."""
    rng = np.random.default_rng(3)
    inits = [
        _init("Wa", rng.standard_normal((4, 1, 3, 3))),
        _init("Wb", rng.standard_normal((4, 1, 1, 1))),
        _init("g", rng.uniform(0.5, 1.5, 4)),
        _init("b", rng.standard_normal(4)),
        _init("m", rng.standard_normal(4)),
        _init("v", rng.uniform(0.5, 2.0, 4)),
    ]
    nodes = [
        helper.make_node("BatchNormalization", ["x", "g", "b", "m", "v"], ["n"]),
        helper.make_node("Conv", ["x", "Wb"], ["cb"], group=4),
        helper.make_node("Add", ["cb", "n"], ["s0"]),
        helper.make_node("Conv", ["x", "Wa"], ["ca"], group=4, pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["s0", "ca"], ["s1"]),
        helper.make_node("Sub", ["s1", "n"], ["y"]),
    ]
    proto = _x_to_y(nodes, inits, ["N", 4, 6, 6])
    out, result = run_passes(proto, ["fuse-affine", "dead-code"])
    assert op_types(out) == ["Conv"]
    assert rules_fired(result)["conv-sum-bn"] == 2
    assert_equivalent(proto, out, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- attention scales into projections


def _fused_qkv_attention(
    *, bias: bool = True, scale_op: str = "Mul", extra: str = "", past: bool = False
) -> onnx.ModelProto:
    """Attention over one fused q/k/v projection (``x @ W + b``, split into 3 x 2 heads of 4,
    unbound by Gathers), q and k each scaled by ``scale_op`` with a scalar, as TorchScript
    exports of scaled dot-product attention write it. ``extra``: "q-read" (the scaled q is
    also an output), "twice" (another reader takes q's piece again), "tied" (W also feeds a
    second MatMul). ``past``: k is concatenated with a cache input before its scale."""
    rng = np.random.default_rng(7)
    inits = [
        _init("W", rng.standard_normal((8, 24)) / 3),
        _init("s", np.float32(0.5) if scale_op == "Mul" else np.float32(2.0)),
        numpy_helper.from_array(np.array([0, 0, 3, 2, 4], np.int64), "shape"),
        numpy_helper.from_array(np.array(0, np.int64), "i0"),
        numpy_helper.from_array(np.array(1, np.int64), "i1"),
        numpy_helper.from_array(np.array(2, np.int64), "i2"),
    ]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["p0"])]
    if bias:
        inits.append(_init("b", rng.standard_normal(24)))
        nodes.append(helper.make_node("Add", ["p0", "b"], ["p"]))
    else:
        nodes.append(helper.make_node("Identity", ["p0"], ["p"]))
    nodes += [
        helper.make_node("Reshape", ["p", "shape"], ["r"]),
        helper.make_node("Gather", ["r", "i0"], ["q0"], axis=2),
        helper.make_node("Gather", ["r", "i1"], ["k0"], axis=2),
        helper.make_node("Gather", ["r", "i2"], ["v0"], axis=2),
        helper.make_node("Transpose", ["q0"], ["q1"], perm=[0, 2, 1, 3]),
        helper.make_node("Transpose", ["k0"], ["k1"], perm=[0, 2, 3, 1]),
        helper.make_node("Transpose", ["v0"], ["v1"], perm=[0, 2, 1, 3]),
    ]
    k = "k1"
    inputs = [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 5, 8])]
    outputs = [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 2, 5, 4])]
    if past:
        inputs.append(helper.make_tensor_value_info("past", onnx.TensorProto.FLOAT, ["N", 2, 4, 3]))
        nodes.append(helper.make_node("Concat", ["past", "k1"], ["kc"], axis=3))
        k = "kc"
        inits.append(_init("vpast", rng.standard_normal((1, 2, 3, 4))))
        nodes += [
            helper.make_node("Shape", ["x"], ["xs"]),
            helper.make_node("Gather", ["xs", "i0"], ["n0"]),
            helper.make_node("Unsqueeze", ["n0", "ax0"], ["n1"]),
            helper.make_node("Concat", ["n1", "vtail"], ["vshape"], axis=0),
            helper.make_node("Expand", ["vpast", "vshape"], ["vp"]),
            helper.make_node("Concat", ["vp", "v1"], ["vc"], axis=2),
        ]
        inits += [
            numpy_helper.from_array(np.array([0], np.int64), "ax0"),
            numpy_helper.from_array(np.array([2, 3, 4], np.int64), "vtail"),
        ]
    v = "vc" if past else "v1"
    nodes += [
        helper.make_node(scale_op, ["q1", "s"], ["qs"]),
        helper.make_node(scale_op, [k, "s"], ["ks"]),
        helper.make_node("MatMul", ["qs", "ks"], ["a"]),
        helper.make_node("Softmax", ["a"], ["w"], axis=-1),
        helper.make_node("MatMul", ["w", v], ["y"]),
    ]
    if extra == "q-read":
        outputs.append(helper.make_tensor_value_info("q1", onnx.TensorProto.FLOAT, ["N", 2, 5, 4]))
    elif extra == "twice":
        nodes.append(helper.make_node("Gather", ["r", "i0"], ["q_again"], axis=2))
        outputs.append(
            helper.make_tensor_value_info("q_again", onnx.TensorProto.FLOAT, ["N", 5, 2, 4])
        )
    elif extra == "tied":
        nodes.append(helper.make_node("MatMul", ["x", "W"], ["tied"]))
        outputs.append(helper.make_tensor_value_info("tied", onnx.TensorProto.FLOAT, ["N", 5, 24]))
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _separate_qk_attention(scale_op: str = "Div", c: float = 2.0) -> onnx.ModelProto:
    """BERT's layout: q and k from projections of their own (with biases), the scores divided
    (or multiplied) by the scalar ``c`` after their MatMul."""
    rng = np.random.default_rng(8)
    inits = [
        _init("Wq", rng.standard_normal((8, 8)) / 3),
        _init("bq", rng.standard_normal(8)),
        _init("Wk", rng.standard_normal((8, 8)) / 3),
        _init("c", np.float32(c)),
        numpy_helper.from_array(np.array([0, 0, 2, 4], np.int64), "heads"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "Wq"], ["q0"]),
        helper.make_node("Add", ["bq", "q0"], ["q1"]),
        helper.make_node("Reshape", ["q1", "heads"], ["q2"]),
        helper.make_node("Transpose", ["q2"], ["q"], perm=[0, 2, 1, 3]),
        helper.make_node("MatMul", ["x", "Wk"], ["k0"]),
        helper.make_node("Reshape", ["k0", "heads"], ["k1"]),
        helper.make_node("Transpose", ["k1"], ["k"], perm=[0, 2, 3, 1]),
        helper.make_node("MatMul", ["q", "k"], ["a"]),
        helper.make_node(scale_op, ["a", "c"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 5, 8])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 2, 5, 5])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("scale_op", ["Mul", "Div"])
def test_the_scales_of_q_and_k_go_into_their_columns_of_a_fused_projection(bias, scale_op):
    proto = _fused_qkv_attention(bias=bias, scale_op=scale_op)
    out, result = run_passes(proto, ["fuse-affine", "dead-code"])
    rule = "projection-mul" if scale_op == "Mul" else "projection-div"
    assert rules_fired(result)[rule] == 2
    assert scale_op not in op_types(out)
    assert_equivalent(proto, out, rtol=1e-5, atol=1e-5, dim_values={"N": 2})
    # v's columns are untouched: only q's and k's changed
    w = next(numpy_helper.to_array(i) for i in out.graph.initializer if i.dims == [8, 24])
    w0 = numpy_helper.to_array(next(i for i in proto.graph.initializer if i.name == "W"))
    np.testing.assert_allclose(w[:, :16], w0[:, :16] * 0.5, rtol=1e-6)  # * 0.5, or / 2
    np.testing.assert_array_equal(w[:, 16:], w0[:, 16:])


@pytest.mark.parametrize(("scale_op", "c"), [("Div", 2.0), ("Mul", 0.5)])
def test_a_scale_after_the_scores_goes_into_the_query_projection(scale_op, c):
    proto = _separate_qk_attention(scale_op, c)
    out, result = run_passes(proto, ["fuse-affine", "dead-code"])
    assert rules_fired(result)[f"projection-{scale_op.lower()}"] == 1
    assert scale_op not in op_types(out)
    assert_equivalent(proto, out, rtol=1e-5, atol=1e-5, dim_values={"N": 2})


@pytest.mark.parametrize(("scale_op", "c"), [("Mul", 2.0), ("Div", 0.5), ("Mul", 0.0)])
def test_a_factor_that_would_grow_the_weight_stays(scale_op, c):
    # a weight scaled up could leave a later float16 conversion's range; zero is no scale
    proto = _separate_qk_attention(scale_op, c)
    out, result = run_passes(proto, ["fuse-affine", "dead-code"])
    assert not {"projection-mul", "projection-div"} & set(rules_fired(result))
    assert scale_op in op_types(out)


@pytest.mark.parametrize("extra", ["q-read", "twice", "tied"])
def test_a_scale_stays_where_unscaled_values_are_read_too(extra):
    proto = _fused_qkv_attention(extra=extra)
    out, result = run_passes(proto, ["fuse-affine", "dead-code"])
    fired = rules_fired(result).get("projection-mul", 0)
    # q's scale stays; k's goes unless W is read elsewhere
    assert fired == (0 if extra == "tied" else 1)
    assert op_types(out).count("Mul") == 2 - fired
    assert_equivalent(proto, out, rtol=1e-5, atol=1e-5, dim_values={"N": 2})


def test_a_key_joined_with_its_cache_keeps_its_scale():
    # the cached keys were not scaled: the factor cannot move into the projection of the new ones
    proto = _fused_qkv_attention(past=True)
    out, result = run_passes(proto, ["fuse-affine", "dead-code"])
    assert rules_fired(result)["projection-mul"] == 1
    assert op_types(out).count("Mul") == 1
    assert_equivalent(proto, out, rtol=1e-5, atol=1e-5, dim_values={"N": 2})


def _layer_scale(gamma: np.ndarray, *, through: str = "") -> onnx.ModelProto:
    """A projection with a bias, then a per-channel ``gamma`` (a layer scale: CaiT, ConvNeXt,
    EfficientFormer); ``through`` = "Transpose" puts a Transpose between them."""
    rng = np.random.default_rng(9)
    inits = [
        _init("W", rng.standard_normal((8, 6)) / 3),
        _init("b", rng.standard_normal(6)),
        _init("gamma", gamma),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["p"]),
    ]
    shape = ["N", 5, 6]
    if through:
        nodes.append(helper.make_node("Transpose", ["p"], ["t"], perm=[1, 0, 2]))
        shape = [5, "N", 6]
    nodes.append(helper.make_node("Mul", ["t" if through else "p", "gamma"], ["y"]))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 5, 8])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, shape)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize(
    ("gamma", "through", "folds"),
    [
        (np.full(6, 1e-5), "", True),  # a fresh layer scale
        (np.linspace(0.1, 1.0, 6), "", True),
        (np.linspace(0.5, 1.5, 6), "", False),  # it would grow some columns
        (np.full(6, 0.5), "Transpose", False),  # per column: on the projection's output only
    ],
    ids=["fresh", "trained", "growing", "moved"],
)
def test_a_layer_scale_goes_into_the_projection_before_it(gamma, through, folds):
    proto = _layer_scale(gamma, through=through)
    out, result = run_passes(proto, ["fuse-affine", "dead-code"])
    assert (rules_fired(result).get("projection-mul", 0) == 1) is folds
    assert ("Mul" in op_types(out)) is not folds
    assert_equivalent(proto, out, rtol=1e-5, atol=1e-5, dim_values={"N": 2})
