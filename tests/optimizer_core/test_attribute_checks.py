"""Attribute values that break an op's rules are refused at load (exit 2, one line naming the
node, the attribute and the value), and the passes decline, never crash, on values they cannot
use.

The seeded part mutates the attributes of a transformer-like block (written-out layer norms,
attention with Transpose / Softmax / Reshape, a Conv stem) against its inputs' ranks: every
mutated model is either run by onnxruntime, then optimized with equal results (exit 0), or
refused by onnxruntime, then refused by graphtrim (exit 2). The same models, deserialized
without the load check, go through every pass of the ``compact`` preset: no pass may raise.
"""

from __future__ import annotations

import contextlib
import io
import random
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest

from graphtrim.errors import InvalidModelError
from tests.optimizer_core.fuzz_values import mutate_attribute_value, runs_in_onnxruntime

T = onnx.TensorProto
SEED = 20261206
CASES = 120


def _run_cli(*args: str) -> tuple[int, str]:
    from graphtrim.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(args))
    return code, err.getvalue()


def _out_shape(
    nodes: list[onnx.NodeProto], x_shape: list, inits: list[onnx.TensorProto], out: str
) -> list:
    """The output's shape as onnx infers it, or symbolic dims of the input's rank where it
    cannot (the checker wants a shape; it does not compare it with the ops)."""
    graph = oh.make_graph(
        nodes,
        "g",
        [oh.make_tensor_value_info("x", T.FLOAT, x_shape)],
        [oh.ValueInfoProto(name=out)],
        list(inits),
    )
    try:
        inferred = onnx.shape_inference.infer_shapes(
            oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]), strict_mode=True
        )
        tt = inferred.graph.output[0].type.tensor_type
        if tt.HasField("shape"):
            return [
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                for d in tt.shape.dim
            ]
    except Exception:
        pass
    return [f"d{i}" for i in range(len(x_shape))]


def _model(
    nodes: list[onnx.NodeProto],
    x_shape: list[int],
    inits: list[onnx.TensorProto] = (),  # type: ignore[assignment]
    out: str = "y",
    functions: list[onnx.FunctionProto] = (),  # type: ignore[assignment]
) -> onnx.ModelProto:
    graph = oh.make_graph(
        nodes,
        "g",
        [oh.make_tensor_value_info("x", T.FLOAT, x_shape)],
        [oh.make_tensor_value_info(out, T.FLOAT, _out_shape(nodes, x_shape, inits, out))],
        list(inits),
    )
    opsets = [oh.make_opsetid("", 17)] + ([oh.make_opsetid("local", 1)] if functions else [])
    model = oh.make_model(graph, opset_imports=opsets, functions=list(functions))
    model.ir_version = 8
    onnx.checker.check_model(model)  # the checker does not compare values with the input
    return model


def _axes(name: str, values: list[int]) -> onnx.TensorProto:
    return onh.from_array(np.array(values, dtype=np.int64), name)


