"""Focus blocks (four strided slices concatenated on the channels) and channel permutations
before a Conv, in every form the rules accept and the ones they must refuse."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from tests.helpers import assert_equivalent, op_types, run_passes
from tests.optimizer_core.graph.rule_examples.space_to_depth import YOLO_ORDER, focus

S2D_ORDER = ((0, 0), (0, 1), (1, 0), (1, 1))


@pytest.mark.parametrize("chained", [True, False], ids=["slice-per-axis", "one-slice"])
def test_a_focus_block_in_spacetodepth_order_becomes_one_node(chained):
    proto = focus(S2D_ORDER, conv=False, chained=chained)
    out, _ = run_passes(proto)
    assert op_types(out) == ["SpaceToDepth"]
    assert_equivalent(proto, out)


def test_another_order_adds_a_gather_which_the_conv_absorbs():
    proto = focus(YOLO_ORDER, conv=False)
    out, _ = run_passes(proto)
    assert op_types(out) == ["SpaceToDepth", "Gather"]
    assert_equivalent(proto, out)
    with_conv = focus(YOLO_ORDER, conv=True)
    out, _ = run_passes(with_conv)
    assert op_types(out) == ["SpaceToDepth", "Conv"]
    assert_equivalent(with_conv, out, rtol=1e-5, atol=1e-5)


def _edit(proto: onnx.ModelProto, name: str, value: list[int]) -> onnx.ModelProto:
    for init in proto.graph.initializer:
        if init.name == name:
            init.CopyFrom(onnx.numpy_helper.from_array(np.array(value, np.int64), name))
    return proto


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda p: _edit(p, "two", [3]), "step 3"),
        (lambda p: _edit(p, "end", [6]), "an end before the dim"),
        (lambda p: _edit(p, "w", [1]), "a channel slice instead of a spatial one"),
    ],
    ids=["step-3", "short-end", "wrong-axis"],
)
def test_slices_that_are_not_a_space_to_depth_are_left_alone(edit, why):
    proto = edit(focus(S2D_ORDER, conv=False))
    out, result = run_passes(proto, passes=["space-to-depth"])
    assert "SpaceToDepth" not in op_types(out), why
    assert result.log.per_pass().get("space-to-depth", {}).get("rules", {}) == {}


def test_a_gather_that_selects_channels_is_not_folded_into_the_conv():
    proto = focus(YOLO_ORDER, conv=True)
    out, _ = run_passes(proto, passes=["space-to-depth"])
    # a Gather that repeats a channel is no permutation: the Conv keeps it
    for init in out.graph.initializer:
        if init.name.startswith("focus_order"):
            index = onnx.numpy_helper.to_array(init).copy()
            index[0] = index[1]
            init.CopyFrom(onnx.numpy_helper.from_array(index, init.name))
    again, _ = run_passes(out, passes=["fuse-channel-gather"])
    assert "Gather" in op_types(again)
    assert_equivalent(out, again)
