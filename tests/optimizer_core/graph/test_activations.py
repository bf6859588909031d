"""Redundant activations: each rule fires, results are unchanged, the checker passes."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.numpy_helper
import pytest

from tests.helpers import assert_equivalent, op_types, parse, run_passes

PASSES = ["lift-constants", "activations", "dead-code"]


def fired(result) -> dict[str, int]:
    """The rules the activations pass fired (lift-constants and dead-code fire too)."""
    return result.log.per_pass().get("activations", {}).get("rules", {})


def _clip_bounds(proto: onnx.ModelProto) -> tuple[float | None, float | None]:
    """(min, max) of the single Clip of an opset 11+ model, read from its initializers."""
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer}
    (clip,) = [n for n in proto.graph.node if n.op_type == "Clip"]
    bounds: list[float | None] = []
    for i in (1, 2):
        name = clip.input[i] if len(clip.input) > i else ""
        bounds.append(float(inits[name]) if name else None)
    return bounds[0], bounds[1]


@pytest.mark.parametrize(
    "producer",
    ["Relu", "Sigmoid", "Exp", "Abs", "Softmax<axis = 1>", "Softplus"],
    ids=["relu", "sigmoid", "exp", "abs", "softmax", "softplus"],
)
def test_relu_after_non_negative_removed(producer):
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {{
          a = {producer}(x)
          y = Relu(a)
        }}
        """
    )
    out, result = run_passes(proto, PASSES)
    assert fired(result) == {"relu-after-non-negative": 1}
    assert op_types(out) == [producer.split("<")[0]]
    assert [o.name for o in out.graph.output] == ["y"]
    assert_equivalent(proto, out, dim_values={"N": 3})


@pytest.mark.parametrize(
    "producer", ["Tanh", "Neg", "Sin", "Identity"], ids=["tanh", "neg", "sin", "identity"]
)
def test_relu_after_possibly_negative_kept(producer):
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {{
          a = {producer}(x)
          y = Relu(a)
        }}
        """
    )
    out, result = run_passes(proto, PASSES)
    assert not fired(result)
    assert op_types(out) == [producer, "Relu"]
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_relu_of_a_graph_input_kept():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y) {
          y = Relu(x)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert not fired(result)
    assert op_types(out) == ["Relu"]
    assert_equivalent(proto, out)


def test_relu_after_non_negative_clip_removed():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
          lo = Constant<value = float {0.5}>()
          hi = Constant<value = float {2.0}>()
          a = Clip(x, lo, hi)
          y = Relu(a)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert fired(result)["relu-after-non-negative"] == 1
    assert op_types(out) == ["Clip"]
    assert_equivalent(proto, out, dim_values={"N": 3})


@pytest.mark.parametrize(
    "clip",
    [
        "lo = Constant<value = float {0.0}>()\n y = Clip(a, lo)",
        "lo = Constant<value = float {-1.5}>()\n y = Clip(a, lo)",
        "y = Clip(a)",
    ],
    ids=["min0", "min-negative", "no-bounds"],
)
def test_clip_without_max_after_relu_removed(clip):
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {{
          a = Relu(x)
          {clip}
        }}
        """
    )
    out, result = run_passes(proto, PASSES)
    assert fired(result) == {"clip-after-non-negative": 1}
    assert op_types(out) == ["Relu"]
    assert [o.name for o in out.graph.output] == ["y"]
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_clip_with_max_after_relu_kept_as_clip():
    # Clip(Relu(x), 0, 6) is Relu6: the Relu folds into the Clip, the Clip stays
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
          a = Relu(x)
          lo = Constant<value = float {0.0}>()
          hi = Constant<value = float {6.0}>()
          y = Clip(a, lo, hi)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert fired(result) == {"relu-into-clip": 1}
    assert op_types(out) == ["Clip"]
    assert out.graph.node[0].input[0] == "x"
    assert_equivalent(proto, out, dim_values={"N": 3})