# (id, nodes, input shape, initializers, the node, the attribute, the value as printed)
REFUSED = [
    (
        "perm-repeats",
        [oh.make_node("Transpose", ["x"], ["y"], name="t", perm=[0, 2, 2])],
        [2, 3, 4],
        [],
        "t",
        "perm",
        "[0, 2, 2]",
    ),
    (
        "perm-longer-than-rank",
        [oh.make_node("Transpose", ["x"], ["y"], name="t", perm=[0, 1, 2, 3])],
        [2, 3, 4],
        [],
        "t",
        "perm",
        "[0, 1, 2, 3]",
    ),
    (
        "perm-shorter-than-rank",
        [oh.make_node("Transpose", ["x"], ["y"], name="t", perm=[1, 0])],
        [2, 3, 4],
        [],
        "t",
        "perm",
        "[1, 0]",
    ),
    (
        "reduce-axes-out-of-range",
        [oh.make_node("ReduceMean", ["x"], ["y"], name="r", axes=[3])],
        [2, 3, 4],
        [],
        "r",
        "axes",
        "[3]",
    ),
    (
        "unsqueeze-axes-twice",
        [oh.make_node("Unsqueeze", ["x", "ax"], ["y"], name="u")],
        [2, 3],
        [_axes("ax", [0, -4])],
        "u",
        "axes (input 1)",
        "[0, -4]",
    ),
    (
        "keepdims-two",
        [oh.make_node("ReduceMean", ["x"], ["y"], name="r", axes=[-1], keepdims=2)],
        [2, 3, 4],
        [],
        "r",
        "keepdims",
        "2",
    ),
    (
        "reducesum-axes-input",
        [oh.make_node("ReduceSum", ["x", "ax"], ["y"], name="r")],
        [2, 3],
        [_axes("ax", [-3])],
        "r",
        "axes (input 1)",
        "[-3]",
    ),
    (
        "squeeze-a-dim-not-one",
        [oh.make_node("Squeeze", ["x", "ax"], ["y"], name="s")],
        [2, 3],
        [_axes("ax", [1])],
        "s",
        "axes (input 1)",
        "[1]",
    ),
    (
        "unsqueeze-axes-out-of-range",
        [oh.make_node("Unsqueeze", ["x", "ax"], ["y"], name="u")],
        [2, 3],
        [_axes("ax", [4])],
        "u",
        "axes (input 1)",
        "[4]",
    ),
    (
        "concat-axis",
        [oh.make_node("Concat", ["x", "x"], ["y"], name="c", axis=2)],
        [2, 3],
        [],
        "c",
        "axis",
        "2",
    ),
    (
        "gather-axis",
        [oh.make_node("Gather", ["x", "ix"], ["y"], name="g", axis=-3)],
        [2, 3],
        [_axes("ix", [0])],
        "g",
        "axis",
        "-3",
    ),
    (
        "softmax-axis",
        [oh.make_node("Softmax", ["x"], ["y"], name="sm", axis=2)],
        [2, 3],
        [],
        "sm",
        "axis",
        "2",
    ),
    (
        "flatten-axis",
        [oh.make_node("Flatten", ["x"], ["y"], name="f", axis=3)],
        [2, 3],
        [],
        "f",
        "axis",
        "3",
    ),
    (
        "argmax-select-last",
        [oh.make_node("ArgMax", ["x"], ["y"], name="a", select_last_index=5)],
        [2, 3],
        [],
        "a",
        "select_last_index",
        "5",
    ),
    (
        "maxpool-strides-length",
        [oh.make_node("MaxPool", ["x"], ["y"], name="p", kernel_shape=[2, 2], strides=[1, 1, 1])],
        [1, 1, 4, 4],
        [],
        "p",
        "strides",
        "[1, 1, 1]",
    ),
    (
        "maxpool-pads-length",
        [oh.make_node("MaxPool", ["x"], ["y"], name="p", kernel_shape=[2, 2], pads=[0, 0])],
        [1, 1, 4, 4],
        [],
        "p",
        "pads",
        "[0, 0]",
    ),
    (
        "maxpool-kernel-of-rank",
        [oh.make_node("MaxPool", ["x"], ["y"], name="p", kernel_shape=[2, 2, 2])],
        [1, 1, 4, 4],
        [],
        "p",
        "kernel_shape",
        "[2, 2, 2]",
    ),
    (
        "maxpool-zero-stride",
        [oh.make_node("MaxPool", ["x"], ["y"], name="p", kernel_shape=[2, 2], strides=[0, 1])],
        [1, 1, 4, 4],
        [],
        "p",
        "strides",
        "[0, 1]",
    ),
]


@pytest.mark.parametrize(
    ("nodes", "shape", "inits", "node", "attr", "value"),
    [case[1:] for case in REFUSED],
    ids=[case[0] for case in REFUSED],
)
def test_a_bad_attribute_value_is_refused_with_one_line(
    nodes: list[onnx.NodeProto],
    shape: list[int],
    inits: list[onnx.TensorProto],
    node: str,
    attr: str,
    value: str,
    tmp_path: Path,
) -> None:
    src, dst = tmp_path / "m.onnx", tmp_path / "out.onnx"
    onnx.save(_model(nodes, shape, inits), src)
    before = src.read_bytes()
    code, err = _run_cli("optimize", str(src), "-o", str(dst))
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert f"node '{node}'" in lines[0] and f"attribute '{attr}' is {value}" in lines[0], err
    assert not dst.exists() and src.read_bytes() == before


