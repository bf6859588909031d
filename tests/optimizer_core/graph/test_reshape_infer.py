"""A computed Reshape target with one unknown entry becomes a constant with -1."""

from __future__ import annotations

import pytest

from tests.helpers import assert_equivalent, op_types, parse, rules_fired, run_passes

# tf2onnx's form: the batch dim read at run time in int32, the other entries static
TF_SHAPE = """
  sh = Shape(x)
  s32 = Cast<to = 6>(sh)
  b = Slice(s32, zero, one, zero)
  t = Concat<axis = 0>(b, tail)
  s = Cast<to = 7>(t)
  y = Reshape(x, s)
"""
INITS = "int64[1] zero = {0}, int64[1] one = {1}, int32[2] tail = {6, 8}"


def _model(body: str, sig: str, inits: str = INITS):
    return parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g {sig} <{inits}> {{
          {body}
        }}
        """
    )


def test_the_batch_read_at_run_time_becomes_minus_one():
    proto = _model(TF_SHAPE, "(float[N, 4, 12] x) => (float[N, 6, 8] y)")
    out, result = run_passes(proto, ["reshape-infer", "dead-code"])
    assert rules_fired(result) == {"reshape-one-unknown": 1}
    assert op_types(out) == ["Reshape"]
    shape = next(i for i in out.graph.initializer if i.name == out.graph.node[0].input[1])
    assert list(shape.int64_data) or shape.raw_data  # a constant target
    assert_equivalent(proto, out, dim_values={"N": 3})


@pytest.mark.parametrize(
    ("body", "sig", "inits"),
    [
        # two entries read at run time: -1 can stand for one only
        (
            TF_SHAPE.replace("Slice(s32, zero, one, zero)", "Slice(s32, zero, two, zero)"),
            "(float[N, M, 48] x) => (float[N, M, 6, 8] y)",
            INITS + ", int64[1] two = {2}",
        ),
        # a static 0 copies a dim of x: not a size
        (TF_SHAPE, "(float[N, 0, 12] x) => (float[N, 0, 8] y)", INITS.replace("{6, 8}", "{0, 8}")),
    ],
)
def test_a_target_with_more_unknowns_or_a_zero_is_kept(body, sig, inits):
    proto = _model(body, sig, inits)
    out, result = run_passes(proto, ["reshape-infer", "dead-code"])
    assert "reshape-one-unknown" not in rules_fired(result)
    assert "Shape" in op_types(out)


def test_the_larger_of_two_reads_of_one_dim_is_that_dim():
    """tf2onnx's einsum broadcasts the operands' batch dims with ``Max`` of two shape reads:
    ``max(4, 4) = 4`` leaves the batch the one unknown entry; ``max(4, P)`` is a second."""
    body = """
      sa = Shape(a)
      sb = Shape(b)
      na = Gather(sa, lead)
      nb = Gather(sb, lead)
      n = Max(na, nb)
      s = Concat<axis = 0>(n, tail)
      y = Reshape(a, s)
    """
    inits = "int64[2] lead = {0, 1}, int64[2] tail = {6, 2}"
    proto = _model(body, "(float[N, 4, 12] a, float[N, 4, 3] b) => (float[N, 4, 6, 2] y)", inits)
    out, result = run_passes(proto, ["reshape-infer", "dead-code"])
    assert rules_fired(result) == {"reshape-one-unknown": 1}
    assert op_types(out) == ["Reshape"]
    assert_equivalent(proto, out, dim_values={"N": 3})
    sig = "(float[N, 4, 12] a, float[N, P, 3] b) => (float[N, 4, 6, 2] y)"
    _, result = run_passes(_model(body, sig, inits), ["reshape-infer", "dead-code"])
    assert "reshape-one-unknown" not in rules_fired(result)