@pytest.mark.parametrize("lo", [0.0, 0.5], ids=["min0", "min0.5"])
def test_relu_merged_into_clip(lo):
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {{
          a = Relu(x)
          lo = Constant<value = float {{{lo}}}>()
          hi = Constant<value = float {{1.0}}>()
          y = Clip(a, lo, hi)
        }}
        """
    )
    out, result = run_passes(proto, PASSES)
    assert fired(result) == {"relu-into-clip": 1}
    assert op_types(out) == ["Clip"]
    assert _clip_bounds(out) == (lo, 1.0)
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_relu_not_merged_into_clip_with_negative_min():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
          a = Relu(x)
          lo = Constant<value = float {-1.0}>()
          hi = Constant<value = float {1.0}>()
          y = Clip(a, lo, hi)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert not fired(result).get("relu-into-clip")
    assert op_types(out) == ["Relu", "Clip"]
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_relu_with_other_readers_not_merged_into_clip():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y, float[N, 4] z) {
          a = Relu(x)
          lo = Constant<value = float {0.0}>()
          hi = Constant<value = float {1.0}>()
          y = Clip(a, lo, hi)
          z = Neg(a)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert not fired(result).get("relu-into-clip")
    assert op_types(out) == ["Relu", "Clip", "Neg"]
    assert_equivalent(proto, out, dim_values={"N": 3})


@pytest.mark.parametrize(
    ("inner", "outer", "merged"),
    [
        ((-1.0, 2.0), (0.0, 3.0), (0.0, 2.0)),
        ((0.0, 6.0), (-2.0, 1.0), (0.0, 1.0)),
        ((-3.0, 3.0), (-1.0, 1.0), (-1.0, 1.0)),
        ((-1.0, None), (None, 0.5), (-1.0, 0.5)),
        ((0.5, 0.5), (0.5, 4.0), (0.5, 0.5)),
    ],
    ids=["overlap", "overlap-rev", "nested", "open-bounds", "touching"],
)
def test_nested_clip_merged(inner, outer, merged):
    def clip(out, src, bounds, tag):
        lines, args = [], [src]
        for bound, kind in zip(bounds, ("lo", "hi"), strict=True):
            if bound is None:
                args.append("")
            else:
                lines.append(f"{tag}{kind} = Constant<value = float {{{bound}}}>()")
                args.append(f"{tag}{kind}")
        while args[-1] == "":
            args.pop()
        lines.append(f"{out} = Clip({', '.join(args)})")
        return "\n          ".join(lines)

    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {{
          {clip("a", "x", inner, "i")}
          {clip("y", "a", outer, "o")}
        }}
        """
    )
    out, result = run_passes(proto, PASSES)
    assert fired(result) == {"clip-clip": 1}
    assert op_types(out) == ["Clip"]
    assert out.graph.node[0].input[0] == "x"
    assert _clip_bounds(out) == merged
    assert_equivalent(proto, out, dim_values={"N": 3})
    # the inputs straddle the bounds, so a wrong bound would show
    feeds = [{"x": np.linspace(-4, 4, 12, dtype=np.float32).reshape(3, 4)}]
    assert_equivalent(proto, out, inputs=feeds)