def test_a_bad_perm_in_an_if_branch_or_a_function_is_refused(tmp_path: Path) -> None:
    branch = oh.make_graph(
        [oh.make_node("Transpose", ["x"], ["b"], name="inner", perm=[1, 1])],
        "then",
        [],
        [oh.make_tensor_value_info("b", T.FLOAT, None)],
    )
    other = oh.make_graph(
        [oh.make_node("Identity", ["x"], ["e"], name="id")],
        "else",
        [],
        [oh.make_tensor_value_info("e", T.FLOAT, None)],
    )
    cond = onh.from_array(np.array(True), "cond")
    nodes = [oh.make_node("If", ["cond"], ["y"], name="if", then_branch=branch, else_branch=other)]
    src = tmp_path / "if.onnx"
    onnx.save(_model(nodes, [2, 2], [cond]), src)
    code, err = _run_cli("optimize", str(src), "-o", str(tmp_path / "out.onnx"))
    assert code == 2 and "subgraph 'then_branch' of node 'if'" in err and "[1, 1]" in err, err

    fn = oh.make_function(
        "local",
        "Swap",
        ["a"],
        ["b"],
        [oh.make_node("Transpose", ["a"], ["b"], name="fn_t", perm=[0, 0])],
        [oh.make_opsetid("", 17)],
    )
    src = tmp_path / "fn.onnx"
    onnx.save(
        _model([oh.make_node("Swap", ["x"], ["y"], domain="local")], [2, 2], functions=[fn]), src
    )
    code, err = _run_cli("optimize", str(src), "-o", str(tmp_path / "out2.onnx"))
    assert code == 2 and "function 'local:Swap'" in err and "'perm' is [0, 0]" in err, err


@pytest.mark.parametrize(
    ("nodes", "shape", "inits"),
    [
        ([oh.make_node("Flatten", ["x"], ["y"], axis=2)], [2, 3], []),  # axis == rank
        ([oh.make_node("Softmax", ["x"], ["y"], axis=-2)], [2, 3], []),
        ([oh.make_node("Unsqueeze", ["x", "ax"], ["y"])], [2, 3], [_axes("ax", [-1, 0])]),
        ([oh.make_node("Squeeze", ["x", "ax"], ["y"])], [1, 3], [_axes("ax", [-2])]),
        ([oh.make_node("Transpose", ["x"], ["y"], perm=[2, 0, 1])], [2, 3, 4], []),
        ([oh.make_node("ReduceMean", ["x"], ["y"], axes=[0, -1], keepdims=0)], [2, 3, 4], []),
        ([oh.make_node("Transpose", ["x"], ["y"])], ["a", "b"], []),  # default perm
    ],
    ids=[
        "flatten-axis-rank",
        "negative-axis",
        "unsqueeze-output-range",
        "squeeze-one",
        "perm",
        "reduce",
        "symbolic",
    ],
)
def test_values_at_the_edges_of_the_rules_are_accepted(
    nodes: list[onnx.NodeProto], shape: list, inits: list[onnx.TensorProto], tmp_path: Path
) -> None:
    src = tmp_path / "m.onnx"
    onnx.save(_model(nodes, shape, inits), src)
    assert runs_in_onnxruntime(onnx.load(src))
    code, err = _run_cli("optimize", str(src), "-o", str(tmp_path / "out.onnx"), "--verify")
    assert code == 0, err


# ---------------------------------------------------------------- seeded attribute mutations


