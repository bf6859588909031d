"""Refusals at load time, ``graphtrim quantize`` on models onnxruntime cannot load, staging
folders left by killed runs, and the agreement every variant build measures.

Every refusal exits 2 with one line on stderr (no traceback), writes no output and leaves the
input as it was.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest

from graphtrim.cli import main
from graphtrim.errors import InvalidModelError
from graphtrim.modelio import load_model
from tests.optimizer_core.test_modelio_and_cli import one_line_error, snapshot

REPO = Path(__file__).resolve().parents[2]
FLOAT, DOUBLE = onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE


def _model(
    nodes: list[onnx.NodeProto],
    *,
    inputs: list[onnx.ValueInfoProto] | None = None,
    outputs: list[onnx.ValueInfoProto] | None = None,
    initializers: list[onnx.TensorProto] | None = None,
    opsets: dict[str, int] | None = None,
) -> onnx.ModelProto:
    graph = oh.make_graph(
        nodes,
        "g",
        inputs if inputs is not None else [oh.make_tensor_value_info("x", FLOAT, ["N", 3])],
        outputs if outputs is not None else [oh.make_tensor_value_info("y", FLOAT, ["N", 3])],
        initializers or [],
    )
    imports = [oh.make_opsetid(d, v) for d, v in (opsets or {"": 17}).items()]
    return oh.make_model(graph, opset_imports=imports, ir_version=10)


def _save(proto: onnx.ModelProto, path: Path) -> Path:
    # raw bytes: onnx.save would not write some of the broken models below
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(proto.SerializeToString())
    return path


def _matmul(path: Path, *, hidden: int = 16) -> Path:
    """x[N, 3] -> MatMul(W[3, hidden]) -> Relu -> MatMul(V[hidden, 4]) -> y[N, 4]."""
    rng = np.random.default_rng(0)
    w = onh.from_array(rng.standard_normal((3, hidden)).astype(np.float32), "W")
    v = onh.from_array(rng.standard_normal((hidden, 4)).astype(np.float32), "V")
    proto = _model(
        [
            oh.make_node("MatMul", ["x", "W"], ["h"], name="mm0"),
            oh.make_node("Relu", ["h"], ["r"], name="relu"),
            oh.make_node("MatMul", ["r", "V"], ["y"], name="mm1"),
        ],
        outputs=[oh.make_tensor_value_info("y", FLOAT, ["N", 4])],
        initializers=[w, v],
    )
    return _save(proto, path)


# ---- external data location with a NUL byte ------------------------------------------------


def _nul_location(tmp_path: Path) -> Path:
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "w.bin").write_bytes(np.ones((3, 3), np.float32).tobytes())
    w = onh.from_array(np.ones((3, 3), np.float32), "W")
    w.ClearField("raw_data")
    w.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", "w.bin\x00.txt"), ("offset", "0"), ("length", "36")):
        entry = w.external_data.add()
        entry.key, entry.value = key, value
    return _save(
        _model([oh.make_node("MatMul", ["x", "W"], ["y"])], initializers=[w]), folder / "m.onnx"
    )


@pytest.mark.parametrize("command", ["optimize", "quantize"])
def test_nul_byte_in_external_data_location_is_one_line_exit_2(command, tmp_path, capsys):
    src = _nul_location(tmp_path)
    out = tmp_path / "out" / "o.onnx"
    before = snapshot(tmp_path)

    rc = main([command, str(src), "-o", str(out), "-q"])

    err = capsys.readouterr().err
    assert rc == 2, err
    line = one_line_error(err)
    assert "NUL byte" in line and str(src) in line and "'W'" in line
    assert not out.exists() and not (tmp_path / "out").exists()
    assert snapshot(tmp_path) == before


def test_nul_byte_location_is_an_invalid_model_error(tmp_path):
    with pytest.raises(InvalidModelError, match="NUL byte"):
        load_model(_nul_location(tmp_path))


@pytest.mark.parametrize("command", ["optimize", "quantize"])
def test_output_through_a_symlink_loop_is_one_line_exit_2(command, tmp_path, capsys):
    src = _matmul(tmp_path / "in" / "m.onnx")
    (tmp_path / "loop").symlink_to("loop")  # resolving it raises RuntimeError in pathlib
    before = snapshot(tmp_path)

    rc = main([command, str(src), "-o", str(tmp_path / "loop" / "o.onnx"), "-q"])

    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Symlink loop" in one_line_error(err)
    assert snapshot(tmp_path) == before


def test_external_data_through_a_symlink_loop_is_refused(tmp_path):
    src = _matmul(tmp_path / "m.onnx")
    proto = onnx.load(str(src))
    tensor = proto.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value="loop/w.bin")
    _save(proto, src)
    (tmp_path / "loop").symlink_to("loop")

    with pytest.raises(InvalidModelError, match="Symlink loop"):
        load_model(src)


# ---- element types that name no ONNX type ---------------------------------------------------


def _cast_chain(to: int) -> onnx.ModelProto:
    # a widening Cast feeding the broken one: exactly what the ``casts`` pass rewrites
    return _model(
        [
            oh.make_node("Cast", ["x"], ["d"], to=DOUBLE, name="widen"),
            oh.make_node("Cast", ["d"], ["y"], to=to, name="back"),
        ]
    )


def _odd_tensor(data_type: int, name: str = "") -> onnx.TensorProto:
    t = onnx.TensorProto()
    t.name = name
    t.data_type = data_type
    t.dims.append(3)
    t.raw_data = b"\0" * 12
    return t


def _in_subgraph() -> onnx.ModelProto:
    then = oh.make_graph(
        [oh.make_node("Cast", ["x"], ["t"], to=-1, name="inner_cast")],
        "then",
        [],
        [oh.make_tensor_value_info("t", FLOAT, ["N", 3])],
    )
    other = oh.make_graph(
        [oh.make_node("Identity", ["x"], ["e"])],
        "else",
        [],
        [oh.make_tensor_value_info("e", FLOAT, ["N", 3])],
    )
    return _model(
        [oh.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other, name="branch")],
        inputs=[
            oh.make_tensor_value_info("x", FLOAT, ["N", 3]),
            oh.make_tensor_value_info("c", onnx.TensorProto.BOOL, []),
        ],
    )


TYPE_CASES = {
    # Cast(to=-1) after a widening Cast: the casts pass crashed on it (exit 3)
    "cast-to-minus-1": (_cast_chain(-1), "attribute 'to' of Cast node 'back' is -1"),
    # to=0 (UNDEFINED) went through and was written out
    "cast-to-undefined": (_cast_chain(0), "attribute 'to' of Cast node 'back' is 0"),
    "cast-to-unknown-enum": (_cast_chain(99), "attribute 'to' of Cast node 'back' is 99"),
    "cast-in-subgraph": (
        _in_subgraph(),
        "attribute 'to' of Cast node 'inner_cast' (in subgraph 'then_branch' of node 'branch') is -1",
    ),
    "eyelike-dtype": (
        _model([oh.make_node("EyeLike", ["x"], ["y"], dtype=77, name="eye")]),
        "attribute 'dtype' of EyeLike node 'eye' is 77",
    ),
    "random-normal-like-dtype": (
        _model([oh.make_node("RandomNormalLike", ["x"], ["y"], dtype=-5, name="noise")]),
        "attribute 'dtype' of RandomNormalLike node 'noise' is -5",
    ),
    "constant-of-shape-value": (
        _model(
            [
                oh.make_node("Shape", ["x"], ["s"]),
                oh.make_node("ConstantOfShape", ["s"], ["y"], value=_odd_tensor(99), name="fill"),
            ]
        ),
        "attribute 'value' of ConstantOfShape node 'fill' has data type 99",
    ),
    "constant-value": (
        _model(
            [
                oh.make_node("Constant", [], ["k"], value=_odd_tensor(42), name="k"),
                oh.make_node("Add", ["x", "k"], ["y"]),
            ]
        ),
        "attribute 'value' of Constant node 'k' has data type 42",
    ),
    "initializer-data-type": (
        _model([oh.make_node("Add", ["x", "b"], ["y"])], initializers=[_odd_tensor(99, "b")]),
        "initializer 'b' has data type 99",
    ),
    "input-element-type": (
        _model(
            [oh.make_node("Relu", ["x"], ["y"])],
            inputs=[oh.make_tensor_value_info("x", 99, ["N", 3])],
        ),
        "value 'x' has element type 99",
    ),
    "quantize-output-dtype": (
        _model(
            [
                oh.make_node("QuantizeLinear", ["x", "s"], ["q"], output_dtype=55, name="q"),
                oh.make_node("DequantizeLinear", ["q", "s"], ["y"]),
            ],
            initializers=[onh.from_array(np.array(0.1, np.float32), "s")],
            opsets={"": 21},
        ),
        "attribute 'output_dtype' of QuantizeLinear node 'q' is 55",
    ),
}


@pytest.mark.parametrize("case", list(TYPE_CASES))
def test_invalid_element_type_is_refused_at_load(case, tmp_path, capsys):
    proto, expected = TYPE_CASES[case]
    src = _save(proto, tmp_path / "m.onnx")
    out = tmp_path / "o.onnx"
    before = snapshot(tmp_path)

    rc = main(["optimize", str(src), "-o", str(out), "-q"])

    err = capsys.readouterr().err
    assert rc == 2, err
    line = one_line_error(err)
    assert expected in line and "no ONNX element type" in line
    assert not out.exists()
    assert snapshot(tmp_path) == before
    with pytest.raises(InvalidModelError, match="no ONNX element type"):
        load_model(src)


def test_valid_type_attributes_still_load(tmp_path, capsys):
    """The check refuses only what names no type: 0 in QuantizeLinear's optional output_dtype
    (the op picks the type), every real element type in Cast, an If with valid subgraphs."""
    then = oh.make_graph(
        [oh.make_node("Cast", ["x"], ["t"], to=FLOAT)],
        "then",
        [],
        [oh.make_tensor_value_info("t", FLOAT, ["N", 3])],
    )
    proto = _model(
        [
            oh.make_node("QuantizeLinear", ["x", "s"], ["q"], output_dtype=0),
            oh.make_node("DequantizeLinear", ["q", "s"], ["dq"]),
            oh.make_node("Cast", ["dq"], ["d"], to=DOUBLE),
            oh.make_node("Cast", ["d"], ["f"], to=FLOAT),
            oh.make_node("If", ["c"], ["t"], then_branch=then, else_branch=then),
            oh.make_node("Add", ["f", "t"], ["y"]),
        ],
        inputs=[
            oh.make_tensor_value_info("x", FLOAT, ["N", 3]),
            oh.make_tensor_value_info("c", onnx.TensorProto.BOOL, []),
        ],
        initializers=[onh.from_array(np.array(0.1, np.float32), "s")],
        opsets={"": 21},
    )
    src = _save(proto, tmp_path / "ok.onnx")
    load_model(src)
    assert main(["optimize", str(src), "-o", str(tmp_path / "o.onnx"), "--verify", "-q"]) == 0
    assert capsys.readouterr().err == ""


def _simplified_norm(path: Path, op: str, *, external: bool = False) -> Path:
    """x[N, 8] -> Identity -> ``op``(x, w) in the default domain, at the top and in an If
    branch; with ``external`` the weight goes to a data file."""
    body = oh.make_graph(
        [oh.make_node(op, ["xi", "w"], ["t"], axis=-1, epsilon=1e-5)],
        "branch",
        [],
        [oh.make_tensor_value_info("t", FLOAT, ["N", 8])],
    )
    proto = _model(
        [
            oh.make_node("Identity", ["x"], ["xi"]),
            oh.make_node(op, ["xi", "w"], ["n"], axis=-1, epsilon=1e-5),
            oh.make_node("If", ["c"], ["t"], then_branch=body, else_branch=body),
            oh.make_node("Add", ["n", "t"], ["y"]),
        ],
        inputs=[
            oh.make_tensor_value_info("x", FLOAT, ["N", 8]),
            oh.make_tensor_value_info("c", onnx.TensorProto.BOOL, []),
        ],
        outputs=[oh.make_tensor_value_info("y", FLOAT, ["N", 8])],
        initializers=[onh.from_array(np.linspace(0.5, 1.5, 8, dtype=np.float32), "w")],
        opsets={"": 21},
    )
    if external:
        path.parent.mkdir(parents=True, exist_ok=True)
        onnx.save(proto, str(path), save_as_external_data=True, size_threshold=0)
        return path
    return _save(proto, path)


@pytest.mark.parametrize("external", [False, True], ids=["inline", "external-data"])
def test_default_domain_ops_onnxruntime_defines_load_and_optimize(external, tmp_path, capsys):
    """onnxruntime-genai's model builder writes ``SimplifiedLayerNormalization`` in the default
    domain: onnx has no such op, onnxruntime defines it. Such a model is read, optimized and
    verified, and the op is kept."""
    import onnxruntime as ort

    src = _simplified_norm(
        tmp_path / "in" / "m.onnx", "SimplifiedLayerNormalization", external=external
    )
    before = snapshot(src.parent)
    load_model(src)
    out = tmp_path / "o.onnx"
    assert main(["optimize", str(src), "-o", str(out), "--verify", "-q"]) == 0
    assert capsys.readouterr().err == ""
    assert snapshot(src.parent) == before
    kept = onnx.load(str(out))
    assert [n.op_type for n in kept.graph.node] == ["SimplifiedLayerNormalization", "If", "Add"]
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    feeds = {"x": x, "c": np.array(True)}
    want = ort.InferenceSession(str(src)).run(None, feeds)[0]
    got = ort.InferenceSession(str(out)).run(None, feeds)[0]
    rms = np.sqrt((x**2).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(want, 2 * x / rms * np.linspace(0.5, 1.5, 8), rtol=1e-5)
    np.testing.assert_array_equal(got, want)


def test_a_default_domain_op_nobody_defines_is_still_refused(tmp_path, capsys):
    src = _simplified_norm(tmp_path / "m.onnx", "NoSuchNormalization")
    assert main(["optimize", str(src), "-o", str(tmp_path / "o.onnx")]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "No Op registered for NoSuchNormalization" in line
    assert not (tmp_path / "o.onnx").exists()
    # beside an op onnxruntime defines, the error names the op nobody defines
    proto = onnx.load(str(src))
    proto.graph.node[1].op_type = "SimplifiedLayerNormalization"
    mixed = _save(proto, tmp_path / "mixed.onnx")
    assert main(["optimize", str(mixed), "-o", str(tmp_path / "o.onnx")]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "NoSuchNormalization" in line and "SimplifiedLayerNormalization" not in line


def test_type_attribute_taken_from_a_function_call_loads(tmp_path, capsys):
    """In a function body ``Cast(to=@to)`` refers to the caller's attribute: its own value
    (0) names no type and must not be refused."""
    ref = onnx.AttributeProto()
    ref.name, ref.ref_attr_name, ref.type = "to", "to", onnx.AttributeProto.INT
    cast = oh.make_node("Cast", ["a"], ["b"])
    cast.attribute.append(ref)
    fn = oh.make_function(
        "local", "CastTo", ["a"], ["b"], [cast], [oh.make_opsetid("", 17)], attributes=["to"]
    )
    proto = _model(
        [oh.make_node("CastTo", ["x"], ["y"], domain="local", to=FLOAT)],
        opsets={"": 17, "local": 1},
    )
    proto.functions.append(fn)
    src = _save(proto, tmp_path / "fn.onnx")
    load_model(src)
    assert main(["optimize", str(src), "-o", str(tmp_path / "o.onnx"), "--verify", "-q"]) == 0
    assert capsys.readouterr().err == ""


# ---- quantize (and variants) on a model onnxruntime cannot load -----------------------------


def _custom_domain(path: Path) -> Path:
    proto = _model(
        [oh.make_node("Mystery", ["x"], ["y"], domain="com.example", name="mystery")],
        opsets={"": 17, "com.example": 1},
    )
    return _save(proto, path)


def _op_without_kernel(path: Path) -> Path:
    # valid ONNX (the full checker passes); onnxruntime has no double kernel for Acos
    proto = _model(
        [oh.make_node("Acos", ["x"], ["y"], name="acos")],
        inputs=[oh.make_tensor_value_info("x", DOUBLE, ["N", 3])],
        outputs=[oh.make_tensor_value_info("y", DOUBLE, ["N", 3])],
    )
    onnx.checker.check_model(proto, full_check=True)
    return _save(proto, path)


UNLOADABLE = {"custom-domain": _custom_domain, "op-without-kernel": _op_without_kernel}


@pytest.mark.parametrize("variant", ["int8-dynamic", "graph", "fp16"])
@pytest.mark.parametrize("case", list(UNLOADABLE))
def test_quantize_refuses_a_model_onnxruntime_cannot_load(case, variant, tmp_path, capsys):
    src = UNLOADABLE[case](tmp_path / "in" / "m.onnx")
    out = tmp_path / "out" / "q.onnx"
    report = tmp_path / "r.json"
    before = snapshot(tmp_path)

    rc = main(
        ["quantize", str(src), "-o", str(out), "--variant", variant, "-q", "--report", str(report)]
    )

    captured = capsys.readouterr()
    assert rc == 2, captured.err
    line = one_line_error(captured.err)
    assert "onnxruntime" in line and "cannot load the model" in line and str(src) in line
    assert captured.out == ""
    assert not out.exists() and not report.exists() and not (tmp_path / "out").exists()
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("command", ["variants", "evaluate"])
def test_variant_commands_refuse_a_model_onnxruntime_cannot_load(command, tmp_path, capsys):
    src = _custom_domain(tmp_path / "in" / "m.onnx")
    out = tmp_path / "out"
    args = [str(src), str(src)] if command == "evaluate" else [str(src)]
    before = snapshot(tmp_path)

    rc = main([command, *args, "-o", str(out), "-q"])

    err = capsys.readouterr().err
    assert rc == 2, err
    assert "cannot load the model" in one_line_error(err)
    assert snapshot(tmp_path) == before


def test_build_variant_in_a_child_refuses_an_unloadable_source(tmp_path):
    """The pipeline builds each variant in a child process: the refusal comes back as the same
    error, one line, and the child writes nothing."""
    from graphtrim.isolation import map_isolated
    from graphtrim.quantize import QuantizeConfig

    src = _op_without_kernel(tmp_path / "m.onnx")
    (result,) = map_isolated(
        "graphtrim.stages.quantize:build_job",
        ["int8-dynamic"],
        common={
            "src": str(src),
            "dst_root": str(tmp_path / "variants"),
            "config": QuantizeConfig(),
            "calibration": None,
            "reference": None,
            "data": None,
            "policy": None,
            "device": "cpu",
            "tensorrt": False,
            "probe_timeout": 120.0,
        },
        timeout=300,
    )
    assert isinstance(result, InvalidModelError), repr(result)
    assert "cannot load the model" in str(result) and "\n" not in str(result)
    assert not (tmp_path / "variants").exists()


# ---- staging folders of killed runs ---------------------------------------------------------

# a child that builds a model and kills itself (SIGKILL: nothing of its own runs) at the moment
# the output is being checked or converted, with its staging folder full
_KILLED = """
import os, signal, sys
sys.path.insert(0, {repo!r})
from optimizer_core.{module} import {function}

