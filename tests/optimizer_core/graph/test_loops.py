"""Loops: unrolling constant-trip-count Loops, hoisting loop-invariant nodes out of Loop and
Scan bodies, and fusing independent sibling Loops."""

from __future__ import annotations

import copy
import io
import warnings

import numpy as np
import onnx
import pytest

from graphtrim.graph.framework import OptimizeOptions
from tests.helpers import assert_equivalent, op_types, parse, rules_fired, run_passes


def optimize(proto: onnx.ModelProto, passes=None, **kw):
    # unrolling and hoisting move initializers, which onnx_ir shares with the proto it read:
    # optimize a copy so the original stays the reference
    return run_passes(copy.deepcopy(proto), passes, **kw)


def _body(node: onnx.NodeProto) -> onnx.GraphProto:
    return next(a.g for a in node.attribute if a.name == "body")


def _all_names(graph: onnx.GraphProto) -> list[str]:
    names = [i.name for i in graph.input] + [i.name for i in graph.initializer]
    names += [o for n in graph.node for o in n.output if o]
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                names += _all_names(attr.g)
    return names


def _count(proto: onnx.ModelProto, op_type: str) -> int:
    return op_types(proto).count(op_type)


# ---------------------------------------------------------------- unrolling

ACCUMULATOR = """
<ir_version: 8, opset_import: ["" : {opset}]>
g (float[4] x) => (float[4] y, float[{trip}, 4] s) {{
  n = Constant<value = int64 {{{trip}}}>()
  go = Constant<value = bool {{1}}>()
  y, s = Loop(n, go, x) <
    body = b (int64 i, bool ci, float[4] acc) => (bool co, float[4] acc_out, float[4] sc) {{
      f = Cast<to = 1>(i)
      a = Add(acc, f)
      acc_out = Mul(a, x)
      sc = Sub(acc_out, f)
      co = Identity(ci)
    }}
  >
}}
"""


@pytest.mark.parametrize("opset", [11, 17])
def test_accumulator_loop_with_scan_output_unrolled(opset):
    # opset 11 takes Unsqueeze's axes as an attribute, 13 and later as an input
    proto = parse(ACCUMULATOR.format(opset=opset, trip=3))
    out, result = optimize(proto, ["loop-unroll"])
    assert rules_fired(result) == {"loop-unroll": 1}
    assert op_types(out) == ["Cast", "Add", "Mul", "Sub"] * 3 + ["Unsqueeze"] * 3 + ["Concat"]
    assert [o.name for o in out.graph.output] == ["y", "s"]
    names = _all_names(out.graph)
    assert len(names) == len(set(names)), names
    # the iteration numbers are the constants 0, 1, 2
    iters = [
        onnx.numpy_helper.to_array(i).tolist() for i in out.graph.initializer if i.data_type == 7
    ]
    assert iters == [0, 1, 2] + ([] if opset < 13 else [[0]])  # + the Unsqueeze axes
    assert_equivalent(proto, out)


def test_unrolled_loop_with_the_default_preset_folds_the_iteration_numbers():
    proto = parse(ACCUMULATOR.format(opset=17, trip=4))
    out, result = optimize(proto)
    fired = rules_fired(result)
    assert fired["loop-unroll"] == 1
    assert "Loop" not in op_types(out) and "Cast" not in op_types(out)
    assert_equivalent(proto, out)


def test_loop_of_one_iteration_unrolled_without_concat():
    proto = parse(ACCUMULATOR.format(opset=17, trip=1))
    out, result = optimize(proto, ["loop-unroll"])
    assert rules_fired(result) == {"loop-unroll": 1}
    assert op_types(out) == ["Cast", "Add", "Mul", "Sub", "Unsqueeze"]
    assert [o.name for o in out.graph.output] == ["y", "s"]
    assert_equivalent(proto, out)


