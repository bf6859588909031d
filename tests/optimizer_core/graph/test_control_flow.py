"""Control flow: constant If inlining, passes inside Loop/If bodies, custom-domain ops, and
symbolic dims surviving the default preset."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest

from tests.helpers import assert_equivalent, op_types, parse, rules_fired, run_passes

INLINE = ["if-inline", "dead-code"]


def optimize(proto: onnx.ModelProto, passes=None, **kw):
    # onnx_ir reads initializers straight from the proto it was given, and inlining renames
    # them: optimize a copy so the original stays the reference
    return run_passes(copy.deepcopy(proto), passes, **kw)


def _subgraph(node: onnx.NodeProto, name: str) -> onnx.GraphProto:
    return next(a.g for a in node.attribute if a.name == name)


def _all_names(graph: onnx.GraphProto) -> list[str]:
    names = [i.name for i in graph.input] + [i.name for i in graph.initializer]
    names += [o for n in graph.node for o in n.output if o]
    return names


# ---------------------------------------------------------------- constant If


@pytest.mark.parametrize(("cond", "rule"), [(1, "if-then"), (0, "if-else")], ids=["true", "false"])
def test_if_with_constant_condition_inlined(cond, rule):
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {{
          c = Constant<value = bool {{{cond}}}>()
          r = If(c) <
            then_branch = t () => (float[N, 4] ty) {{
              ty = Neg(x)
            }},
            else_branch = e () => (float[N, 4] ey) {{
              ey = Exp(x)
            }}
          >
          y = Relu(r)
        }}
        """
    )
    out, result = optimize(proto, INLINE)
    assert rules_fired(result) == {rule: 1}
    # the condition, now unread, went with the If    assert op_types(out) == ["Neg" if cond else "Exp", "Relu"]
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_if_whose_branch_feeds_a_graph_output_keeps_the_output_name():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y, float[N, 4] z) {
          c = Constant<value = bool {1}>()
          y, z = If(c) <
            then_branch = t () => (float[N, 4] ty, float[N, 4] tz) {
              ty = Neg(x)
              tz = Abs(x)
            },
            else_branch = e () => (float[N, 4] ey, float[N, 4] ez) {
              ey = Exp(x)
              ez = Sin(x)
            }
          >
        }
        """
    )
    out, result = optimize(proto, INLINE)
    assert rules_fired(result)["if-then"] == 1
    assert op_types(out) == ["Neg", "Abs"]
    assert [o.name for o in out.graph.output] == ["y", "z"]
    assert [list(n.output) for n in out.graph.node] == [["y"], ["z"]]
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_if_branch_returning_one_value_twice_to_graph_outputs():
    # the second output cannot take over the same value: an Identity copies it
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y, float[N, 4] z) {
          c = Constant<value = bool {0}>()
          y, z = If(c) <
            then_branch = t () => (float[N, 4] ty, float[N, 4] tz) {
              ty = Neg(x)
              tz = Neg(x)
            },
            else_branch = e () => (float[N, 4] ey, float[N, 4] ez) {
              ey = Exp(x)
              ez = Identity(ey)
            }
          >
        }
        """
    )
    out, result = optimize(proto, ["if-inline", "identity", "dead-code"])
    assert rules_fired(result)["if-else"] == 1
    assert op_types(out) == ["Exp", "Identity"]
    assert [o.name for o in out.graph.output] == ["y", "z"]
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_if_branch_with_initializers_constants_and_clashing_names():
    # the then branch has its own initializer and Constant node, and names ('a', 'k', 'w2')
    # that the outer graph also defines after the If
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y, float[4] k, float[4] w2) <float[4] w = {1, 2, 3, 4}> {
          c = Constant<value = bool {1}>()
          r = If(c) <
            then_branch = t () => (float[4] ty) <float[4] w2 = {10, 20, 30, 40}> {
              k = Constant<value = float[4] {2, 2, 2, 2}>()
              a = Mul(x, k)
              b = Add(a, w2)
              ty = Add(b, w)
            },
            else_branch = e () => (float[4] ey) {
              a = Neg(x)
              ey = Sub(a, w)
            }
          >
          a = Relu(r)
          k = Neg(a)
          w2 = Add(a, x)
          y = Mul(k, w2)
        }
        """
    )
    out, result = optimize(proto, INLINE)
    assert rules_fired(result)["if-then"] == 1
    assert op_types(out) == ["Constant", "Mul", "Add", "Add", "Relu", "Neg", "Add", "Mul"]
    names = _all_names(out.graph)
    assert len(names) == len(set(names)), names
    assert [o.name for o in out.graph.output] == ["y", "k", "w2"]
    assert len(out.graph.initializer) == 2  # w and the branch's w2 under a new name
    assert_equivalent(proto, out)


def test_if_branch_initializer_shadowing_an_outer_initializer():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y) <float[4] w = {1, 2, 3, 4}> {
          c = Constant<value = bool {0}>()
          r = If(c) <
            then_branch = t () => (float[4] ty) {
              ty = Neg(x)
            },
            else_branch = e () => (float[4] ey) <float[4] w = {10, 20, 30, 40}> {
              ey = Sub(x, w)
            }
          >
          y = Add(r, w)
        }
        """
    )
    out, result = optimize(proto, INLINE)
    assert rules_fired(result) == {"if-else": 1}
    assert op_types(out) == ["Sub", "Add"]
    inits = {i.name: list(i.float_data) for i in out.graph.initializer}
    assert inits["w"] == [1, 2, 3, 4]
    sub, add = out.graph.node
    assert inits[sub.input[1]] == [10, 20, 30, 40]
    assert list(add.input) == [sub.output[0], "w"]
    assert_equivalent(proto, out)


