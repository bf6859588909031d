"""Zero Pad folded into the pads of the Conv or AveragePool reading it."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from tests.helpers import assert_equivalent, op_types, rules_fired, run_passes

RNG = np.random.default_rng(5)
F = onnx.TensorProto.FLOAT
DIMS = {"N": 2}


def _pad_model(
    *,
    opset: int = 17,
    reader: str = "Conv",
    pads=(0, 0, 1, 2, 0, 0, 2, 1),
    axes=None,
    mode: str | None = None,
    value: float | None = None,
    reader_attrs: dict | None = None,
    second_reader: bool = False,
    before: str | None = None,
    indices: bool = False,
) -> onnx.ModelProto:
    """x [N, 3, 8, 8] -> Pad -> Conv / AveragePool / MaxPool -> y; ``before``: an activation
    between x and the Pad (``Relu``, ``Sigmoid``, ``Clip`` to [0.5, 6]); ``indices``: MaxPool's
    Indices as a second output."""
    inits = []
    pad_inputs = ["x" if before is None else "a"]
    pad_attrs: dict = {}
    if mode is not None:
        pad_attrs["mode"] = mode
    if opset < 11:
        pad_attrs["pads"] = list(pads)
        if value is not None:
            pad_attrs["value"] = value
    else:
        inits.append(numpy_helper.from_array(np.array(pads, dtype=np.int64), "pads"))
        pad_inputs.append("pads")
        if value is not None or axes is not None:
            if value is not None:
                inits.append(numpy_helper.from_array(np.array(value, dtype=np.float32), "cval"))
            pad_inputs.append("cval" if value is not None else "")
        if axes is not None:
            inits.append(numpy_helper.from_array(np.array(axes, dtype=np.int64), "axes"))
            pad_inputs.append("axes")
    nodes = [helper.make_node("Pad", pad_inputs, ["p"], **pad_attrs)]
    if before == "Clip":
        for name, v in (("lo", 0.5), ("hi", 6.0)):
            inits.append(numpy_helper.from_array(np.array(v, dtype=np.float32), name))
        nodes.insert(0, helper.make_node("Clip", ["x", "lo", "hi"], ["a"]))
    elif before is not None:
        nodes.insert(0, helper.make_node(before, ["x"], ["a"]))
    attrs = dict(reader_attrs or {})
    if reader == "Conv":
        inits.append(
            numpy_helper.from_array(RNG.standard_normal((4, 3, 3, 3)).astype(np.float32), "W")
        )
        inits.append(numpy_helper.from_array(RNG.standard_normal(4).astype(np.float32), "B"))
        nodes.append(helper.make_node("Conv", ["p", "W", "B"], ["y"], **attrs))
    else:
        attrs.setdefault("kernel_shape", [3, 3])
        nodes.append(helper.make_node(reader, ["p"], ["y", "i"] if indices else ["y"], **attrs))
    outputs = [helper.make_tensor_value_info("y", F, [None] * 4)]
    if indices:
        outputs.append(helper.make_tensor_value_info("i", onnx.TensorProto.INT64, [None] * 4))
    if second_reader:
        nodes.append(helper.make_node("Relu", ["p"], ["z"]))
        outputs.append(helper.make_tensor_value_info("z", F, [None] * 4))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", F, ["N", 3, 8, 8])], outputs, inits
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _fold(proto):
    return run_passes(proto, ["fuse-pad", "dead-code"])


@pytest.mark.parametrize("opset", [10, 17, 19])
@pytest.mark.parametrize("conv_pads", [None, [1, 0, 0, 1]])
def test_pad_folds_into_conv(opset, conv_pads):
    attrs = {} if conv_pads is None else {"pads": conv_pads}
    proto = _pad_model(opset=opset, reader_attrs=attrs)
    out, result = _fold(proto)
    assert op_types(out) == ["Conv"]
    assert rules_fired(result) == {"pad-conv": 1}
    own = conv_pads or [0, 0, 0, 0]
    got = next(a for a in out.graph.node[0].attribute if a.name == "pads").ints
    assert list(got) == [own[0] + 1, own[1] + 2, own[2] + 2, own[3] + 1]
    assert_equivalent(proto, out, dim_values=DIMS)


def test_explicit_zero_value_and_constant_mode_fold():
    proto = _pad_model(opset=10, mode="constant", value=0.0)
    out, result = _fold(proto)
    assert op_types(out) == ["Conv"]
    assert_equivalent(proto, out, dim_values=DIMS)
    proto = _pad_model(opset=17, mode="constant", value=0.0)
    out, result = _fold(proto)
    assert op_types(out) == ["Conv"]
    assert rules_fired(result) == {"pad-conv": 1}
    assert_equivalent(proto, out, dim_values=DIMS)


@pytest.mark.parametrize("axes", [[2, 3], [-1, -2], [3]])
def test_pad_with_axes_folds_into_conv(axes):
    pads = {(2, 3): [1, 2, 2, 1], (-1, -2): [2, 1, 1, 2], (3,): [1, 2]}[tuple(axes)]
    proto = _pad_model(opset=19, pads=pads, axes=axes)
    out, result = _fold(proto)
    assert op_types(out) == ["Conv"]
    assert rules_fired(result) == {"pad-conv": 1}
    assert_equivalent(proto, out, dim_values=DIMS)


def test_pad_with_axes_on_channels_is_kept():
    proto = _pad_model(opset=19, pads=[1, 0], axes=[1])
    out, _ = _fold(proto)
    assert "Pad" in op_types(out)


@pytest.mark.parametrize("opset", [10, 17])
@pytest.mark.parametrize("pool_pads", [None, [1, 0, 0, 1]])
def test_pad_folds_into_average_pool_counting_pads(opset, pool_pads):
    attrs: dict = {"count_include_pad": 1, "strides": [2, 1]}
    if pool_pads is not None:
        attrs["pads"] = pool_pads
    proto = _pad_model(opset=opset, reader="AveragePool", reader_attrs=attrs)
    out, result = _fold(proto)
    assert op_types(out) == ["AveragePool"]
    assert rules_fired(result) == {"pad-avgpool": 1}
    assert_equivalent(proto, out, dim_values=DIMS)


@pytest.mark.parametrize(
    ("before", "value", "opset"),
    [("Relu", None, 17), ("Sigmoid", -1.0, 17), ("Clip", 0.5, 17), ("Relu", 0.0, 10)],
)
def test_pad_folds_into_max_pool_below_the_inputs_bound(before, value, opset):
    attrs = {"strides": [2, 2], "pads": [1, 0, 0, 1]}
    proto = _pad_model(
        opset=opset, reader="MaxPool", before=before, value=value, reader_attrs=attrs
    )
    out, result = _fold(proto)
    assert "Pad" not in op_types(out) and "MaxPool" in op_types(out)
    assert rules_fired(result) == {"pad-maxpool": 1}
    assert_equivalent(proto, out, dim_values=DIMS)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"mode": "reflect"}, id="reflect"),
        pytest.param({"opset": 10, "mode": "edge"}, id="edge-attr"),
        pytest.param({"value": 1.5}, id="value-input"),
        pytest.param({"opset": 10, "value": -2.0}, id="value-attr"),
        pytest.param({"pads": (1, 0, 1, 1, 0, 0, 1, 1)}, id="batch-axis"),
        pytest.param(
            {
                "pads": (0, 1, 1, 1, 0, 0, 1, 1),
                "reader": "AveragePool",
                "reader_attrs": {"count_include_pad": 1},
            },
            id="channel-axis",
        ),
        pytest.param({"pads": (0, 0, -1, 1, 0, 0, 1, 1)}, id="negative"),
        pytest.param({"second_reader": True}, id="two-readers"),
        pytest.param({"reader": "MaxPool"}, id="maxpool-input-unbounded"),
        pytest.param({"reader": "MaxPool", "before": "Relu", "value": 0.5}, id="maxpool-above"),
        pytest.param({"reader": "MaxPool", "before": "Clip", "value": 0.75}, id="maxpool-clip"),
        pytest.param({"reader": "MaxPool", "before": "Tanh"}, id="maxpool-tanh"),
        pytest.param(
            {"reader": "MaxPool", "before": "Relu", "reader_attrs": {"ceil_mode": 1}},
            id="maxpool-ceil-mode",
        ),
        pytest.param(
            {"reader": "MaxPool", "before": "Relu", "indices": True}, id="maxpool-indices"
        ),
        pytest.param(
            {"reader": "MaxPool", "before": "Relu", "pads": (0, 0, 3, 0, 0, 0, 0, 0)},
            id="maxpool-pads-reach-kernel",
        ),
        pytest.param(
            {"reader": "AveragePool", "reader_attrs": {"count_include_pad": 0}},
            id="avgpool-exclude-pad",
        ),
        pytest.param({"reader": "AveragePool"}, id="avgpool-default"),
        pytest.param(
            {"reader": "AveragePool", "reader_attrs": {"count_include_pad": 1, "ceil_mode": 1}},
            id="avgpool-ceil-mode",
        ),
        pytest.param(
            {
                "reader": "AveragePool",
                "reader_attrs": {"count_include_pad": 1, "pads": [1, 0, 0, 1]},
                "pads": (0, 0, 2, 0, 0, 0, 0, 0),
            },
            id="avgpool-pads-reach-kernel",
        ),
        pytest.param({"reader_attrs": {"auto_pad": "SAME_UPPER"}}, id="conv-same-upper"),
    ],
)
def test_pad_is_kept(kwargs):
    proto = _pad_model(**kwargs)
    out, result = _fold(proto)
    assert "Pad" in op_types(out)
    assert not rules_fired(result)
    assert_equivalent(proto, out, dim_values=DIMS)


def test_pad_feeding_conv_transpose_is_kept():
    inits = [
        numpy_helper.from_array(RNG.standard_normal((3, 4, 3, 3)).astype(np.float32), "W"),
        numpy_helper.from_array(np.array([0, 0, 1, 1, 0, 0, 1, 1], dtype=np.int64), "pads"),
    ]
    nodes = [
        helper.make_node("Pad", ["x", "pads"], ["p"]),
        helper.make_node("ConvTranspose", ["p", "W"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", F, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("y", F, [None] * 4)],
        inits,
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    out, result = _fold(proto)
    assert op_types(out) == ["Pad", "ConvTranspose"]
    assert not rules_fired(result)


def test_pad_output_that_is_a_graph_output_is_kept():
    proto = _pad_model()
    proto.graph.output.append(helper.make_tensor_value_info("p", F, [None] * 4))
    out, result = _fold(proto)
    assert "Pad" in op_types(out)
    assert not rules_fired(result)


def test_runtime_pads_are_kept():
    proto = _pad_model()
    # pads fed at run time: not a constant
    proto.graph.input.append(helper.make_tensor_value_info("pads", onnx.TensorProto.INT64, [8]))
    out, result = _fold(proto)
    assert "Pad" in op_types(out)
    assert not rules_fired(result)


def test_pad_fusion_is_exact_and_in_the_presets():
    from graphtrim.graph.presets import PASSES, PRESETS

    assert PASSES["fuse-pad"].exact
    assert "fuse-pad" in PRESETS["safe"]
    order = PRESETS["default"]
    assert order.index("fuse-pad") == order.index("fuse-affine") + 1


def test_default_preset_folds_pad():
    proto = _pad_model(opset=17)
    out, result = run_passes(proto, preset="default")
    assert "Pad" not in op_types(out)
    assert "pad-conv" in rules_fired(result)
    assert_equivalent(proto, out, dim_values=DIMS)