def test_loop_reading_outer_values_and_its_own_initializer_unrolled():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 3] x, float[3] v) => (float[2, 3] y, float[3] z) <float[3] w = {1, 2, 3}> {
          n = Constant<value = int64 {3}>()
          t = Relu(v)
          y, z = Loop(n, , x, v) <
            body = b (int64 i, bool ci, float[2, 3] a, float[3] b)
              => (bool co, float[2, 3] a_out, float[3] b_out) <float[3] k = {0.5, 0.25, 2}> {
              m = Mul(a, w)
              a_out = Add(m, t)
              p = Mul(b, k)
              b_out = Sub(p, w)
              co = Identity(ci)
            }
          >
        }
        """
    )
    out, result = optimize(proto, ["loop-unroll"])
    assert rules_fired(result) == {"loop-unroll": 1}
    assert op_types(out) == ["Relu"] + ["Mul", "Add", "Mul", "Sub"] * 3
    inits = {i.name: list(i.float_data) for i in out.graph.initializer}
    # the body's initializer moved out once (renamed), shared by the three copies
    assert sorted(inits.values()) == [[0.5, 0.25, 2.0], [1.0, 2.0, 3.0]]
    assert inits["w"] == [1.0, 2.0, 3.0]
    muls = [n for n in out.graph.node if n.op_type == "Mul"]
    assert all(n.input[1] in inits for n in muls)
    assert list(out.graph.node[1].input) == ["x", "w"]
    assert list(out.graph.node[2].input)[1] == "t"
    assert_equivalent(proto, out)


def test_loop_with_a_nested_if_unrolled_then_each_if_inlined():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y) {
          n = Constant<value = int64 {4}>()
          two = Constant<value = int64 {2}>()
          y = Loop(n, , x) <
            body = b (int64 i, bool ci, float[4] acc) => (bool co, float[4] acc_out) {
              small = Less(i, two)
              r = If(small) <
                then_branch = t () => (float[4] ty) {
                  ty = Neg(acc)
                },
                else_branch = e () => (float[4] ey) {
                  s = Sin(acc)
                  ey = Add(s, x)
                }
              >
              acc_out = Mul(r, x)
              co = Identity(ci)
            }
          >
        }
        """
    )
    out, result = optimize(proto, ["loop-unroll"])
    assert rules_fired(result) == {"loop-unroll": 1}
    assert op_types(out) == ["Constant"] + ["Less", "If", "Mul"] * 4
    names = _all_names(out.graph)
    # the copies' branches are siblings: they may share names, the outer graph may not
    outer = [i.name for i in out.graph.initializer] + [o for n in out.graph.node for o in n.output]
    assert len(outer) == len(set(outer))
    assert len(names) > len(outer)
    assert_equivalent(proto, out)

    out, result = optimize(proto)
    fired = rules_fired(result)
    assert fired["loop-unroll"] == 1
    assert fired["if-then"] == 2 and fired["if-else"] == 2
    assert op_types(out) == ["Neg", "Mul", "Neg", "Mul", "Sin", "Add", "Mul", "Sin", "Add", "Mul"]
    assert_equivalent(proto, out)


def test_nested_loops_unrolled_inner_first():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y) {
          n = Constant<value = int64 {2}>()
          m = Constant<value = int64 {3}>()
          y = Loop(n, , x) <
            body = ob (int64 i, bool oc, float[4] acc) => (bool oco, float[4] acc_out) {
              inner = Loop(m, , acc) <
                body = ib (int64 j, bool ic, float[4] a) => (bool ico, float[4] a_out) {
                  fj = Cast<to = 1>(j)
                  s = Mul(a, x)
                  a_out = Add(s, fj)
                  ico = Identity(ic)
                }
              >
              fi = Cast<to = 1>(i)
              acc_out = Sub(inner, fi)
              oco = Identity(oc)
            }
          >
        }
        """
    )
    out, result = optimize(proto, ["loop-unroll"])
    assert rules_fired(result) == {"loop-unroll": 2}
    assert "Loop" not in op_types(out)
    assert op_types(out).count("Mul") == 6
    assert_equivalent(proto, out)


def test_passthrough_carried_value_that_is_a_graph_output():
    # the carried value never changes: the Loop's output is the outer input x, which cannot
    # take over the output's name, so an Identity copies it
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y, float[4] z) {
          n = Constant<value = int64 {2}>()
          y, z = Loop(n, , x, x) <
            body = b (int64 i, bool ci, float[4] keep, float[4] acc)
              => (bool co, float[4] keep_out, float[4] acc_out) {
              acc_out = Add(acc, keep)
              keep_out = Identity(keep)
              co = Identity(ci)
            }
          >
        }
        """
    )
    out, result = optimize(proto, ["loop-unroll", "identity"])
    assert rules_fired(result)["loop-unroll"] == 1
    assert [o.name for o in out.graph.output] == ["y", "z"]
    assert "Loop" not in op_types(out)
    assert_equivalent(proto, out)