def test_non_overlapping_nested_clip_kept():
    # Clip(Clip(x, 0, 1), 2, 3) is 2 everywhere; a merged Clip(x, 2, 1) would be 1
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
          a_lo = Constant<value = float {0.0}>()
          a_hi = Constant<value = float {1.0}>()
          a = Clip(x, a_lo, a_hi)
          b_lo = Constant<value = float {2.0}>()
          b_hi = Constant<value = float {3.0}>()
          y = Clip(a, b_lo, b_hi)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert not fired(result).get("clip-clip")
    # the inner Clip has a lower bound of 0: it is non-negative, but the outer Clip has a max
    assert op_types(out) == ["Clip", "Clip"]
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_nested_clip_with_other_readers_kept():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y, float[N, 4] z) {
          a_lo = Constant<value = float {-1.0}>()
          a_hi = Constant<value = float {1.0}>()
          a = Clip(x, a_lo, a_hi)
          b_lo = Constant<value = float {0.0}>()
          b_hi = Constant<value = float {0.5}>()
          y = Clip(a, b_lo, b_hi)
          z = Neg(a)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert not fired(result).get("clip-clip")
    assert op_types(out) == ["Clip", "Clip", "Neg"]
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_clip_with_non_constant_bound_kept():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x, float hi) => (float[N, 4] y) {
          a = Relu(x)
          lo = Constant<value = float {-1.0}>()
          y = Clip(a, lo, hi)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert not fired(result)
    assert op_types(out) == ["Relu", "Clip"]
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_opset11_input_form_clip():
    proto = parse(
        """
        <ir_version: 6, opset_import: ["" : 11]>
        g (float[N, 4] x) => (float[N, 4] y, float[N, 4] z) {
          a = Relu(x)
          lo = Constant<value = float {0.0}>()
          b = Clip(a, lo)
          y = Relu(b)
          c_lo = Constant<value = float {-2.0}>()
          c_hi = Constant<value = float {2.0}>()
          c = Clip(x, c_lo, c_hi)
          d_lo = Constant<value = float {-1.0}>()
          d_hi = Constant<value = float {3.0}>()
          z = Clip(c, d_lo, d_hi)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    rules = fired(result)
    assert rules["clip-after-non-negative"] == 1
    assert rules["relu-after-non-negative"] == 1
    assert rules["clip-clip"] == 1
    assert op_types(out) == ["Relu", "Clip"]
    assert _clip_bounds(out) == (-1.0, 2.0)
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_opset10_attribute_form_clip():
    proto = parse(
        """
        <ir_version: 5, opset_import: ["" : 10]>
        g (float[N, 4] x) => (float[N, 4] y, float[N, 4] z, float[N, 4] w) {
          a = Relu(x)
          y = Clip<min = 0.0>(a)
          b = Relu(x)
          z = Clip<min = 0.5, max = 2.0>(b)
          c = Clip<min = 1.0, max = 3.0>(x)
          w = Relu(c)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    rules = fired(result)
    assert rules == {
        "clip-after-non-negative": 1,
        "relu-into-clip": 1,
        "relu-after-non-negative": 1,
    }
    assert op_types(out) == ["Relu", "Clip", "Clip"]
    z = next(n for n in out.graph.node if n.output[0] == "z")
    assert z.input[0] == "x"
    assert {a.name: a.f for a in z.attribute} == {"min": 0.5, "max": 2.0}
    assert [o.name for o in out.graph.output] == ["y", "z", "w"]
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_opset10_nested_clip_left_alone():
    # the clip-clip rule builds input-form bounds: attribute-form Clips are not merged
    proto = parse(
        """
        <ir_version: 5, opset_import: ["" : 10]>
        g (float[N, 4] x) => (float[N, 4] y) {
          a = Clip<min = -1.0, max = 2.0>(x)
          y = Clip<min = 0.0, max = 3.0>(a)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert not fired(result)
    assert op_types(out) == ["Clip", "Clip"]
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_int_clip_clip_merged_with_int_bounds():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (int32[N, 4] x) => (int32[N, 4] y) {
          a_lo = Constant<value = int32 {1}>()
          a_hi = Constant<value = int32 {6}>()
          a = Clip(x, a_lo, a_hi)
          b_lo = Constant<value = int32 {2}>()
          b_hi = Constant<value = int32 {9}>()
          y = Clip(a, b_lo, b_hi)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert fired(result) == {"clip-clip": 1}
    assert op_types(out) == ["Clip"]
    assert {i.data_type for i in out.graph.initializer} == {onnx.TensorProto.INT32}
    assert _clip_bounds(out) == (2, 6)
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_clip_clip_bounds_keep_the_data_type_when_inference_cannot_see_it():
    # shape inference cannot see through the custom op, so the Clips' type is unknown: the
    # merged bounds must still be doubles (Clip's bounds have the type of its input)
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17, "com.example" : 1]>
        g (double[4] x) => (double[4] y) {
          a = com.example.MyOp(x)
          l1 = Constant<value = double {-1}>()
          h1 = Constant<value = double {2}>()
          b = Clip(a, l1, h1)
          l2 = Constant<value = double {0}>()
          h2 = Constant<value = double {3}>()
          y = Clip(b, l2, h2)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert fired(result) == {"clip-clip": 1}
    assert [n.op_type for n in out.graph.node] == ["MyOp", "Clip"]
    assert {i.data_type for i in out.graph.initializer} == {onnx.TensorProto.DOUBLE}
    assert _clip_bounds(out) == (0.0, 2.0)
    # onnxruntime has no kernel for MyOp: only the structure can be checked
    onnx.checker.check_model(out, full_check=False)
