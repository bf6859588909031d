"""Fuzz test of the CLI's promises, on seeded random models, paths and data files.

Each case is built from its own seeded generator (``GRAPHTRIM_FUZZ_SEED``, default below, and
the case number): a random valid small model (chains and DAGs of elementwise ops, MatMul, Gemm,
Conv with BatchNormalization, Reshape, Transpose, Identity, Cast round trips, ``x + 0`` and
``x * 1``, Constant, If; random initializers, sometimes in an external data file), often turned
into a near-valid one (a flipped byte, a truncated file, a bad attribute or Cast enum, a dangling
input, an external data location that leaves the folder or names no file, a data file shorter
than it claims, a NUL in a name, duplicate node or value names, a custom-domain op, a value of
an element type drawn from every ONNX type, an attribute value drawn against its input's rank
(out of range, an axis twice, one entry more or less), an unknown opset ...), written to a
random output path (new nested folders, spaces and non-ASCII names, the input itself, a name
whose ``.data`` file is the input's data file, a path under a file, an existing folder, a
read-only folder). A model changed by a value mutation is valid when onnxruntime runs it. The
command is ``optimize --verify``, ``quantize --variant int8-dynamic --no-tune`` (sometimes with
a random ``--data`` file) or ``verify A B``.

Whatever the case, the CLI must keep its contract:

- every file in the case folder before the run is byte-identical after it;
- the exit code is 0, 1 or 2, and 1 only for a verified difference (the models were run and
  their results differ, said on the output); ``optimize`` of a valid model never exits 1 (the
  optimizer must not change results) and, to a usable output path, exits 0;
- no traceback, on stderr or in the log;
- no file appears beside the output but the output and its ``.data`` file (no staging folder,
  no temporary file), and after a non-zero exit no output at all.

Most cases call the CLI's ``main`` in this process (fast); every ``SUBPROCESS_EVERY``-th runs
``python -m graphtrim.cli`` in a child process (the real exit code and stderr). A failure
names the seed and the case, and how to run that case alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import logging
import os
import random
import shutil
import stat
import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest

from tests.conftest import REPO
from tests.optimizer_core.fuzz_values import (
    add_typed_value,
    mutate_attribute_value,
    runs_in_onnxruntime,
)

SEED = int(os.environ.get("GRAPHTRIM_FUZZ_SEED", "20261202"))
CASES = int(os.environ.get("GRAPHTRIM_FUZZ_CASES", "200"))
SUBPROCESS_EVERY = 10
OPSET = 17
FLOAT = onnx.TensorProto.FLOAT
BATCHES: list[int | str] = [1, 2, 3, "N"]  # "N": a symbolic batch dim

pytestmark = pytest.mark.slow

COMMANDS = ["optimize"] * 13 + ["quantize"] * 4 + ["verify"] * 3
MUTATIONS = [
    *["none"] * 12,  # about a third of the models stay valid
    "flip_byte",
    "truncate",
    "empty_file",
    "not_onnx",
    "bad_attribute",
    "cast_bad_enum",
    "dangling_input",
    "data_escapes",
    "data_absolute",
    "data_missing",
    "data_short",
    "data_nul_in_location",
    "nul_in_name",
    "duplicate_node_names",
    "duplicate_outputs",
    "custom_domain",
    "typed_value",
    "attribute_value",
    "attribute_value",
    "unknown_opset",
    "input_is_folder",
    "input_missing",
    "input_symlink_loop",
    "random_op",
]
OUTPUTS = [
    *["plain"] * 6,  # most outputs are usable, so that most valid models are optimized
    "nested_new",
    "unicode",
    "same_as_input",
    "data_collides",
    "under_a_file",
    "existing_folder",
    "read_only",
    "symlink_loop",
    "symlink_to_input",
    "hard_link_to_input",
]
DATA = ["none", "none", "valid", "wrong_key", "wrong_shape", "not_npz", "missing"]
# extra arguments of ``optimize``: the first ones fine, the others to refuse
FLAGS: list[list[str]] = [
    [],
    [],
    [],
    ["--trials", "1"],
    ["--atol", "1e-4", "--rtol", "1e-3"],
    ["--trials", "0"],
    ["--atol", "-1"],
    ["--rtol", "nan"],
    ["--preset", "no-such-preset"],
    ["--passes", "no_such_pass"],
]
GOOD_FLAGS = 5
# the mutation after which the model is still a valid one (no refusal is expected of it;
# onnxruntime refuses duplicate node names, which the ONNX checker lets pass)
STILL_VALID = {"none", "random_op"}
# mutations after which the model is valid when onnxruntime runs it (fuzz_values)
VALID_IF_IT_RUNS = {"typed_value", "attribute_value"}
# output paths a command must refuse or cannot write (root writes into a read-only folder)
BAD_OUTPUTS = {
    "same_as_input",
    "data_collides",
    "under_a_file",
    "existing_folder",
    "symlink_loop",
    "symlink_to_input",
    "hard_link_to_input",
} | ({"read_only"} if os.geteuid() != 0 else set())


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a case is, drawn before anything is built (the test id says it)."""

    index: int
    command: str
    mutation: str
    output: str
    data: str
    external: bool
    conv: bool
    flags: int  # index in FLAGS (optimize only)

    @property
    def id(self) -> str:
        parts = [f"case{self.index:03d}", self.command, self.mutation, self.output]
        if self.command == "quantize" and self.data != "none":
            parts.append(f"data-{self.data}")
        if self.command == "optimize" and FLAGS[self.flags]:
            parts.append("".join(FLAGS[self.flags]).lstrip("-"))
        return "-".join(parts)