def test_body_condition_constant_true_and_loop_condition_absent():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y) {
          n = Constant<value = int64 {3}>()
          y = Loop(n, , x) <
            body = b (int64 i, bool ci, float[4] acc) => (bool co, float[4] acc_out) {
              acc_out = Sin(acc)
              co = Constant<value = bool {1}>()
            }
          >
        }
        """
    )
    out, result = optimize(proto, ["loop-unroll"])
    assert rules_fired(result) == {"loop-unroll": 1}
    # the copies of the condition's Constant are dead, and go with the Loop
    assert op_types(out) == ["Sin"] * 3
    assert_equivalent(proto, out)


@pytest.mark.parametrize(
    ("trip", "cond_out", "options"),
    [
        ("n_in", "co = Identity(ci)", None),  # trip count not a constant
        ("n17", "co = Identity(ci)", None),  # above the default cap of 16
        ("n3", "co = Less(i, three)", None),  # the body may stop the loop
        ("n0", "co = Identity(ci)", None),  # runs zero times
        ("n3", "co = Identity(ci)", OptimizeOptions(max_unroll_trip_count=2)),
        ("n3", "co = Identity(ci)", OptimizeOptions(max_unroll_nodes=5)),  # 2 nodes x 3 > 5
        ("n3", "co = Identity(ci)", OptimizeOptions(max_unroll_nodes=6)),  # 6 <= 6: unrolled
    ],
    ids=["dynamic", "above-cap", "early-exit", "zero-trips", "option-cap", "node-cap", "fits"],
)
def test_loops_that_are_not_unrolled(trip, cond_out, options):
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x, int64 n_in) => (float[4] y) {{
          n17 = Constant<value = int64 {{17}}>()
          n3 = Constant<value = int64 {{3}}>()
          n0 = Constant<value = int64 {{0}}>()
          three = Constant<value = int64 {{3}}>()
          y = Loop({trip}, , x) <
            body = b (int64 i, bool ci, float[4] acc) => (bool co, float[4] acc_out) {{
              acc_out = Sin(acc)
              {cond_out}
            }}
          >
        }}
        """
    )
    out, result = optimize(proto, ["loop-unroll"], options=options)
    feeds = [{"x": np.linspace(-1, 1, 4, dtype=np.float32), "n_in": np.array(3, np.int64)}]
    if options is not None and options.max_unroll_nodes == 6:
        assert rules_fired(result) == {"loop-unroll": 1}
        assert "Loop" not in op_types(out)
    else:
        assert not rules_fired(result)
        assert op_types(out)[-1] == "Loop"
    assert_equivalent(proto, out, inputs=feeds)


def test_loop_with_a_random_op_not_unrolled():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y) {
          n = Constant<value = int64 {3}>()
          y = Loop(n, , x) <
            body = b (int64 i, bool ci, float[4] acc) => (bool co, float[4] acc_out) {
              r = RandomNormalLike<seed = 1.0>(acc)
              acc_out = Add(acc, r)
              co = Identity(ci)
            }
          >
        }
        """
    )
    out, result = optimize(proto, ["loop-unroll"])
    assert not rules_fired(result)
    assert op_types(out) == ["Constant", "Loop"]


# ---------------------------------------------------------------- hoisting


def test_invariant_nodes_hoisted_out_of_a_loop_body():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x, float[4] v, int64 n) => (float[4] y) <float[4] w = {1, 2, 3, 4}> {
          y = Loop(n, , x) <
            body = b (int64 i, bool ci, float[4] acc) => (bool co, float[4] acc_out)
              <float[4] k = {0.5, 0.5, 2, 2}> {
              e = Mul(v, w)
              g = Exp(e)
              h = Mul(g, k)
              f = Cast<to = 1>(i)
              a = Mul(acc, h)
              acc_out = Add(a, f)
              co = Identity(ci)
            }
          >
        }
        """
    )
    out, result = optimize(proto, ["loop-hoist"])
    assert rules_fired(result) == {"loop-hoist": 3}
    assert op_types(out) == ["Mul", "Exp", "Mul", "Loop"]
    body = _body(out.graph.node[3])
    assert [n.op_type for n in body.node] == ["Cast", "Mul", "Add", "Identity"]
    # the body's initializer left with the node reading it
    assert len(body.initializer) == 0 and len(out.graph.initializer) == 2
    assert body.node[1].input[1] == out.graph.node[2].output[0]
    names = _all_names(out.graph)
    assert len(names) == len(set(names)), names
    for trips in (0, 1, 4):
        feeds = [
            {
                "x": np.linspace(-1, 1, 4, dtype=np.float32),
                "v": np.linspace(0, 1, 4, dtype=np.float32),
                "n": np.array(trips, np.int64),
            }
        ]
        assert_equivalent(proto, out, inputs=feeds)


