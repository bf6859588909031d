"""Transposes moved through the layout-agnostic ops between them (``transpose-sink``): the
channels-last blocks tf2onnx writes between two Convs, computed channels-first."""

from __future__ import annotations

import pytest

from tests.helpers import assert_equivalent, op_types, parse, rules_fired, run_passes

TO_NHWC = "perm = [0, 2, 3, 1]"
TO_NCHW = "perm = [0, 3, 1, 2]"


def _model(body: str, sig: str = "(float[N, 4, 6, 6] x) => (float[N, 4, 6, 6] y)", opset=17):
    return parse(
        f"""
        <ir_version: 8, opset_import: ["" : {opset}]>
        g {sig} <float[4] scale = {{0.5, -1.0, 2.0, 0.25}}, float three = {{3.0}},
                 float zero = {{0.0}}, float six = {{6.0}}, float sixth = {{0.16666667}},
                 int64[8] pads = {{0, 1, 1, 0, 0, 1, 1, 0}}> {{
          {body}
        }}
        """
    )


def _sink(proto):
    return run_passes(proto, ["transpose-sink", "dead-code"])


# a batch-norm scale, hard-swish, a channels-last pad and a squeeze-and-excite mean
KERAS_BLOCK = f"""
  h = Transpose<{TO_NHWC}>(x)
  s = Mul(h, scale)
  a = Add(s, three)
  c = Clip(a, zero, six)
  d = Mul(c, sixth)
  w = Mul(s, d)
  p = Pad(w, pads)
  m = ReduceMean<axes = [1, 2], keepdims = 1>(p)
  e = Mul(p, m)
  y0 = Transpose<{TO_NCHW}>(e)
  y = Relu(y0)
"""


def test_a_channels_last_block_between_transposes_loses_both():
    sig = "(float[N, 4, 6, 6] x) => (float[N, 4, 8, 8] y)"
    proto = _model(KERAS_BLOCK, sig)
    out, result = _sink(proto)
    assert rules_fired(result) == {"transpose-sink": 1}
    assert "Transpose" not in op_types(out)
    assert_equivalent(proto, out, dim_values={"N": 2}, rtol=0, atol=0)


def test_a_residual_add_of_two_transposed_values_is_one_region():
    body = f"""
      a = Transpose<{TO_NHWC}>(x)
      b = Transpose<{TO_NHWC}>(z)
      s = Add(a, b)
      r = Relu(s)
      y = Transpose<{TO_NCHW}>(r)
    """
    sig = "(float[N, 4, 6, 6] x, float[N, 4, 6, 6] z) => (float[N, 4, 6, 6] y)"
    proto = _model(body, sig)
    out, _ = _sink(proto)
    assert op_types(out) == ["Add", "Relu"]
    assert_equivalent(proto, out, dim_values={"N": 2}, rtol=0, atol=0)


def test_softmax_and_concat_take_the_moved_axis():
    body = f"""
      h = Transpose<{TO_NHWC}>(x)
      s = Softmax<axis = -1>(h)
      c = Concat<axis = 3>(s, h)
      y = Transpose<{TO_NCHW}>(c)
    """
    sig = "(float[N, 4, 6, 6] x) => (float[N, 8, 6, 6] y)"
    proto = _model(body, sig, opset=13)
    out, _ = _sink(proto)
    assert op_types(out) == ["Softmax", "Concat"]
    assert_equivalent(proto, out, dim_values={"N": 2}, rtol=0, atol=0)


def test_a_reader_outside_the_region_gets_the_transpose_back():
    """Entry and exit go (-2), the Flatten's input is transposed back (+1)."""
    body = f"""
      h = Transpose<{TO_NHWC}>(x)
      r = Relu(h)
      f = Flatten(r)
      k = Transpose<{TO_NCHW}>(r)
      y = Add(k, x)
    """
    sig = "(float[N, 4, 6, 6] x) => (float[N, 4, 6, 6] y, float[N, 144] f)"
    proto = _model(body, sig)
    out, _ = _sink(proto)
    assert sorted(op_types(out)) == ["Add", "Flatten", "Relu", "Transpose"]
    assert_equivalent(proto, out, dim_values={"N": 2}, rtol=0, atol=0)


def test_an_exit_that_does_not_cancel_gets_the_composed_permutation():
    body = f"""
      h = Transpose<{TO_NHWC}>(x)
      r = Relu(h)
      y = Transpose<perm = [0, 2, 1, 3]>(r)
    """
    sig = "(float[N, 4, 6, 6] x) => (float[N, 6, 6, 4] y)"
    proto = _model(body, sig)
    out, _ = _sink(proto)
    assert op_types(out) == ["Relu", "Transpose"]
    assert_equivalent(proto, out, dim_values={"N": 2}, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("body", "sig"),
    [
        # the transposed value leaves the region unchanged: nothing to cancel
        (
            f"h = Transpose<{TO_NHWC}>(x)\n y = Relu(h)",
            "(float[N, 4, 6, 6] x) => (float[N, 6, 6, 4] y)",
        ),
        # a reader that is not layout-agnostic would need the Transpose back, and the exit
        # does not cancel: no gain
        (
            f"h = Transpose<{TO_NHWC}>(x)\n r = Relu(h)\n f = Flatten(r)\n"
            " y = Transpose<perm = [0, 2, 1, 3]>(r)",
            "(float[N, 4, 6, 6] x) => (float[N, 6, 6, 4] y, float[N, 144] f)",
        ),
        # keepdims=0 changes the rank
        (
            f"h = Transpose<{TO_NHWC}>(x)\n m = ReduceMean<axes = [1], keepdims = 0>(h)\n"
            " y = Transpose<perm = [0, 2, 1]>(m)",
            "(float[N, 4, 6, 6] x) => (float[N, 4, 6] y)",
        ),
    ],
)
def test_no_region_that_saves_nothing_is_rewritten(body, sig):
    proto = _model(body, sig)
    out, result = _sink(proto)
    assert "transpose-sink" not in rules_fired(result)
    assert op_types(out).count("Transpose") >= 1