def _rng(index: int) -> random.Random:
    return random.Random(f"{SEED}:{index}")


def plan(index: int, rng: random.Random | None = None) -> Plan:
    """Case ``index``'s plan: the first draws of its generator (``rng``, else a new one)."""
    rng = rng or _rng(index)
    command = rng.choice(COMMANDS)
    mutation = rng.choice(MUTATIONS)
    output = rng.choice(OUTPUTS) if command != "verify" else "plain"
    data = rng.choice(DATA) if command == "quantize" else "none"
    external = rng.random() < 0.35 or mutation.startswith("data_") or output == "data_collides"
    conv = rng.random() < 0.3
    flags = 0
    if command == "optimize":  # a quarter of them with arguments to refuse
        good = rng.random() >= 0.25
        flags = rng.randrange(GOOD_FLAGS) if good else rng.randrange(GOOD_FLAGS, len(FLAGS))
    return Plan(index, command, mutation, output, data, external, conv, flags)


PLANS = [plan(i) for i in range(CASES)]

# ------------------------------------------------------------------------------ valid models


class _Builder:
    """Nodes and initializers of one graph, with fresh names."""

    def __init__(self, rng: random.Random, nrng: np.random.Generator):
        self.rng, self.nrng = rng, nrng
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0

    def name(self, stem: str) -> str:
        self.count += 1
        return f"{stem}_{self.count}"

    def const(self, array: np.ndarray, stem: str = "w") -> str:
        name = self.name(stem)
        self.inits.append(onh.from_array(array.astype(np.float32), name))
        return name

    def node(self, op: str, inputs: list[str], n_out: int = 1, **attrs: Any) -> list[str]:
        outs = [self.name(op.lower()) for _ in range(n_out)]
        self.nodes.append(oh.make_node(op, inputs, outs, name=self.name(f"n_{op}"), **attrs))
        return outs

    def weights(self, *shape: int, scale: float = 1.0) -> np.ndarray:
        return (self.nrng.standard_normal(shape) * scale).astype(np.float32)


# ops after which a value is bit-identical in the optimized model too (no rounding a pass may
# change): only such values go through a lossy Cast, whose rounding is discontinuous (one float32
# ulp of difference, from folding or reassociating, can become a float16 ulp)
EXACT = {
    "identity",
    "cast_exact",
    "cast_lossy",
    "transpose_pair",
    "reshape",
    "add_zero",
    "mul_one",
    "concat",
    "slice",
    "gather",
    "unsqueeze_squeeze",
}