@pytest.mark.parametrize("use", ["graph-output", "read-by-a-node"])
def test_if_branch_returning_its_own_initializer(use):
    # the taken branch's output is one of its initializers: it moves to the outer graph (an
    # initializer cannot be renamed to a graph output's name, so an Identity copies it there)
    tail = "y = Identity(r)" if use == "graph-output" else "y = Add(r, x)"
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y{", float[4] r" if use == "graph-output" else ""}) {{
          c = Constant<value = bool {{0}}>()
          r = If(c) <
            then_branch = t () => (float[4] ty) {{
              ty = Neg(x)
            }},
            else_branch = e () => (float[4] k) <float[4] k = {{1, 2, 3, 4}}> {{
            }}
          >
          {tail}
        }}
        """
    )
    out, result = optimize(proto, INLINE)
    assert rules_fired(result) == {"if-else": 1}
    assert [list(i.float_data) for i in out.graph.initializer] == [[1, 2, 3, 4]]
    (k,) = (i.name for i in out.graph.initializer)
    if use == "graph-output":
        assert op_types(out) == ["Identity", "Identity"]
        assert [o.name for o in out.graph.output] == ["y", "r"]
        assert [list(n.input) for n in out.graph.node] == [[k], ["r"]]
    else:
        assert op_types(out) == ["Add"]
        assert list(out.graph.node[0].input) == [k, "x"]
    assert_equivalent(proto, out)


def test_if_branch_initializers_lifted_and_folded_with_the_default_preset():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
          c = Constant<value = bool {1}>()
          r = If(c) <
            then_branch = t () => (float[N, 4] ty) <float[4] w = {1, 2, 3, 4}> {
              k = Constant<value = float[4] {2, 2, 2, 2}>()
              s = Mul(w, k)
              ty = Add(x, s)
            },
            else_branch = e () => (float[N, 4] ey) {
              ey = Neg(x)
            }
          >
          y = Relu(r)
        }
        """
    )
    out, result = optimize(proto)
    fired = rules_fired(result)
    assert fired["if-then"] == 1 and fired["fold"] == 1
    assert op_types(out) == ["Add", "Relu"]
    assert_equivalent(proto, out, dim_values={"N": 3})


@pytest.mark.parametrize("cond", [1, 0], ids=["true", "false"])
def test_if_condition_from_an_initializer_inlined(cond):
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y) <bool[1] c = {{{cond}}}> {{
          y = If(c) <
            then_branch = t () => (float[4] ty) {{
              ty = Neg(x)
            }},
            else_branch = e () => (float[4] ey) {{
              ey = Exp(x)
            }}
          >
        }}
        """
    )
    out, result = optimize(proto, INLINE)
    assert rules_fired(result) == {"if-then" if cond else "if-else": 1}
    assert op_types(out) == ["Neg" if cond else "Exp"]
    assert len(out.graph.initializer) == 0
    assert_equivalent(proto, out)


def test_if_with_non_constant_condition_kept():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x, bool c) => (float[4] y) {
          y = If(c) <
            then_branch = t () => (float[4] ty) {
              ty = Neg(x)
            },
            else_branch = e () => (float[4] ey) {
              ey = Exp(x)
            }
          >
        }
        """
    )
    out, result = optimize(proto)
    assert not any(k.startswith("if-") for k in rules_fired(result))
    assert op_types(out) == ["If"]
    for c in (True, False):
        feeds = [{"x": np.linspace(-1, 1, 4, dtype=np.float32), "c": np.array(c)}]
        assert_equivalent(proto, out, inputs=feeds)