def die(line):
    if {marker!r} in line:
        os.kill(os.getpid(), signal.SIGKILL)

{call}
"""


def _killed_run(tmp_path: Path, module: str, function: str, marker: str, call: str) -> None:
    code = _KILLED.format(
        repo=str(REPO), module=module, function=function, marker=marker, call=call
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]


def _hidden(folder: Path, name: str) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.startswith(f".{name}."))


def _age(paths: list[Path], seconds: float = 600) -> None:
    """Make ``paths`` look untouched for ``seconds`` (past the grace period of a staging
    folder whose process is gone)."""
    then = time.time() - seconds
    for p in paths:
        os.utime(p, (then, then))


def test_next_optimize_removes_the_staging_folder_of_a_killed_optimize(tmp_path, capsys):
    src = _matmul(tmp_path / "m.onnx")
    out = tmp_path / "out" / "o.onnx"
    call = f"optimize_file({str(src)!r}, {str(out)!r}, check=True, progress=die)"
    _killed_run(tmp_path, "optimize_file", "optimize_file", "verifying", call)
    left = _hidden(out.parent, out.name)
    assert len(left) == 1 and left[0].is_dir(), left
    assert any(p.stat().st_size > 0 for p in left[0].rglob("*") if p.is_file())
    _age(left)

    assert main(["optimize", str(src), "-o", str(out), "-q"]) == 0

    assert _hidden(out.parent, out.name) == []
    assert out.exists()


def test_next_quantize_removes_the_staging_folder_of_a_killed_quantize(tmp_path):
    src = _matmul(tmp_path / "m.onnx")
    out = tmp_path / "out" / "q.onnx"
    call = f"build_variant({str(src)!r}, {str(out)!r}, 'int8-dynamic', progress=die, probe=False)"
    _killed_run(tmp_path, "quantize", "build_variant", "attempt 1", call)
    left = _hidden(out.parent, out.name)
    assert len(left) == 1 and left[0].is_dir(), left
    _age(left)

    assert main(["quantize", str(src), "-o", str(out), "--no-tune", "-q"]) == 0

    assert _hidden(out.parent, out.name) == []
    assert out.exists()


def test_staging_folders_of_live_processes_and_other_outputs_stay(tmp_path):
    from graphtrim.modelio import remove_stale_staging, staging_dir

    src = _matmul(tmp_path / "m.onnx")
    out = tmp_path / "o.onnx"
    # a folder of a process that is alive (this one), another output's folder of a dead process
    mine = staging_dir(out)
    code = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); "
        "from graphtrim.modelio import staging_dir; "
        f"print(staging_dir({str(tmp_path / 'other.onnx')!r}))"
    )
    other = Path(subprocess.check_output([sys.executable, "-c", code], text=True).strip())
    dead_fresh = Path(
        subprocess.check_output(
            [sys.executable, "-c", code.replace("other.onnx", "o.onnx")], text=True
        ).strip()
    )
    for folder in (mine, other, dead_fresh):
        (folder / "o.onnx").write_bytes(b"partial")
    _age([mine, other])

    assert main(["optimize", str(src), "-o", str(out), "-q"]) == 0
    assert remove_stale_staging(tmp_path / "other.onnx.unrelated") == []

    assert mine.is_dir()  # this process is alive
    assert other.is_dir()  # another output's folder: not this run's to judge
    assert dead_fresh.is_dir()  # its process is gone, but it changed within the grace period
    _age([dead_fresh])
    assert remove_stale_staging(out) == [dead_fresh]
    assert not dead_fresh.exists() and mine.is_dir()
    assert remove_stale_staging(tmp_path / "other.onnx") == [other]


# ---- every variant build measures its agreement with the float model ------------------------


def test_quantize_without_data_prints_and_records_agreement(tmp_path, capsys):
    src = _matmul(tmp_path / "m.onnx")
    out = tmp_path / "q.onnx"
    report = tmp_path / "r.json"

    rc = main(
        [
            "quantize",
            str(src),
            "-o",
            str(out),
            "--variant",
            "int8-dynamic",
            "--no-tune",
            "-q",
            "--report",
            str(report),
        ]
    )

    captured = capsys.readouterr()
    assert rc == 0, captured.err
    line = next(ln for ln in captured.out.splitlines() if ln.startswith("agreement"))
    assert "cosine" in line and "seeded random inputs" in line
    agreement = json.loads(report.read_text())["agreement"]
    assert agreement["measured"] is True and agreement["feeds"] > 0
    assert "random" in agreement["inputs"]
    # int8 weights: close to the float model, not equal to it
    assert 0.99 < agreement["cosine"] <= 1.0 + 1e-9
    assert 0 < agreement["max_abs_error"] < float("inf")
    assert set(agreement["outputs"]) == {"y"}


@pytest.mark.parametrize(
    ("variant", "fp16_io"),
    [("graph", False), ("int8-dynamic", False), ("int8-static", False), ("fp16", True)],
)
def test_every_variant_build_carries_its_agreement(variant, fp16_io, tmp_path):
    from graphtrim.quantize import QuantizeConfig, build_variant

    src = _matmul(tmp_path / "m.onnx")
    rng = np.random.default_rng(1)
    calib = [{"x": rng.standard_normal((8, 3)).astype(np.float32)} for _ in range(4)]
    build = build_variant(
        src,
        tmp_path / f"{variant}.onnx",
        variant,
        config=QuantizeConfig(keep_io_types=not fp16_io),
        calibration=calib,
        probe=False,
    )
    record = build.to_json()["agreement"]
    assert record["measured"] is True, record
    assert record["inputs"].startswith("calibration data") and record["feeds"] == 4
    assert record["cosine"] > 0.99
    if variant == "graph":
        assert record["max_abs_error"] == 0.0


def test_agreement_that_cannot_be_measured_says_why(tmp_path):
    """Random inputs cannot fill a sequence input: the result says so rather than passing."""
    from graphtrim.quantize.agreement import measure_agreement

    proto = _model(
        [
            oh.make_node("Identity", ["x"], ["y"]),
            oh.make_node("Identity", ["s"], ["t"]),
        ],
        inputs=[
            oh.make_tensor_value_info("x", FLOAT, ["N", 3]),
            oh.make_tensor_sequence_value_info("s", FLOAT, ["N"]),
        ],
        outputs=[
            oh.make_tensor_value_info("y", FLOAT, ["N", 3]),
            oh.make_tensor_sequence_value_info("t", FLOAT, ["N"]),
        ],
    )
    src = _save(proto, tmp_path / "m.onnx")
    result = measure_agreement(src, src)
    assert result.measured is False
    assert "seq(tensor(float))" in result.reason
    assert result.summary().startswith("not measured (")
    assert result.to_json()["cosine"] is None

    feeds = [{"x": np.ones((2, 3), np.float32), "s": [np.ones(2, np.float32)]}]
    measured = measure_agreement(src, src, feeds)
    assert measured.measured and measured.min_cosine == pytest.approx(1.0)
    assert set(measured.outputs) == {"y"}  # the sequence output has no distance


def test_a_converter_output_that_cannot_be_read_fails_that_variant(tmp_path, monkeypatch):
    """What the converter writes is not the user's input: a model it writes that cannot be read
    fails the variant (QuantizeError: the ``variants`` command goes on with the others), not
    the command as bad input."""
    from graphtrim.quantize import build_variant
    from graphtrim.quantize import int8 as qv
    from graphtrim.quantize.build import QuantizeError

    def broken_converter(job):
        job.target.write_bytes(Path(job.source).read_bytes()[:40])  # cut short

    monkeypatch.setattr(qv, "convert_int8_dynamic", broken_converter)
    src = _matmul(tmp_path / "m.onnx")
    out = tmp_path / "out" / "q.onnx"
    with pytest.raises(QuantizeError, match="the converted model is unusable"):
        build_variant(src, out, "int8-dynamic", probe=False)
    assert list(out.parent.iterdir()) == []