def _dense_chain(
    b: _Builder, x: str, width: int, batch: int | str, exact: bool
) -> tuple[str, int, list[str]]:
    """A random chain / DAG over values of shape [batch, width] from ``x`` (``exact``: computed
    without rounding); returns the last value, its width and every value of the current width
    (for a second output)."""
    rng = b.rng
    same: list[str] = [x]  # values of the current width
    cur = x
    for _ in range(rng.randint(1, 7)):
        op = rng.choice(
            [
                "unary",
                "add_const",
                "mul_const",
                "add_zero",
                "mul_one",
                "matmul",
                "gemm",
                "identity",
                "cast_exact",
                "cast_lossy",
                "transpose_pair",
                "reshape",
                "constant",
                "binary2",
                "if",
                "dead",
                "softmax",
                "concat",
                "slice",
                "split",
                "gather",
                "unsqueeze_squeeze",
            ]
        )
        if op == "unary":
            cur = b.node(rng.choice(["Relu", "Sigmoid", "Tanh", "Abs", "Neg"]), [cur])[0]
        elif op == "add_const":
            cur = b.node("Add", [cur, b.const(b.weights(width))])[0]
        elif op == "mul_const":
            cur = b.node("Mul", [cur, b.const(b.weights(width, scale=0.5))])[0]
        elif op == "add_zero":
            cur = b.node("Add", [cur, b.const(np.zeros(rng.choice([1, width])), "zero")])[0]
        elif op == "mul_one":
            cur = b.node("Mul", [cur, b.const(np.ones(rng.choice([1, width])), "one")])[0]
        elif op in ("matmul", "gemm"):
            new = rng.choice([2, 3, 4, 8, 16, 64])
            w = b.weights(width, new, scale=1 / np.sqrt(width))
            if op == "matmul":
                cur = b.node("MatMul", [cur, b.const(w)])[0]
            else:
                bias = b.const(b.weights(new, scale=0.1), "bias")
                cur = b.node("Gemm", [cur, b.const(w.T.copy()), bias], transB=1)[0]
            width, same = new, []
        elif op == "identity":
            cur = b.node("Identity", [cur])[0]
        elif op == "cast_exact":
            wide = b.node("Cast", [cur], to=onnx.TensorProto.DOUBLE)[0]
            cur = b.node("Cast", [wide], to=FLOAT)[0]
        elif op == "cast_lossy" and exact:
            half = b.node("Cast", [cur], to=onnx.TensorProto.FLOAT16)[0]
            cur = b.node("Cast", [half], to=FLOAT)[0]
        elif op == "transpose_pair":
            t = b.node("Transpose", [cur], perm=[1, 0])[0]
            cur = b.node("Transpose", [t], perm=[1, 0])[0]
        elif op == "reshape":
            flat = b.node("Reshape", [cur, _int_const(b, [-1])])[0]
            cur = b.node("Reshape", [flat, _int_const(b, [-1, width])])[0]
        elif op == "constant":
            value = onh.from_array(b.weights(width), b.name("value"))
            c = b.node("Constant", [], value=value)[0]
            cur = b.node(rng.choice(["Add", "Sub", "Mul"]), [cur, c])[0]
        elif op == "binary2" and same:
            other = rng.choice(same)
            cur = b.node(rng.choice(["Add", "Sub", "Mul", "Max"]), [cur, other])[0]
        elif op == "if":
            cur = _if(b, cur, width, batch)
        elif op == "softmax":
            cur = b.node("Softmax", [cur], axis=-1)[0]
        elif op == "concat":
            cur = b.node("Concat", [cur, rng.choice(same) if same else cur], axis=1)[0]
            width, same = 2 * width, []
        elif op == "slice" and width >= 2:
            half = width // 2
            starts, ends, axes = (_int_const(b, [v]) for v in (0, half, 1))
            cur = b.node("Slice", [cur, starts, ends, axes])[0]
            width, same = half, []
        elif op == "split" and width % 2 == 0:
            left, right = b.node("Split", [cur, _int_const(b, [width // 2] * 2)], 2, axis=1)
            cur = b.node(rng.choice(["Add", "Max"]), [left, right])[0]
            width, same = width // 2, []
        elif op == "gather":
            picks = [rng.randrange(width) for _ in range(rng.randint(1, width))]
            cur = b.node("Gather", [cur, _int_const(b, picks)], axis=1)[0]
            width, same = len(picks), []
        elif op == "unsqueeze_squeeze":
            axes = _int_const(b, [1])
            cur = b.node("Squeeze", [b.node("Unsqueeze", [cur, axes])[0], axes])[0]
        elif op == "dead":
            b.node("Relu", [b.node("Add", [cur, b.const(b.weights(width))])[0]])
        exact = exact and op in EXACT
        same.append(cur)
    return cur, width, same


def _int_const(b: _Builder, values: list[int]) -> str:
    name = b.name("shape")
    b.inits.append(onh.from_array(np.array(values, dtype=np.int64), name))
    return name


def _if(b: _Builder, cur: str, width: int, batch: int | str) -> str:
    """``If(sum(X) > 0)``: one branch ``Relu(cur)``, the other ``Neg(cur)`` (outer scope). The
    condition is of the graph input: both models compute it exactly (a branch chosen by a value
    that a pass may round would differ by far more than a rounding)."""
    total = b.node("ReduceSum", ["X"], keepdims=0)[0]
    zero = b.name("zero")
    b.inits.append(onh.from_array(np.array(0.0, dtype=np.float32), zero))
    cond = b.node("Greater", [total, zero])[0]
    branches = []
    for op in ("Relu", "Neg"):
        out = b.name(f"branch_{op.lower()}")
        branches.append(
            oh.make_graph(
                [oh.make_node(op, [cur], [out], name=b.name(f"n_branch_{op}"))],
                b.name("branch"),
                [],
                [oh.make_tensor_value_info(out, FLOAT, [batch, width])],
            )
        )
    return b.node("If", [cond], then_branch=branches[0], else_branch=branches[1])[0]


def _conv_stem(b: _Builder, x: str, channels: int, size: int) -> tuple[str, int]:
    """Conv (+ BatchNormalization, activation) once or twice, then Flatten."""
    rng = b.rng
    cur = x
    for _ in range(rng.randint(1, 2)):
        out_c = rng.choice([2, 4, 8])
        k = rng.choice([1, 3])
        w = b.weights(out_c, channels, k, k, scale=1 / np.sqrt(channels * k * k))
        inputs = [cur, b.const(w)]
        if rng.random() < 0.5:
            inputs.append(b.const(b.weights(out_c, scale=0.1), "bias"))
        cur = b.node("Conv", inputs, pads=[k // 2] * 4, kernel_shape=[k, k])[0]
        if rng.random() < 0.7:
            scale, bias = b.weights(out_c, scale=0.5) + 1, b.weights(out_c, scale=0.1)
            mean, var = b.weights(out_c, scale=0.1), np.abs(b.weights(out_c)) + 0.5
            cur = b.node(
                "BatchNormalization",
                [cur, *(b.const(a, "bn") for a in (scale, bias, mean, var))],
                epsilon=1e-5,
            )[0]
        if rng.random() < 0.7:
            cur = b.node(rng.choice(["Relu", "Sigmoid", "Tanh"]), [cur])[0]
        channels = out_c
    if rng.random() < 0.3:
        cur = b.node("MaxPool", [cur], kernel_shape=[2, 2], pads=[0, 0, 1, 1])[0]
    if rng.random() < 0.3:
        return b.node("Flatten", [b.node("GlobalAveragePool", [cur])[0]], axis=1)[0], channels
    return b.node("Flatten", [cur], axis=1)[0], channels * size * size


def valid_model(p: Plan, rng: random.Random) -> onnx.ModelProto:
    """A random valid model (checked by the full ONNX checker)."""
    b = _Builder(rng, np.random.default_rng(rng.getrandbits(32)))
    batch = rng.choice(BATCHES)
    if p.conv:
        channels, size = rng.choice([1, 3]), rng.choice([4, 6])
        x_shape: list[int | str] = [batch, channels, size, size]
        flat, width = _conv_stem(b, "X", channels, size)
        last, width, same = _dense_chain(b, flat, width, batch, exact=False)
    else:
        width = rng.choice([2, 3, 4, 8])
        x_shape = [batch, width]
        last, width, same = _dense_chain(b, "X", width, batch, exact=True)
    if p.external and not any(t.dims and np.prod(t.dims) >= 64 for t in b.inits):
        # something to put in the data file
        big = rng.choice([64, 96])
        last = b.node("MatMul", [last, b.const(b.weights(width, big, scale=1 / np.sqrt(width)))])[0]
        width, same = big, [last]
    last = b.node("Identity", [last])[0]  # the graph output is never the input itself
    outputs = [oh.make_tensor_value_info(last, FLOAT, [batch, width])]
    extra = [v for v in same if v not in (last, "X")]
    if extra and rng.random() < 0.3:
        second = b.node("Identity", [rng.choice(extra)])[0]
        outputs.append(oh.make_tensor_value_info(second, FLOAT, [batch, width]))
    graph = oh.make_graph(
        b.nodes,
        "fuzz",
        [oh.make_tensor_value_info("X", FLOAT, x_shape)],
        outputs,
        initializer=b.inits,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


# ------------------------------------------------------------------------- near-valid models


def mutate_proto(model: onnx.ModelProto, mutation: str, rng: random.Random) -> onnx.ModelProto:
    """The mutations made on the model before it is saved."""
    g = model.graph
    nodes = list(g.node)
    if mutation == "bad_attribute":
        node = rng.choice(nodes)
        choice = rng.choice(["unknown", "wrong_type", "perm"])
        if choice == "perm" and any(n.op_type == "Transpose" for n in nodes):
            node = next(n for n in nodes if n.op_type == "Transpose")
            del node.attribute[:]
            node.attribute.append(oh.make_attribute("perm", [0, 0]))
        elif choice == "wrong_type":
            node.attribute.append(oh.make_attribute("axis", "not a number"))
        else:
            node.attribute.append(oh.make_attribute("no_such_attribute", 3))
    elif mutation == "cast_bad_enum":
        cast = next((n for n in nodes if n.op_type == "Cast"), None)
        if cast is None:
            cast = oh.make_node("Cast", [g.output[0].name], ["cast_bad"], name="cast_bad", to=1)
            g.node.append(cast)
            g.output[0].name = "cast_bad"
        del cast.attribute[:]
        cast.attribute.append(oh.make_attribute("to", rng.choice([999, -3, 0, 8])))
    elif mutation == "dangling_input":
        node = rng.choice([n for n in nodes if n.input])
        node.input[0] = "no_such_value"
    elif mutation == "nul_in_name":
        where = rng.choice(["node", "value", "initializer"])
        if where == "node":
            rng.choice(nodes).name = "bad\x00name"
        elif where == "initializer" and len(g.initializer):
            init = g.initializer[0]
            old = init.name
            init.name = "w\x00eight"
            for n in g.node:
                for i, name in enumerate(n.input):
                    if name == old:
                        n.input[i] = init.name
        else:
            node = nodes[0]
            old = node.output[0]
            node.output[0] = "val\x00ue"
            for n in nodes[1:]:
                for i, name in enumerate(n.input):
                    if name == old:
                        n.input[i] = "val\x00ue"
            for out in g.output:
                if out.name == old:
                    out.name = "val\x00ue"
    elif mutation == "duplicate_node_names":
        for n in g.node:
            n.name = "same"
    elif mutation == "duplicate_outputs":
        if len(nodes) >= 2:
            nodes[1].output[0] = nodes[0].output[0]
        else:
            g.node.append(oh.make_node("Identity", ["X"], [nodes[0].output[0]], name="dup"))
    elif mutation == "custom_domain":
        out = g.output[0].name
        g.node.append(oh.make_node("Frobnicate", [out], ["custom_out"], domain="com.example"))
        g.output[0].name = "custom_out"
        model.opset_import.append(oh.make_opsetid("com.example", 1))
    elif mutation == "typed_value":
        add_typed_value(model, rng)
    elif mutation == "attribute_value":
        mutate_attribute_value(model, rng)
    elif mutation == "random_op":  # a second output drawn at random: compared by shape only
        g.node.append(oh.make_node("RandomNormalLike", [g.output[0].name], ["noise"], name="rnd"))
        noise = g.output.add()
        noise.CopyFrom(g.output[0])
        noise.name = "noise"
    elif mutation == "unknown_opset":
        model.opset_import[0].version = rng.choice([99, 1000])
    if mutation in STILL_VALID:
        onnx.checker.check_model(model, full_check=True)
    return model


def _save(model: onnx.ModelProto, path: Path, p: Plan, location: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if p.external:
        onnx.save_model(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=location,
            size_threshold=256,
        )
    else:
        path.write_bytes(model.SerializeToString())


def _set_location(model_path: Path, location: str) -> None:
    """Point every external tensor of the saved model at ``location`` (no check)."""
    proto = onnx.load(str(model_path), load_external_data=False)
    for t in proto.graph.initializer:
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = location
    model_path.write_bytes(proto.SerializeToString())


def mutate_files(model_path: Path, data_path: Path | None, p: Plan, rng: random.Random) -> Path:
    """The mutations made on the saved files; returns the input path to give the command."""
    m = p.mutation
    if m == "flip_byte":
        flipped = bytearray(model_path.read_bytes())
        flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        model_path.write_bytes(bytes(flipped))
    elif m == "truncate":
        raw = model_path.read_bytes()
        model_path.write_bytes(raw[: rng.randrange(1, len(raw))])
    elif m == "empty_file":
        model_path.write_bytes(b"")
    elif m == "not_onnx":
        model_path.write_text("this is not an ONNX model\n")
    elif m == "data_escapes" and data_path is not None:
        outside = model_path.parent.parent / "outside.bin"
        shutil.copy(data_path, outside)
        _set_location(model_path, "../outside.bin")
    elif m == "data_absolute" and data_path is not None:
        _set_location(model_path, str(data_path.resolve()))
    elif m == "data_missing" and data_path is not None:
        _set_location(model_path, "no-such-file.bin")
    elif m == "data_nul_in_location" and data_path is not None:
        _set_location(model_path, data_path.name + "\x00.txt")
    elif m == "data_short" and data_path is not None:
        raw = data_path.read_bytes()
        data_path.write_bytes(raw[: rng.randrange(0, max(1, len(raw) - 1))])
    elif m == "input_is_folder":
        folder = model_path.with_name("folder.onnx")
        folder.mkdir()
        return folder
    elif m == "input_missing":
        return model_path.with_name("missing.onnx")
    elif m == "input_symlink_loop":
        loop = model_path.with_name("loop.onnx")
        loop.symlink_to(loop.name)
        return loop
    return model_path


# --------------------------------------------------------------------- outputs and data files


def output_path(case: Path, model_path: Path, p: Plan, rng: random.Random) -> Path:
    kind = p.output
    if kind == "nested_new":
        return case / "out" / "new" / rng.choice(["a b", "ü", "deep/er"]) / "model.onnx"
    if kind == "unicode":
        return case / "out" / rng.choice(["módel ✓.onnx", "with space.onnx", "日本.onnx"])
    if kind == "same_as_input":
        return model_path
    if kind == "data_collides":
        return model_path.parent / "opt.onnx"  # the input's data file is opt.onnx.data
    if kind == "under_a_file":
        return model_path / "out.onnx"
    if kind == "existing_folder":
        folder = case / "out" / "taken.onnx"
        folder.mkdir(parents=True)
        return folder
    if kind == "read_only":
        folder = case / "locked"
        folder.mkdir()
        folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
        return folder / "model.onnx"
    if kind == "symlink_loop":
        (case / "loop").symlink_to("loop")
        return case / "loop" / "model.onnx"
    if kind in ("symlink_to_input", "hard_link_to_input"):
        out = case / "out" / "model.onnx"
        out.parent.mkdir(parents=True, exist_ok=True)
        if model_path.is_file():
            if kind == "symlink_to_input":
                out.symlink_to(model_path)
            else:
                os.link(model_path, out)
        return out
    return case / "out" / "model.onnx"


def data_file(case: Path, model: onnx.ModelProto, p: Plan, rng: random.Random) -> Path | None:
    """A ``--data`` file for ``quantize``: fitting the model's input, or not."""
    if p.data == "none":
        return None
    path = case / "data" / rng.choice(["eval.npz", "eval data ü.npz"])
    path.parent.mkdir(parents=True, exist_ok=True)
    if p.data == "missing":
        return path
    if p.data == "not_npz":
        path.write_bytes(bytes(rng.getrandbits(8) for _ in range(64)))
        return path
    x = model.graph.input[0]
    dims = [d.dim_value if d.HasField("dim_value") else 2 for d in x.type.tensor_type.shape.dim]
    samples = dims[0] * 2
    arrays = {"X": np.random.default_rng(p.index).standard_normal([samples, *dims[1:]])}
    if p.data == "wrong_key":
        arrays = {"Y": arrays["X"]}
    elif p.data == "wrong_shape":
        arrays = {"X": arrays["X"][..., :-1] if dims[-1] > 1 else arrays["X"][..., None]}
    np.savez(path, allow_pickle=False, **{k: v.astype(np.float32) for k, v in arrays.items()})
    return path


# ----------------------------------------------------------------------------------- the case


@dataclasses.dataclass
class Case:
    plan: Plan
    folder: Path
    args: list[str]
    output: Path | None
    valid: bool  # the input is a valid model and the output path a usable one
    expect: int = 0  # the exit code of a valid case


def build(p: Plan, root: Path) -> Case:
    rng = _rng(p.index)
    plan(p.index, rng)  # the plan's draws first: what follows is drawn after them
    case = root / f"case {p.index:03d}"
    model = valid_model(p, rng)
    model = mutate_proto(model, p.mutation, rng)
    still_valid = p.mutation in STILL_VALID or (
        p.mutation in VALID_IF_IT_RUNS and runs_in_onnxruntime(model)
    )
    folder = case / rng.choice(["in", "in put", "ïn"])
    model_path = folder / rng.choice(["model.onnx", "m o d e l.onnx", "模型.onnx"])
    location = (
        "opt.onnx.data"
        if p.output == "data_collides"
        else rng.choice(["model.onnx.data", "weights.bin", "sub dir/w ü.bin"])
    )
    if p.external:
        (folder / location).parent.mkdir(parents=True, exist_ok=True)
    _save(model, model_path, p, location)
    data_path = folder / location if p.external else None
    src = mutate_files(model_path, data_path, p, rng)
    if p.command == "verify":
        other = folder / "candidate.onnx"
        kind = rng.choice(["same", "changed", "itself"])
        if kind == "itself":
            other = src
        elif src.is_file():
            shutil.copy(src, other)
            if kind == "changed" and still_valid:  # its first output + 1
                proto = onnx.load(str(other), load_external_data=False)
                g = proto.graph
                name = g.output[0].name  # kept: only the values differ
                for n in g.node:
                    n.input[:] = ["unchanged" if i == name else i for i in n.input]
                    n.output[:] = ["unchanged" if o == name else o for o in n.output]
                g.initializer.append(onh.from_array(np.array(1.0, np.float32), "plus_one"))
                g.node.append(oh.make_node("Add", ["unchanged", "plus_one"], [name]))
                other.write_bytes(proto.SerializeToString())
        if not still_valid:
            return Case(p, case, ["verify", str(src), str(other)], None, valid=False)
        # a valid model: equal to itself or its copy (exit 0), a verified difference from
        # the changed copy (exit 1)
        expect = 1 if kind == "changed" else 0
        return Case(p, case, ["verify", str(src), str(other)], None, True, expect)
    out = output_path(case, model_path, p, rng)
    valid = still_valid and p.output not in BAD_OUTPUTS
    if p.command == "optimize":
        args = ["optimize", str(src), "-o", str(out), "--verify", *FLAGS[p.flags]]
        valid = valid and p.flags < GOOD_FLAGS
    else:
        args = ["quantize", str(src), "-o", str(out), "--variant", "int8-dynamic", "--no-tune"]
        data = data_file(case, model, p, rng)
        if data is not None:
            args += ["--data", str(data)]
            valid = False  # the accuracy gate may refuse a variant of a random model
    return Case(p, case, args, out, valid)


def snapshot(folder: Path) -> dict[Path, str]:
    """sha256 of every file under ``folder``."""
    return {
        f: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.rglob("*"))
        if f.is_file() and not f.is_symlink()
    }


def run_in_process(args: list[str]) -> tuple[int, str]:
    """``graphtrim ARGS`` through the CLI's ``main`` here: its exit code and what it printed
    (stdout, stderr and the log together); an exception that escapes ``main`` is a traceback."""
    from graphtrim.cli import main

    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setLevel(logging.WARNING)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            try:
                code = main(args)
            except SystemExit as exc:  # argparse refusing the arguments
                code = exc.code if isinstance(exc.code, int) else 2
            except BaseException:  # what a process would print and die of
                buf.write(traceback.format_exc())
                code = 99
    finally:
        root.removeHandler(handler)
    return code, buf.getvalue()


def run_subprocess(args: list[str], cwd: Path) -> tuple[int, str]:
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "graphtrim.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=900,  # only against a hang
    )
    return proc.returncode, proc.stdout + proc.stderr


def check(case: Case, before: dict[Path, str], code: int, printed: str) -> list[str]:
    """The contract's promises that this run broke (empty: none)."""
    broken: list[str] = []
    after = snapshot(case.folder)
    changed = [str(f) for f, h in before.items() if after.get(f) != h]
    if changed:
        broken.append(f"input files changed or gone: {changed}")
    if code not in (0, 1, 2):
        broken.append(f"exit code {code}")
    if "Traceback" in printed:
        broken.append("a traceback was printed")
    if code == 1:
        if "MISMATCH" not in printed:
            broken.append("exit 1 without a verified difference")
        elif case.valid and case.plan.command == "optimize":  # (the others say what they expect)
            broken.append("optimize --verify changed the results of a valid model")
    if case.valid and code != case.expect:
        broken.append(f"a valid case exited {code}, not {case.expect}")
    out = case.output
    allowed = {out, out.with_name(out.name + ".data")} if out is not None and code == 0 else set()
    new = sorted(str(f) for f in set(after) - set(before) if f not in allowed)
    if new:
        broken.append(f"files left beside the output: {new}")
    if out is not None and code == 0:
        if case.plan.output in BAD_OUTPUTS:
            broken.append(f"exit 0 for an output path to refuse ({case.plan.output})")
        elif not out.is_file():
            broken.append("exit 0 but no output")
    return broken


@contextlib.contextmanager
def _writable(folder: Path) -> Iterator[None]:
    try:
        yield
    finally:  # a read-only folder in the case would stop pytest cleaning up
        for f in folder.rglob("*"):
            if f.is_dir() and not f.is_symlink():
                f.chmod(f.stat().st_mode | stat.S_IWUSR)


@pytest.mark.parametrize("p", PLANS, ids=[p.id for p in PLANS])
def test_cli_keeps_its_contract(p: Plan, tmp_path: Path) -> None:
    case = build(p, tmp_path)
    with _writable(case.folder):
        before = snapshot(case.folder)
        if p.index % SUBPROCESS_EVERY == 0:
            how = "subprocess"
            code, printed = run_subprocess(case.args, case.folder)
        else:
            how = "in process"
            code, printed = run_in_process(case.args)
        broken = check(case, before, code, printed)
    assert not broken, (
        f"seed {SEED}, {p.id} ({how}): graphtrim {' '.join(repr(a) for a in case.args)}\n"
        f"exit {code}; broken: {broken}\n{printed[-3000:]}\n"
        f"rerun: GRAPHTRIM_FUZZ_SEED={SEED} pytest '{__file__}::test_cli_keeps_its_contract[{p.id}]'"
    )