def test_invariant_nodes_hoisted_out_of_a_scan_body():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] s0, float[5, 4] xs, float[4] v) => (float[4] last, float[5, 4] ys) {
          last, ys = Scan(s0, xs) <
            num_scan_inputs = 1,
            body = b (float[4] st, float[4] xi) => (float[4] st_out, float[4] yi) {
              nv = Neg(v)
              sq = Mul(nv, nv)
              st_out = Add(st, xi)
              yi = Mul(st_out, sq)
            }
          >
        }
        """
    )
    out, result = optimize(proto, ["loop-hoist"])
    assert rules_fired(result) == {"scan-hoist": 2}
    assert op_types(out) == ["Neg", "Mul", "Scan"]
    body = _body(out.graph.node[2])
    assert [n.op_type for n in body.node] == ["Add", "Mul"]
    assert body.node[1].input[1] == out.graph.node[1].output[0]
    assert_equivalent(proto, out)


def test_hoisted_value_returned_by_the_body_goes_through_an_identity():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x, float[4] v) => (float[4] y, float[3, 4] s) {
          n = Constant<value = int64 {3}>()
          y, s = Loop(n, , x) <
            body = b (int64 i, bool ci, float[4] acc) => (bool co, float[4] acc_out, float[4] e) {
              e = Exp(v)
              acc_out = Add(acc, e)
              co = Identity(ci)
            }
          >
        }
        """
    )
    out, result = optimize(proto, ["loop-hoist", "identity", "dead-code"])
    assert rules_fired(result) == {"loop-hoist": 1}
    assert op_types(out) == ["Constant", "Exp", "Loop"]
    body = _body(out.graph.node[2])
    assert [n.op_type for n in body.node] == ["Add", "Identity", "Identity"]
    assert body.output[2].name == body.node[2].output[0]
    assert_equivalent(proto, out)


def test_constant_node_moves_with_the_node_reading_it():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x, float[4] v) => (float[4] y) {
          n = Constant<value = int64 {3}>()
          y = Loop(n, , x) <
            body = b (int64 i, bool ci, float[4] acc) => (bool co, float[4] acc_out) {
              two = Constant<value = float {2}>()
              alone = Constant<value = float {3}>()
              t = Pow(v, two)
              a = Mul(acc, t)
              acc_out = Add(a, alone)
              co = Identity(ci)
            }
          >
        }
        """
    )
    out, result = optimize(proto, ["loop-hoist"])
    # the Constant read only inside the body stays there
    assert rules_fired(result) == {"loop-hoist": 2}
    assert op_types(out) == ["Constant", "Constant", "Pow", "Loop"]
    body = _body(out.graph.node[3])
    assert [n.op_type for n in body.node] == ["Constant", "Mul", "Add", "Identity"]
    assert_equivalent(proto, out)


def test_nested_loops_hoist_through_both_levels():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x, float[4] v) => (float[4] y) {
          n = Constant<value = int64 {2}>()
          y = Loop(n, , x) <
            body = ob (int64 i, bool oc, float[4] acc) => (bool oco, float[4] acc_out) {
              acc_out = Loop(n, , acc) <
                body = ib (int64 j, bool ic, float[4] a) => (bool ico, float[4] a_out) {
                  t = Tanh(v)
                  a_out = Add(a, t)
                  ico = Identity(ic)
                }
              >
              oco = Identity(oc)
            }
          >
        }
        """
    )
    out, result = optimize(proto, ["loop-hoist"])
    # out of the inner body, then out of the outer body, in one run of the pass
    assert result.log.records[0].rules == {"loop-hoist": 2}
    assert op_types(out) == ["Constant", "Tanh", "Loop"]
    outer_body = _body(out.graph.node[2])
    assert [n.op_type for n in outer_body.node] == ["Loop", "Identity"]
    assert [n.op_type for n in _body(outer_body.node[0]).node] == ["Add", "Identity"]
    assert_equivalent(proto, out)


