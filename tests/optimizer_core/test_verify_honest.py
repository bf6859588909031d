"""Honest verification: exit 1 means the optimized model was run and differs, nothing else.

A reference that onnxruntime cannot load or run (a custom domain, an ``ai.onnx.ml`` opset it
lacks, sequence inputs random feeds cannot fill) cannot be verified: exit 2 with the reason, and
without ``--verify`` such models still optimize. Duplicate node names, which onnxruntime refuses
but which mean nothing to the computation, are verified on renamed copies. Outputs computed from a
random op are compared by shape and dtype only, and the summary says so. Bad ``--trials``,
``--atol``, ``--rtol`` and ``--report`` values are refused before anything is written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as h
import onnx_ir as ir
import pytest
from onnx import TensorProto

from graphtrim.cli import main
from graphtrim.errors import VerificationError
from graphtrim.graph.optimizer import optimize_model
from graphtrim.verify import VerifyEachPass, compare_outputs, verify
from graphtrim.verify.records import Tolerance, VerificationRecord

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

F = TensorProto.FLOAT


def _model(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    *,
    opsets: dict[str, int] | None = None,
    initializers: list[onnx.TensorProto] | None = None,
    functions: list[onnx.FunctionProto] | None = None,
) -> onnx.ModelProto:
    graph = h.make_graph(nodes, "g", inputs, outputs, initializer=initializers or [])
    return h.make_model(
        graph,
        opset_imports=[h.make_opsetid(d, v) for d, v in (opsets or {"": 17}).items()],
        ir_version=8,
        functions=functions or [],
    )


def _x(name: str = "x", elem: int = F) -> onnx.ValueInfoProto:
    return h.make_tensor_value_info(name, elem, [2, 4])


def _save(model: onnx.ModelProto, path: Path) -> str:
    onnx.save(model, path)
    return str(path)


def _relu_chain() -> onnx.ModelProto:
    """x -> Identity -> Relu -> y: plain, runs everywhere, optimizes (the Identity goes)."""
    return _model(
        [h.make_node("Identity", ["x"], ["i"]), h.make_node("Relu", ["i"], ["y"])],
        [_x()],
        [_x("y")],
    )


def _custom_domain() -> onnx.ModelProto:
    return _model(
        [
            h.make_node("Identity", ["x"], ["i"]),
            h.make_node("Foo", ["i"], ["y"], domain="com.example"),
        ],
        [_x()],
        [_x("y")],
        opsets={"": 17, "com.example": 1},
    )


def _duplicate_node_names() -> onnx.ModelProto:
    return _model(
        [
            h.make_node("Identity", ["x"], ["i"], name="n"),
            h.make_node("Relu", ["i"], ["y"], name="n"),
        ],
        [_x()],
        [_x("y")],
    )


def _sequence_input() -> onnx.ModelProto:
    return _model(
        [h.make_node("Identity", ["s"], ["a"]), h.make_node("Identity", ["a"], ["y"])],
        [h.make_tensor_sequence_value_info("s", TensorProto.FLOAT, [2])],
        [h.make_tensor_sequence_value_info("y", TensorProto.FLOAT, [2])],
    )


def _ml_opset_too_new() -> onnx.ModelProto:
    return _model(
        [h.make_node("Identity", ["x"], ["i"]), h.make_node("Relu", ["i"], ["y"])],
        [_x()],
        [_x("y")],
        opsets={"": 17, "ai.onnx.ml": 99},
    )


UNVERIFIABLE = {
    "custom-domain": (_custom_domain, "com.example:Foo"),
    "sequence-input": (_sequence_input, "seq(tensor(float))"),
    "ai-onnx-ml-opset": (_ml_opset_too_new, "ai.onnx.ml"),
}


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("graphtrim: error: "), err
    return lines[0]


# ---------------------------------------------------------------- item 8: cannot verify -> 2


@pytest.mark.parametrize("case", sorted(UNVERIFIABLE))
def test_unverifiable_reference_is_not_a_mismatch(case):
    build, why = UNVERIFIABLE[case]
    proto = build()
    record = verify(proto, proto)
    assert record.unverifiable and not record.ok
    assert record.status == "unverifiable"
    assert record.summary().startswith("cannot verify: ")
    assert why in record.error
    assert record.to_json()["status"] == "unverifiable"


@pytest.mark.parametrize("case", sorted(UNVERIFIABLE))
def test_cli_verify_of_an_unverifiable_model_exits_2(case, tmp_path, capsys):
    build, why = UNVERIFIABLE[case]
    path = _save(build(), tmp_path / "m.onnx")
    assert main(["verify", path, path]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "cannot verify" in line and why in line
    # --json still prints the record, which says so
    assert main(["verify", path, path, "--json"]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out)["status"] == "unverifiable"
    assert "cannot verify" in _one_error_line(captured.err)


@pytest.mark.parametrize("case", sorted(UNVERIFIABLE))
def test_optimize_verify_of_an_unverifiable_model_exits_2_and_writes_nothing(
    case, tmp_path, capsys
):
    build, why = UNVERIFIABLE[case]
    src = _save(build(), tmp_path / "m.onnx")
    out = tmp_path / "out.onnx"
    assert main(["optimize", src, "-o", str(out), "--verify", "-q"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "cannot verify" in line and why in line
    assert "without --verify the model is optimized" in line
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


@pytest.mark.parametrize("case", sorted(UNVERIFIABLE))
def test_optimize_verify_each_pass_of_an_unverifiable_model_exits_2(case, tmp_path, capsys):
    build, why = UNVERIFIABLE[case]
    src = _save(build(), tmp_path / "m.onnx")
    out = tmp_path / "out.onnx"
    assert main(["optimize", src, "-o", str(out), "--verify-each-pass", "-q"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "cannot verify each pass" in line and why in line
    assert not out.exists()


@pytest.mark.parametrize("case", sorted(UNVERIFIABLE))
def test_unverifiable_models_still_optimize_without_verify(case, tmp_path, capsys):
    build, _ = UNVERIFIABLE[case]
    src = _save(build(), tmp_path / "m.onnx")
    out = tmp_path / "out.onnx"
    assert main(["optimize", src, "-o", str(out), "-q"]) == 0
    assert capsys.readouterr().err == ""
    # it really was optimized: one of the two Identity-fed nodes went
    assert len(onnx.load(out).graph.node) == len(build().graph.node) - 1


def test_duplicate_node_names_are_verified_all_the_same(tmp_path, capsys):
    # onnxruntime refuses repeated node names, which mean nothing to the computation: the
    # comparison runs on copies with unique names, so the model is verified, not refused
    src = _save(_duplicate_node_names(), tmp_path / "m.onnx")
    assert verify(src, src).status == "equal"
    out = tmp_path / "out.onnx"
    for flag in ("--verify", "--verify-each-pass"):
        assert main(["optimize", src, "-o", str(out), flag, "-q"]) == 0
        assert capsys.readouterr().err == ""
    assert main(["verify", src, str(out)]) == 0
    # and a real difference behind repeated names is still found
    changed = _duplicate_node_names()
    changed.graph.node[1].op_type = "Sigmoid"
    cand = _save(changed, tmp_path / "cand.onnx")
    assert main(["verify", src, cand]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_verify_each_pass_raises_unavailable_not_a_verification_error():
    from graphtrim.errors import VerificationUnavailable

    model = ir.serde.deserialize_model(_custom_domain())
    with pytest.raises(VerificationUnavailable, match="cannot verify each pass") as info:
        optimize_model(model, passes=["identity"], instruments=[VerifyEachPass()])
    assert not isinstance(info.value, VerificationError)


def test_a_candidate_that_fails_to_load_is_a_verified_failure(tmp_path, capsys):
    # the reference runs; the candidate does not load: the optimized model is broken (exit 1)
    ref = _save(_relu_chain(), tmp_path / "ref.onnx")
    cand = _save(_custom_domain(), tmp_path / "cand.onnx")
    record = verify(ref, cand)
    assert record.status == "mismatch" and not record.unverifiable
    assert "cannot load the optimized model" in record.error
    assert main(["verify", ref, cand]) == 1
    out = capsys.readouterr().out
    assert out.startswith("MISMATCH: ")


def test_a_real_difference_is_still_exit_1(tmp_path, capsys):
    ref = _save(_relu_chain(), tmp_path / "ref.onnx")
    sigmoid = _model([h.make_node("Sigmoid", ["x"], ["y"])], [_x()], [_x("y")])
    cand = _save(sigmoid, tmp_path / "cand.onnx")
    assert main(["verify", ref, cand]) == 1
    assert "MISMATCH" in capsys.readouterr().out
    assert main(["verify", ref, ref]) == 0


# ---------------------------------------------------------------- item 9: random ops


def _random_normal() -> onnx.ModelProto:
    """y = RandomNormal() + x: unseeded, a new y on every run."""
    return _model(
        [
            h.make_node("RandomNormal", [], ["r"], shape=[2, 4], dtype=F),
            h.make_node("Add", ["x", "r"], ["y"]),
        ],
        [_x()],
        [_x("y")],
    )


def _identity_before_bernoulli() -> onnx.ModelProto:
    """z = Bernoulli(Sigmoid(Identity(x))) and a deterministic w = Relu(x)."""
    return _model(
        [
            h.make_node("Identity", ["x"], ["i"]),
            h.make_node("Sigmoid", ["i"], ["p"]),
            h.make_node("Bernoulli", ["p"], ["z"]),
            h.make_node("Relu", ["x"], ["w"]),
        ],
        [_x()],
        [_x("z"), _x("w")],
    )


def test_a_model_with_an_unseeded_random_op_verifies_against_itself(tmp_path, capsys):
    path = _save(_random_normal(), tmp_path / "m.onnx")
    assert main(["verify", path, path]) == 0
    out = capsys.readouterr().out
    assert out.startswith("equal (shape and dtype only)")
    assert "output 'y' depends on random op RandomNormal: compared by shape and dtype only" in out


def test_optimize_verify_of_an_identity_before_bernoulli_exits_0(tmp_path, capsys):
    src = _save(_identity_before_bernoulli(), tmp_path / "m.onnx")
    out = tmp_path / "out.onnx"
    assert main(["optimize", src, "-o", str(out), "--verify"]) == 0
    printed = capsys.readouterr().out
    assert "output 'z' depends on random op Bernoulli" in printed
    assert "output 'w'" not in printed  # compared by value
    assert "Identity" not in [n.op_type for n in onnx.load(out).graph.node]


def test_optimize_verify_each_pass_of_an_identity_before_bernoulli_exits_0(tmp_path, capsys):
    src = _save(_identity_before_bernoulli(), tmp_path / "m.onnx")
    out = tmp_path / "out.onnx"
    assert main(["optimize", src, "-o", str(out), "--verify-each-pass", "-q"]) == 0
    assert "identity" not in capsys.readouterr().err.lower().replace("--verify", "")
    assert "Identity" not in [n.op_type for n in onnx.load(out).graph.node]


def test_verify_each_pass_compares_random_outputs_by_shape_only():
    model = ir.serde.deserialize_model(_identity_before_bernoulli())
    inst = VerifyEachPass()
    optimize_model(model, passes=["identity"], instruments=[inst])
    assert inst.checked == 1
    assert inst.shape_only == {"z": "Bernoulli"}
    assert inst.notes() == [
        "output 'z' depends on random op Bernoulli: compared by shape and dtype only"
    ]


def test_a_deterministic_output_that_differs_is_still_a_mismatch(tmp_path, capsys):
    # negative control: z is random (shape only), but w differs (Relu vs Sigmoid): exit 1
    ref = _save(_identity_before_bernoulli(), tmp_path / "ref.onnx")
    changed = _identity_before_bernoulli()
    changed.graph.node[3].op_type = "Sigmoid"
    cand = _save(changed, tmp_path / "cand.onnx")
    record = verify(ref, cand)
    assert record.status == "mismatch"
    bad = record.first_failure()
    assert bad is not None and bad.name == "w"
    assert main(["verify", ref, cand]) == 1
    out = capsys.readouterr().out
    assert "first mismatch: output 'w'" in out
    assert "output 'z' depends on random op Bernoulli" in out


def test_a_random_output_of_another_shape_is_a_mismatch():
    a = np.zeros((2, 4), np.float32)
    assert compare_outputs("y", a, a + 1, Tolerance(), shape_only=True).ok
    assert not compare_outputs(
        "y", a, np.zeros((4, 2), np.float32), Tolerance(), shape_only=True
    ).ok
    assert not compare_outputs("y", a, a.astype(np.float64), Tolerance(), shape_only=True).ok


def _dropout(training: list[onnx.NodeProto], flag: str) -> onnx.ModelProto:
    return _model(
        [*training, h.make_node("Dropout", ["x", "", flag], ["y"])],
        [_x()],
        [_x("y")],
    )


def _bool_constant(name: str, value: bool) -> onnx.NodeProto:
    return h.make_node(
        "Constant", [], [name], value=h.make_tensor(name, TensorProto.BOOL, [], [value])
    )


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        pytest.param(_random_normal, {"y": "RandomNormal"}, id="random-normal"),
        pytest.param(_identity_before_bernoulli, {"z": "Bernoulli"}, id="bernoulli"),
        pytest.param(
            lambda: _dropout([_bool_constant("t", True)], "t"), {"y": "Dropout"}, id="dropout-train"
        ),
        pytest.param(lambda: _dropout([_bool_constant("t", False)], "t"), {}, id="dropout-infer"),
        pytest.param(_relu_chain, {}, id="deterministic"),
    ],
)
def test_random_outputs(build, expected):
    from graphtrim.verify import random_outputs

    assert random_outputs(ir.serde.deserialize_model(build())) == expected


def test_random_outputs_are_found_through_subgraphs_and_functions():
    from graphtrim.verify import random_outputs

    then_branch = h.make_graph(
        [h.make_node("RandomUniformLike", ["x"], ["t"])], "then", [], [_x("t")]
    )
    else_branch = h.make_graph([h.make_node("Identity", ["x"], ["e"])], "else", [], [_x("e")])
    cond = h.make_tensor_value_info("c", TensorProto.BOOL, [])
    in_if = _model(
        [
            h.make_node("If", ["c"], ["o"], then_branch=then_branch, else_branch=else_branch),
            h.make_node("Relu", ["o"], ["y"]),
            h.make_node("Abs", ["x"], ["v"]),
        ],
        [cond, _x()],
        [_x("y"), _x("v")],
    )
    assert random_outputs(ir.serde.deserialize_model(in_if)) == {"y": "RandomUniformLike"}
    # a model-local function that draws: every call of it is random
    noisy = h.make_function(
        "local",
        "Noisy",
        ["a"],
        ["b"],
        [h.make_node("RandomNormalLike", ["a"], ["r"]), h.make_node("Add", ["a", "r"], ["b"])],
        [h.make_opsetid("", 17)],
    )
    with_function = _model(
        [h.make_node("Noisy", ["x"], ["y"], domain="local")],
        [_x()],
        [_x("y")],
        opsets={"": 17, "local": 1},
        functions=[noisy],
    )
    assert random_outputs(ir.serde.deserialize_model(with_function)) == {"y": "RandomNormalLike"}
    # and verification accepts the model against itself
    assert verify(with_function, with_function).ok


# ---------------------------------------------------------------- item 11: arguments


@pytest.mark.parametrize("command", ["optimize", "verify"])
@pytest.mark.parametrize(
    "arg",
    [
        ["--trials", "0"],
        ["--trials", "-1"],
        ["--trials", "two"],
        ["--atol", "nan"],
        ["--atol", "inf"],
        ["--atol", "-0.5"],
        ["--rtol", "nan"],
        ["--rtol", "-0.1"],
    ],
    ids=lambda a: " ".join(a) if isinstance(a, list) else a,
)
def test_bad_verify_arguments_are_refused(command, arg, tmp_path, capsys):
    src = _save(_relu_chain(), tmp_path / "m.onnx")
    out = tmp_path / "out.onnx"
    argv = (
        ["optimize", src, "-o", str(out), "--verify"]
        if command == "optimize"
        else ["verify", src, src]
    )
    with pytest.raises(SystemExit) as info:
        main([*argv, *arg])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {arg[0]}" in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize(
    "arg",
    [
        ["--max-iterations", "0"],
        ["--max-iterations", "-3"],
        ["--max-unroll", "-1"],
        ["--opset", "0"],
        ["--fold-max-growth", "-1"],
        ["--fold-max-growth", "inf"],
        ["--fold-max-tensor", "inf"],
        ["--fold-max-growth-ratio", "1.5"],
        ["--fold-max-growth-ratio", "nan"],
    ],
    ids=" ".join,
)
def test_bad_optimize_arguments_are_refused(arg, tmp_path, capsys):
    src = _save(_relu_chain(), tmp_path / "m.onnx")
    out = tmp_path / "out.onnx"
    with pytest.raises(SystemExit) as info:
        main(["optimize", src, "-o", str(out), *arg])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {arg[0]}" in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["quantize", "m.onnx", "-o", "q.onnx", "--max-attempts", "0"],
        ["quantize", "m.onnx", "-o", "q.onnx", "--batch-size", "-4"],
        ["evaluate", "m.onnx", "m.onnx", "--threads", "0"],
        ["pipeline", "run", "--model", "m", "--version", "1", "--child-timeout", "nan"],
        ["trigger", "--model", "m", "--version", "1", "--timeout", "-1"],
        ["trigger", "--model", "m", "--version", "1", "--poll", "0"],
        ["trigger", "--model", "m", "--version", "1", "--poll", "inf"],
    ],
    ids=lambda argv: " ".join(argv[i] for i in (0, -2, -1)),
)
def test_counts_and_durations_of_the_other_commands_are_checked(argv, tmp_path, capsys):
    _save(_relu_chain(), tmp_path / "m.onnx")
    argv = [str(tmp_path / a) if a.endswith(".onnx") else a for a in argv]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[-2]}" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_verify_refuses_zero_trials_in_the_library():
    proto = _relu_chain()
    with pytest.raises(ValueError, match="at least 1"):
        verify(proto, proto, trials=0)
    with pytest.raises(ValueError, match="at least 1"):
        VerifyEachPass(trials=0)


def _no_tmp_left(folder: Path) -> None:
    assert not [p.name for p in folder.rglob("*.tmp")]
    assert not [p.name for p in folder.rglob(".*staging*")]


def test_report_to_an_existing_folder_is_refused_before_anything_is_written(tmp_path, capsys):
    src = _save(_relu_chain(), tmp_path / "m.onnx")
    out = tmp_path / "out.onnx"
    rep = tmp_path / "rep"
    rep.mkdir()
    assert main(["optimize", src, "-o", str(out), "--report", str(rep), "-q"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "is a directory" in line
    assert not out.exists()
    assert list(rep.iterdir()) == []
    _no_tmp_left(tmp_path)


def test_report_over_a_model_is_refused(tmp_path, capsys):
    src = _save(_relu_chain(), tmp_path / "m.onnx")
    out = tmp_path / "out.onnx"
    for target in (out, Path(src)):
        assert main(["optimize", src, "-o", str(out), "--report", str(target), "-q"]) == 2
        assert "would overwrite the model" in _one_error_line(capsys.readouterr().err)
    assert not out.exists()
    assert onnx.load(src) == _relu_chain()


def test_report_under_a_file_is_refused(tmp_path, capsys):
    src = _save(_relu_chain(), tmp_path / "m.onnx")
    out = tmp_path / "out.onnx"
    (tmp_path / "file").write_text("x")
    rep = tmp_path / "file" / "r.json"
    assert main(["optimize", src, "-o", str(out), "--report", str(rep), "-q"]) == 2
    assert "is not a folder" in _one_error_line(capsys.readouterr().err)
    assert not out.exists()
    _no_tmp_left(tmp_path)


def test_report_in_a_new_folder_is_written(tmp_path, capsys):
    src = _save(_random_normal(), tmp_path / "m.onnx")
    out = tmp_path / "out.onnx"
    rep = tmp_path / "reports" / "nested" / "r.json"
    assert main(["optimize", src, "-o", str(out), "--report", str(rep), "--verify", "-q"]) == 0
    data = json.loads(rep.read_text())
    assert data["verification"]["status"] == "equal"
    assert data["verification"]["shape_only"] == {"y": "RandomNormal"}
    assert out.exists()
    _no_tmp_left(tmp_path)


def test_a_report_that_cannot_be_written_leaves_no_temporary_file(tmp_path, capsys, monkeypatch):
    import graphtrim.optimize_file as optimize

    src = _save(_relu_chain(), tmp_path / "m.onnx")
    out = tmp_path / "out.onnx"
    rep = tmp_path / "r.json"
    rep.write_text("{}")

    replace = os.replace

    def disk_full_for_the_report(a, b):
        if Path(b) == rep:
            raise OSError(28, "No space left on device")
        replace(a, b)

    monkeypatch.setattr(optimize.os, "replace", disk_full_for_the_report)
    code = main(["optimize", src, "-o", str(out), "--report", str(rep), "-q"])
    assert code == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "No space left on device" in line
    assert rep.read_text() == "{}"  # the earlier report is left as it was
    _no_tmp_left(tmp_path)


def test_a_shape_mismatch_record_is_valid_json():
    """JSON has no Infinity: a difference that is no number is null, with the reason beside it."""
    cmp = compare_outputs("y", np.zeros((2, 2), np.float32), np.zeros(3, np.float32), Tolerance())
    record = VerificationRecord(False, 1, [cmp], Tolerance(), {})
    data = json.loads(json.dumps(record.to_json(), allow_nan=False))
    assert data["max_abs_diff"] is None and data["outputs"][0]["max_abs_diff"] is None
    assert "shape" in data["outputs"][0]["reason"]