def test_if_condition_from_an_overridable_initializer_kept():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x, bool c) => (float[4] y) <bool c = {1}> {
          y = If(c) <
            then_branch = t () => (float[4] ty) {
              ty = Neg(x)
            },
            else_branch = e () => (float[4] ey) {
              ey = Exp(x)
            }
          >
        }
        """
    )
    out, result = optimize(proto, INLINE)
    assert not rules_fired(result)
    assert op_types(out) == ["If"]
    assert_equivalent(proto, out)


def test_nested_constant_if_inside_a_loop_body_inlined():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y) {
          n = Constant<value = int64 {3}>()
          go = Constant<value = bool {1}>()
          y = Loop(n, go, x) <
            body = b (int64 i, bool ci, float[4] acc) => (bool co, float[4] acc_out) {
              c = Constant<value = bool {0}>()
              r = If(c) <
                then_branch = t () => (float[4] ty) {
                  ty = Neg(acc)
                },
                else_branch = e () => (float[4] ey) {
                  ey = Sin(acc)
                }
              >
              acc_out = Add(r, x)
              co = Identity(ci)
            }
          >
        }
        """
    )
    out, result = optimize(proto, INLINE)
    assert rules_fired(result)["if-else"] == 1
    assert op_types(out) == ["Constant", "Constant", "Loop"]
    body = _subgraph(out.graph.node[2], "body")
    assert [n.op_type for n in body.node] == ["Sin", "Add", "Identity"]
    assert_equivalent(proto, out)


# ---------------------------------------------------------------- passes inside bodies


def test_passes_recurse_into_loop_bodies():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y) {
          n = Constant<value = int64 {3}>()
          cond = Constant<value = bool {1}>()
          y = Loop(n, cond, x) <
            body = b (int64 i, bool ci, float[4] acc) => (bool co, float[4] acc_out) {
              z = Constant<value = float {0}>()
              a = Add(acc, z)
              t = Identity(a)
              acc_out = Mul(t, x)
              co = Identity(ci)
            }
          >
        }
        """
    )
    out, result = optimize(proto, ["lift-constants", "identity", "algebraic", "dead-code"])
    fired = rules_fired(result)
    assert fired["x+0"] == 1 and fired["identity"] == 1
    assert op_types(out) == ["Loop"]
    body = _subgraph(out.graph.node[0], "body")
    # co = Identity(ci) stays: a body output cannot be renamed onto a body input
    assert [n.op_type for n in body.node] == ["Mul", "Identity"]
    assert list(body.node[0].input) == ["acc", "x"]
    assert_equivalent(proto, out)


def test_passes_recurse_into_if_branches_with_the_default_preset():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x, bool c) => (float[N, 4] y) {
          y = If(c) <
            then_branch = t () => (float[N, 4] ty) {
              one = Constant<value = float {1}>()
              a = Mul(x, one)
              b = Relu(a)
              ty = Relu(b)
            },
            else_branch = e () => (float[N, 4] ey) {
              a1 = Neg(x)
              a2 = Neg(a1)
              ey = Exp(a2)
            }
          >
        }
        """
    )
    out, result = optimize(proto)
    fired = rules_fired(result)
    assert fired["x*1"] == 1
    assert fired["relu-after-non-negative"] == 1
    assert fired["neg-neg"] == 1
    assert op_types(out) == ["If"]
    assert [n.op_type for n in _subgraph(out.graph.node[0], "then_branch").node] == ["Relu"]
    assert [n.op_type for n in _subgraph(out.graph.node[0], "else_branch").node] == ["Exp"]
    for c in (True, False):
        feeds = [{"x": np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4), "c": np.array(c)}]
        assert_equivalent(proto, out, inputs=feeds)