def test_loop_variant_and_random_nodes_not_hoisted():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x, float[4] v, int64 n) => (float[4] y) {
          y = Loop(n, , x) <
            body = b (int64 i, bool ci, float[4] acc) => (bool co, float[4] acc_out)
              <float[4] k = {1, 2, 3, 4}> {
              f = Cast<to = 1>(i)
              r = RandomUniformLike<seed = 3.0>(v)
              c = Mul(k, k)
              p = Mul(acc, v)
              q = Add(p, r)
              s = Add(q, c)
              acc_out = Add(s, f)
              cv = Identity(ci)
              co = Identity(cv)
            }
          >
        }
        """
    )
    out, result = optimize(proto, ["loop-hoist"])
    assert not rules_fired(result)
    assert op_types(out) == ["Loop"]


def test_hoisting_converges_with_the_default_preset():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x, float[4] v, int64 n) => (float[4] y) {
          y = Loop(n, , x) <
            body = b (int64 i, bool ci, float[4] acc) => (bool co, float[4] acc_out) {
              two = Constant<value = float {2}>()
              t = Mul(v, two)
              u = Sigmoid(t)
              acc_out = Mul(acc, u)
              co = Identity(ci)
            }
          >
        }
        """
    )
    out, result = optimize(proto)
    assert result.log.converged
    assert rules_fired(result)["loop-hoist"] == 2
    assert op_types(out) == ["Mul", "Sigmoid", "Loop"]
    feeds = [
        {
            "x": np.linspace(-1, 1, 4, dtype=np.float32),
            "v": np.linspace(0, 1, 4, dtype=np.float32),
            "n": np.array(3, np.int64),
        }
    ]
    assert_equivalent(proto, out, inputs=feeds)


# ---------------------------------------------------------------- fusion

TWO_LOOPS = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[4] x, float[4] v) => (float[4] y, float[4] z, float[20, 4] sy, float[20, 4] sz) {{
  n = Constant<value = int64 {{20}}>()
  m = Constant<value = int64 {{{second_trip}}}>()
  y, sy = Loop(n, , x) <
    body = b (int64 i, bool ci, float[4] acc) => (bool co, float[4] acc_out, float[4] sc) {{
      f = Cast<to = 1>(i)
      a = Mul(acc, v)
      acc_out = Add(a, f)
      sc = Neg(acc_out)
      co = Identity(ci)
    }}
  >
  {between}
  z, sz = Loop(m, , {second_init}) <
    body = b (int64 i, bool ci, float[4] acc) => (bool co, float[4] acc_out, float[4] sc) {{
      s = Sin(acc)
      acc_out = Add(s, {second_reads})
      sc = Abs(acc_out)
      co = Identity(ci)
    }}
  >
}}
"""


def test_two_independent_loops_fused():
    # the same value names in both bodies: the second body's are renamed
    proto = parse(TWO_LOOPS.format(second_trip=20, between="", second_init="v", second_reads="x"))
    out, result = optimize(proto, ["loop-fuse", "dead-code"])
    assert rules_fired(result)["loop-fuse"] == 1
    assert op_types(out) == ["Constant", "Loop"]
    loop = out.graph.node[1]
    assert list(loop.output) == ["y", "z", "sy", "sz"]
    assert list(loop.input)[2:] == ["x", "v"]
    body = _body(loop)
    # the second body's condition Identity is gone: the fused body returns the first's
    assert [n.op_type for n in body.node] == [
        *("Cast", "Mul", "Add", "Neg", "Identity"),
        *("Sin", "Add", "Abs"),
    ]
    assert len(body.input) == 4 and len(body.output) == 5
    names = _all_names(out.graph)
    assert len(names) == len(set(names)), names
    assert_equivalent(proto, out)


def test_loops_fused_with_the_default_preset_above_the_unroll_cap():
    proto = parse(TWO_LOOPS.format(second_trip=20, between="", second_init="v", second_reads="x"))
    out, result = optimize(proto)
    fired = rules_fired(result)
    assert fired["loop-fuse"] == 1 and "loop-unroll" not in fired
    assert op_types(out).count("Loop") == 1
    assert_equivalent(proto, out)


def test_node_reading_the_first_loop_moves_after_the_fused_loop():
    proto = parse(
        TWO_LOOPS.format(
            second_trip=20,
            between="r = Relu(y)\n  w = Neg(v)",
            second_init="w",
            second_reads="x",
        ).replace("=> (float[4] y,", "=> (float[4] r, float[4] y,")
    )
    out, result = optimize(proto, ["loop-fuse"])
    assert rules_fired(result) == {"loop-fuse": 1}
    # the second Loop's trip count went with it; w stays in front, r moves behind
    assert op_types(out) == ["Constant", "Neg", "Loop", "Relu"]
    assert out.graph.node[3].input[0] == out.graph.node[2].output[0]
    assert_equivalent(proto, out)


def test_fused_bodies_with_clashing_names_and_a_nested_if():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x, bool c) => (float[4] y, float[4] z, int64[20] s1, int64[20] s2) {
          n = Constant<value = int64 {20}>()
          y, s1 = Loop(n, , x) <
            body = b (int64 i, bool ci, float[4] acc) => (bool ci, float[4] acc_out, int64 k) {
              k = Identity(i)
              t = Sin(acc)
              acc_out = Add(t, x)
            }
          >
          z, s2 = Loop(n, , x) <
            body = b (int64 i, bool ci, float[4] acc) => (bool co, float[4] acc_out, int64 k) {
              k = Identity(i)
              acc_out = If(c) <
                then_branch = tb () => (float[4] t) { t = Cos(acc) },
                else_branch = eb () => (float[4] t) { t = Neg(acc) }
              >
              co = Identity(ci)
            }
          >
        }
        """
    )
    out, result = optimize(proto, ["loop-fuse"])
    assert rules_fired(result) == {"loop-fuse": 1}
    assert op_types(out) == ["Constant", "Loop"]
    body = _body(out.graph.node[1])
    assert [n.op_type for n in body.node] == ["Identity", "Sin", "Add", "Identity", "If"]
    top = [i.name for i in body.input] + [o for n in body.node for o in n.output]
    assert len(top) == len(set(top))
    # the second body's values are renamed, also where its If branches read them
    branch_reads = {i for a in body.node[4].attribute for n in a.g.node for i in n.input}
    assert branch_reads == {body.input[3].name}
    for c in (True, False):
        feeds = [{"x": np.linspace(-1, 1, 4, dtype=np.float32), "c": np.array(c)}]
        assert_equivalent(proto, out, inputs=feeds)