def _block(rng: random.Random) -> onnx.ModelProto:
    """A transformer-like block on ``x [B, S, D]``: a written-out layer norm, single-head
    attention (Transpose, MatMul, Softmax), a residual, and a Conv over the sequence."""
    d, s = rng.choice([4, 8]), rng.choice([3, 5])
    nrng = np.random.default_rng(rng.getrandbits(32))

    def w(name: str, *shape: int) -> onnx.TensorProto:
        return onh.from_array((nrng.standard_normal(shape) * 0.3).astype(np.float32), name)

    nodes = [
        oh.make_node("ReduceMean", ["x"], ["mu"], axes=[-1], keepdims=1),
        oh.make_node("Sub", ["x", "mu"], ["xc"]),
        oh.make_node("Mul", ["xc", "xc"], ["sq"]),
        oh.make_node("ReduceMean", ["sq"], ["var"], axes=[-1], keepdims=1),
        oh.make_node("Add", ["var", "eps"], ["ve"]),
        oh.make_node("Sqrt", ["ve"], ["sd"]),
        oh.make_node("Div", ["xc", "sd"], ["n"]),
        oh.make_node("MatMul", ["n", "wq"], ["q"]),
        oh.make_node("MatMul", ["n", "wk"], ["k"]),
        oh.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        oh.make_node("MatMul", ["q", "kt"], ["scores"]),
        oh.make_node("Softmax", ["scores"], ["probs"], axis=-1),
        oh.make_node("MatMul", ["probs", "n"], ["ctx"]),
        oh.make_node("Add", ["x", "ctx"], ["res"]),
        oh.make_node("Transpose", ["res"], ["chan"], perm=[0, 2, 1]),
        oh.make_node("Conv", ["chan", "wc"], ["conv"], kernel_shape=[1], pads=[0, 0]),
        oh.make_node("Transpose", ["conv"], ["back"], perm=[0, 2, 1]),
        oh.make_node("Unsqueeze", ["back", "ax1"], ["up"]),
        oh.make_node("Squeeze", ["up", "ax1"], ["down"]),
        oh.make_node("Concat", ["down", "x"], ["cat"], axis=-1),
        oh.make_node("ReduceSum", ["cat", "ax_last"], ["y"], keepdims=0),
    ]
    inits = [
        w("wq", d, d),
        w("wk", d, d),
        w("wc", d, d, 1),
        onh.from_array(np.array(1e-5, np.float32), "eps"),
        onh.from_array(np.array([1], np.int64), "ax1"),
        onh.from_array(np.array([-1], np.int64), "ax_last"),
    ]
    graph = oh.make_graph(
        nodes,
        "block",
        [oh.make_tensor_value_info("x", T.FLOAT, [2, s, d])],
        [oh.make_tensor_value_info("y", T.FLOAT, [2, s])],
        inits,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _mutated(index: int) -> tuple[onnx.ModelProto, str]:
    rng = random.Random(f"{SEED}:{index}")
    model = _block(rng)
    what = mutate_attribute_value(model, rng)
    if rng.random() < 0.3:  # a second change, as a probe changing several values would
        what += "; " + mutate_attribute_value(model, rng)
    return model, what


@pytest.mark.parametrize("index", range(CASES))
def test_attribute_mutations_are_optimized_or_refused(index: int, tmp_path: Path) -> None:
    """Valid (onnxruntime runs it): optimized, equal results. Invalid: refused with exit 2."""
    model, what = _mutated(index)
    src, dst = tmp_path / "m.onnx", tmp_path / "out.onnx"
    onnx.save(model, src)
    valid = runs_in_onnxruntime(model)
    code, err = _run_cli("optimize", str(src), "-o", str(dst), "--verify")
    assert code == (0 if valid else 2), f"case {index} ({what}), valid={valid}: exit {code}: {err}"
    if code == 2:
        assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("index", range(CASES))
def test_passes_decline_values_they_cannot_use(index: int) -> None:
    """Past the load check (deserialized as it is): every pass of the ``compact`` preset
    declines what it cannot use instead of raising."""
    from graphtrim.graph.optimizer import optimize_model
    from graphtrim.modelio import deserialize

    model, what = _mutated(index)
    ir_model = deserialize(model)
    try:
        optimize_model(ir_model, preset="compact")
    except InvalidModelError:
        pass  # a refusal with a reason is fine; a crash is not
    except Exception as exc:
        pytest.fail(f"case {index} ({what}): {type(exc).__name__}: {exc}")