def test_dead_code_inside_a_loop_body_and_its_outer_constant_removed():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y) <float[4] w = {1, 2, 3, 4}> {
          n = Constant<value = int64 {2}>()
          cond = Constant<value = bool {1}>()
          y = Loop(n, cond, x) <
            body = b (int64 i, bool ci, float[4] acc) => (bool co, float[4] acc_out) {
              dead = Mul(acc, w)
              acc_out = Neg(acc)
              co = Identity(ci)
            }
          >
        }
        """
    )
    out, result = optimize(proto, ["dead-code"])
    fired = rules_fired(result)
    assert fired == {"dead-node": 1, "unused-initializer": 1}
    body = _subgraph(out.graph.node[2], "body")
    assert [n.op_type for n in body.node] == ["Neg", "Identity"]
    assert [i.name for i in out.graph.initializer] == []
    assert_equivalent(proto, out)


# ---------------------------------------------------------------- custom domains


def test_custom_domain_op_left_untouched():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17, "com.example" : 1]>
        g (float[N, 4] x, bool c) => (float[N, 4] y, float[N, 4] z) {
          zero = Constant<value = float {0}>()
          a = Add(x, zero)
          m = com.example.MyOp<alpha = 2.0>(a, zero)
          i = Identity(m)
          y = Relu(i)
          z = If(c) <
            then_branch = t () => (float[N, 4] ty) {
              ty = com.example.MyOp(x)
            },
            else_branch = e () => (float[N, 4] ey) {
              ey = Neg(x)
            }
          >
        }
        """
    )
    out, result = optimize(proto)
    fired = rules_fired(result)
    assert fired["x+0"] == 1 and fired["identity"] == 1
    custom = [n for n in out.graph.node if n.domain == "com.example"]
    assert len(custom) == 1
    (node,) = custom
    assert node.op_type == "MyOp"
    assert node.input[0] == "x"
    assert [(a.name, a.f) for a in node.attribute] == [("alpha", 2.0)]
    assert op_types(out) == ["MyOp", "Relu", "If"]
    then = _subgraph(out.graph.node[2], "then_branch")
    assert [(n.domain, n.op_type) for n in then.node] == [("com.example", "MyOp")]
    assert {o.domain for o in out.opset_import} == {"", "com.example"}
    # onnxruntime has no kernel for MyOp: only the structure can be checked
    onnx.checker.check_model(out, full_check=False)


def test_custom_domain_op_with_a_subgraph_attribute():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17, "com.example" : 1]>
        g (float[4] x) => (float[4] y) {
          y = com.example.Wrap(x) <
            body = b (float[4] bx) => (float[4] by) {
              one = Constant<value = float {1}>()
              t = Mul(bx, one)
              u = Identity(t)
              by = Neg(u)
            }
          >
        }
        """
    )
    out, result = optimize(proto)
    fired = rules_fired(result)
    assert fired["x*1"] == 1 and fired["identity"] == 1
    (node,) = out.graph.node
    assert (node.domain, node.op_type) == ("com.example", "Wrap")
    assert [n.op_type for n in _subgraph(node, "body").node] == ["Neg"]
    onnx.checker.check_model(out, full_check=False)


# ---------------------------------------------------------------- symbolic dims


def _dims(value_info: onnx.ValueInfoProto) -> list[int | str]:
    return [
        d.dim_param if d.HasField("dim_param") else d.dim_value
        for d in value_info.type.tensor_type.shape.dim
    ]


def test_symbolic_dims_survive_the_default_preset():
    # every output's producer is rewritten away, so each output is taken over by a value whose
    # inferred shape names its dims differently (the Reshape's middle dim is unknown to
    # inference): the outputs must keep the dims they declare
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[batch, seq, 8] x, int32[batch, seq] ids)
          => (float[batch, seq, 8] y, float[batch, 8, seq] z, int32[batch, seq] k)
        {
          s = Shape(x)
          i2 = Constant<value = int64[1] {2}>()
          d = Gather<axis = 0>(s, i2)
          i0 = Constant<value = int64[1] {0}>()
          b = Gather<axis = 0>(s, i0)
          m = Constant<value = int64[1] {-1}>()
          shp = Concat<axis = 0>(b, m, d)
          r = Reshape(x, shp)
          zero = Constant<value = float {0}>()
          y = Add(r, zero)
          w = Transpose<perm = [0, 2, 1]>(r)
          t = Transpose<perm = [0, 2, 1]>(w)
          z = Transpose<perm = [0, 2, 1]>(t)
          a = Abs(ids)
          c = Cast<to = 7>(a)
          k = Cast<to = 6>(c)
        }
        """
    )
    out, result = optimize(proto)
    fired = rules_fired(result)
    assert fired["x+0"] == 1
    assert fired["transpose-transpose-cancel"] == 1
    assert fired["cast-round-trip"] == 1
    # the computed shape is [batch, -1, 8] over x's own dims: a constant [0, -1, 8], so the
    # Reshape is a no-op kept only because y (an output) cannot be renamed to x (an input)
    assert fired["reshape-copy-dims"] == 1
    assert op_types(out) == ["Reshape", "Transpose", "Abs"]
    assert [(i.name, _dims(i)) for i in out.graph.input] == [
        ("x", ["batch", "seq", 8]),
        ("ids", ["batch", "seq"]),
    ]
    assert [(o.name, _dims(o)) for o in out.graph.output] == [
        ("y", ["batch", "seq", 8]),
        ("z", ["batch", 8, "seq"]),
        ("k", ["batch", "seq"]),
    ]
    assert_equivalent(proto, out, dim_values={"batch": 3, "seq": 5})
    assert_equivalent(proto, out, dim_values={"batch": 1, "seq": 7})