@pytest.mark.parametrize(
    ("second_trip", "between", "second_init", "second_reads"),
    [
        (20, "", "y", "x"),  # the second Loop starts from the first's result
        (20, "", "v", "y"),  # its body reads the first's result
        (20, "r = Relu(y)", "v", "r"),  # ... through a node between them
        (19, "", "v", "x"),  # different trip counts
    ],
    ids=["input", "body-reads", "through-a-node", "trip-counts"],
)
def test_dependent_or_mismatched_loops_not_fused(second_trip, between, second_init, second_reads):
    proto = parse(
        TWO_LOOPS.format(
            second_trip=second_trip,
            between=between,
            second_init=second_init,
            second_reads=second_reads,
        )
    )
    out, result = optimize(proto, ["loop-fuse"])
    assert not rules_fired(result)
    assert _count(out, "Loop") == 2


def test_loop_that_may_exit_early_not_fused():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y, float[4] z) {
          n = Constant<value = int64 {20}>()
          lim = Constant<value = int64 {5}>()
          y = Loop(n, , x) <
            body = b (int64 i, bool ci, float[4] acc) => (bool co, float[4] acc_out) {
              acc_out = Sin(acc)
              co = Less(i, lim)
            }
          >
          z = Loop(n, , x) <
            body = b2 (int64 i2, bool ci2, float[4] acc2) => (bool co2, float[4] acc_out2) {
              acc_out2 = Cos(acc2)
              co2 = Identity(ci2)
            }
          >
        }
        """
    )
    out, result = optimize(proto, ["loop-fuse"])
    assert not rules_fired(result)
    assert _count(out, "Loop") == 2


# ---------------------------------------------------------------- a Loop from torch


def test_scripted_torch_loop_unrolled():
    torch = pytest.importorskip("torch")

    class Accumulate(torch.nn.Module):
        def forward(self, x, w):
            acc = x
            for i in range(x.shape[0]):
                acc = acc * w + x[i]
            return acc

    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            torch.jit.script(Accumulate()),
            (torch.randn(3, 4), torch.randn(4)),
            buf,
            dynamo=False,
            opset_version=17,
            input_names=["x", "w"],
            output_names=["y"],
        )
    proto = onnx.load_from_string(buf.getvalue())
    assert "Loop" in op_types(proto)
    out, result = optimize(proto)
    assert rules_fired(result)["loop-unroll"] == 1
    assert "Loop" not in op_types(out)
    assert_equivalent(proto, out)
