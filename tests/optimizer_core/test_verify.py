"""Numerical verification: ``verify()`` on whole models and the per-pass ``VerifyEachPass``
instrument, which must name the first pass that changed results."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import pytest

from graphtrim.errors import VerificationError, VerificationUnavailable
from graphtrim.graph import _ir_utils as u
from graphtrim.graph import presets
from graphtrim.graph.framework import GraphtrimPass
from graphtrim.graph.optimizer import optimize_model
from graphtrim.verify import Tolerance, VerifyEachPass, compare_outputs, verify
from tests.helpers import parse, run_passes


def _affine(bias: str) -> str:
    return f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {{
          c = Constant<value = float[4] {{{bias}}}>()
          a = Mul(x, c)
          y = Add(a, c)
        }}
        """


def test_identical_models_are_equal():
    proto = parse(_affine("0.5, 1.0, 1.5, 2.0"))
    record = verify(proto, parse(_affine("0.5, 1.0, 1.5, 2.0")))
    assert record.ok, record.summary()
    assert record.trials == 3
    assert record.max_abs_diff == 0.0
    assert record.summary().startswith("equal")
    assert record.to_json()["ok"] is True


def test_constant_differing_by_1e_2_is_a_mismatch_naming_the_output():
    ref = parse(_affine("0.5, 1.0, 1.5, 2.0"))
    cand = parse(_affine("0.5, 1.0, 1.5, 2.01"))
    record = verify(ref, cand)
    assert not record.ok
    bad = record.first_failure()
    assert bad is not None and bad.name == "y"
    # y = x * c + c, so the last column differs by 1e-2 * (x + 1): at least ~1e-2 somewhere
    assert 1e-3 < record.max_abs_diff < 1.0
    summary = record.summary()
    assert "MISMATCH" in summary
    assert "output 'y'" in summary
    assert "max abs diff" in summary
    as_json = record.to_json()
    assert as_json["ok"] is False
    assert as_json["outputs"][0]["name"] == "y"
    assert as_json["outputs"][0]["max_abs_diff"] == pytest.approx(record.max_abs_diff)


def test_tolerance_decides():
    ref = parse(_affine("0.5, 1.0, 1.5, 2.0"))
    cand = parse(_affine("0.5, 1.0, 1.5, 2.01"))
    assert verify(ref, cand, tolerance=Tolerance(rtol=0.0, atol=1.0, min_cosine=0.0)).ok


def test_dtype_mismatch_detected():
    ref = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
          y = Relu(x)
        }
        """
    )
    cand = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (double[N, 4] y) {
          r = Relu(x)
          y = Cast<to = 11>(r)
        }
        """
    )
    record = verify(ref, cand)
    assert not record.ok
    bad = record.first_failure()
    assert bad is not None and bad.name == "y"
    assert "dtype" in bad.reason
    cmp = compare_outputs("y", np.zeros(3, np.float32), np.zeros(3, np.float64), Tolerance())
    assert not cmp.ok and "dtype" in cmp.reason


def test_shape_mismatch_detected():
    ref = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
          y = Relu(x)
        }
        """
    )
    cand = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[1, N, 4] y) {
          r = Relu(x)
          a = Constant<value = int64[1] {0}>()
          y = Unsqueeze(r, a)
        }
        """
    )
    record = verify(ref, cand)
    assert not record.ok
    bad = record.first_failure()
    assert bad is not None and bad.name == "y"
    assert "shape" in bad.reason
    # same elements, different shape: never equal, whatever the tolerance
    cmp = compare_outputs(
        "y", np.zeros((2, 4), np.float32), np.zeros((1, 2, 4), np.float32), Tolerance()
    )
    assert not cmp.ok and "shape" in cmp.reason


_TWO_INPUTS = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[N, 4] x, float[N, 4] z, float[M, 4] w) => (float[N, 4] y, float[M, 4] v) {
      y = Add(x, z)
      v = Relu(w)
    }
    """


def test_symbolic_dims_are_bound_consistently_by_name():
    proto = parse(_TWO_INPUTS)
    # Add(x, z) only runs when both inputs get the same N
    record = verify(proto, parse(_TWO_INPUTS))
    assert record.ok, record.summary()
    assert record.input_shapes["x"] == record.input_shapes["z"]

    record = verify(proto, parse(_TWO_INPUTS), dim_values={"N": 5, "M": 3})
    assert record.ok, record.summary()
    assert record.input_shapes == {"x": [5, 4], "z": [5, 4], "w": [3, 4]}

    # a size given for one name leaves the other at the default
    record = verify(proto, parse(_TWO_INPUTS), dim_values={"N": 7})
    assert record.ok, record.summary()
    assert record.input_shapes == {"x": [7, 4], "z": [7, 4], "w": [2, 4]}


def test_user_inputs_are_used():
    relu = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
          y = Relu(x)
        }
        """
    )
    ident = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
          y = Identity(x)
        }
        """
    )
    positive = [
        {"x": np.full((3, 4), 0.5, np.float32)},
        {"x": np.arange(8, dtype=np.float32).reshape(2, 4)},
    ]
    record = verify(relu, ident, inputs=positive)
    # Relu and Identity agree on non-negative inputs only: equal here proves these feeds were used
    assert record.ok, record.summary()
    assert record.trials == 2
    assert record.input_shapes == {"x": [3, 4]}
    # random inputs (standard normal) have negative entries
    assert not verify(relu, ident).ok
    negative = [{"x": -np.ones((1, 4), np.float32)}]
    record = verify(relu, ident, inputs=negative)
    assert not record.ok
    assert record.input_shapes == {"x": [1, 4]}


def test_nan_positions_are_compared():
    sqrt = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
          y = Sqrt(x)
        }
        """
    )
    sqrt_abs = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
          a = Abs(x)
          y = Sqrt(a)
        }
        """
    )
    sqrt_id = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
          a = Identity(x)
          y = Sqrt(a)
        }
        """
    )
    feeds = [{"x": np.array([[-1.0, 4.0, -9.0, 16.0]], np.float32)}]
    # NaN in the same places on both sides is equal
    record = verify(sqrt, sqrt_id, inputs=feeds)
    assert record.ok, record.summary()
    # the finite values agree where both are finite, but NaN became a number: a mismatch
    record = verify(sqrt, sqrt_abs, inputs=feeds)
    assert not record.ok
    bad = record.first_failure()
    assert bad is not None and "NaN" in bad.reason

    nan = np.float32("nan")
    ok = compare_outputs("y", np.array([nan, 1.0]), np.array([nan, 1.0]), Tolerance())
    assert ok.ok
    moved = compare_outputs("y", np.array([nan, 1.0]), np.array([1.0, nan]), Tolerance())
    assert not moved.ok and "NaN positions differ" in moved.reason
    inf = compare_outputs("y", np.array([np.inf, 1.0]), np.array([-np.inf, 1.0]), Tolerance())
    assert not inf.ok and "infinities" in inf.reason


# ---------------------------------------------------------------- per-pass verification


class PlantedBug(GraphtrimPass):
    """A deliberately wrong pass: rewrites every Add into a Sub."""

    name = "planted-bug"
    summary = "test only: Add -> Sub (wrong on purpose)"

    def apply(self, model: ir.Model) -> bool:
        changed = False
        for graph in u.all_graphs(model):
            for node in list(graph):
                if node.op_type == "Add" and node.domain == "":
                    node.op_type = "Sub"
                    self.hit("add-to-sub")
                    changed = True
        return changed


@pytest.fixture
def planted_bug(monkeypatch):
    monkeypatch.setitem(presets.PASSES, PlantedBug.name, PlantedBug)
    return PlantedBug.name


_WITH_IDENTITY = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[N, 4] x) => (float[N, 4] y) {
      c = Constant<value = float[4] {1.0, 2.0, 3.0, 4.0}>()
      i = Identity(x)
      a = Add(i, c)
      y = Relu(a)
    }
    """

_WITHOUT_IDENTITY = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[N, 4] x) => (float[N, 4] y) {
      c = Constant<value = float[4] {1.0, 2.0, 3.0, 4.0}>()
      a = Add(x, c)
      y = Relu(a)
    }
    """


def test_verify_each_pass_names_the_planted_bug(planted_bug):
    model = ir.serde.deserialize_model(parse(_WITH_IDENTITY))
    with pytest.raises(VerificationError) as info:
        optimize_model(
            model, passes=["identity", planted_bug, "dead-code"], instruments=[VerifyEachPass()]
        )
    err = info.value
    assert err.pass_name == "planted-bug"
    assert err.rules == {"add-to-sub": 1}
    assert "planted-bug" in str(err)
    assert "add-to-sub" in str(err)
    assert "output 'y'" in str(err)
    # identity ran first and removed the Identity node, so it is listed
    assert err.passes_before == ["identity"]


def test_passes_before_lists_only_passes_that_modified(planted_bug):
    # no Identity: the identity pass runs first but changes nothing, so it is not listed
    model = ir.serde.deserialize_model(parse(_WITHOUT_IDENTITY))
    with pytest.raises(VerificationError) as info:
        optimize_model(
            model, passes=["identity", planted_bug, "dead-code"], instruments=[VerifyEachPass()]
        )
    assert info.value.pass_name == "planted-bug"
    assert "add-to-sub" in info.value.rules
    assert info.value.passes_before == []


def test_planted_bug_goes_unnoticed_without_the_instrument(planted_bug):
    # the instrument, not the driver, is what catches it; the result really is wrong
    proto = parse(_WITH_IDENTITY)
    out, _ = run_passes(proto, ["identity", planted_bug, "dead-code"])
    assert [n.op_type for n in out.graph.node] == ["Constant", "Sub", "Relu"]
    assert not verify(proto, out).ok


def test_verify_each_pass_is_quiet_for_correct_passes():
    model = ir.serde.deserialize_model(parse(_WITH_IDENTITY))
    inst = VerifyEachPass(trials=2)
    result = optimize_model(model, preset="default", instruments=[inst])
    assert result.modified
    # lift-constants and identity each changed the model and were each checked
    assert inst.checked >= 2
    assert len(inst.feeds) == 2


class RenameOutput(GraphtrimPass):
    """A deliberately wrong pass: renames the first graph output."""

    name = "planted-rename"
    summary = "test only: renames an output (wrong on purpose)"

    def apply(self, model: ir.Model) -> bool:
        model.graph.outputs[0].name = "renamed"
        self.hit("rename-output")
        return True


def test_verify_each_pass_names_a_pass_that_renames_an_output(monkeypatch):
    # a changed interface is a verification failure naming the pass, not a KeyError
    monkeypatch.setitem(presets.PASSES, RenameOutput.name, RenameOutput)
    model = ir.serde.deserialize_model(parse(_WITHOUT_IDENTITY))
    with pytest.raises(VerificationError) as info:
        optimize_model(model, passes=[RenameOutput.name], instruments=[VerifyEachPass()])
    assert info.value.pass_name == "planted-rename"
    assert info.value.rules == {"rename-output": 1}
    assert "'y'" in str(info.value)
    # whole-model verification reports it as well
    proto = parse(_WITHOUT_IDENTITY)
    out, _ = run_passes(proto, [RenameOutput.name])
    record = verify(proto, out)
    assert not record.ok and "outputs differ" in record.error


_STRING_INPUT = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (seq(float[2]) s) => (seq(float[2]) y) {
      a = Identity(s)
      y = Identity(a)
    }
    """


def test_inputs_random_feeds_cannot_fill_are_reported_not_raised():
    proto = parse(_STRING_INPUT)
    record = verify(proto, proto)
    assert not record.ok and record.unverifiable
    assert "input 's' has type seq(tensor(float))" in record.error
    assert record.summary().startswith("cannot verify")
    # given inputs work
    feeds = [{"s": [np.ones(2, np.float32)]}]
    assert verify(proto, proto, inputs=feeds).ok


def test_verify_each_pass_reports_inputs_it_cannot_fill():
    model = ir.serde.deserialize_model(parse(_STRING_INPUT))
    with pytest.raises(VerificationUnavailable, match=r"cannot verify each pass: input 's'"):
        optimize_model(model, passes=["identity"], instruments=[VerifyEachPass()])
    # with inputs given, the identity pass is checked like any other
    model = ir.serde.deserialize_model(parse(_STRING_INPUT))
    inst = VerifyEachPass(inputs=[{"s": [np.ones(2, np.float32)]}])
    optimize_model(model, passes=["identity"], instruments=[inst])
    assert inst.checked == 1


def _decoder_step() -> onnx.ModelProto:
    """A KV-cache step that runs only when the attention mask's length is the cache's length
    plus the new tokens' (``Mul`` of ``[B, 1, P+S, 4]`` by ``[B, 1, T, 1]``)."""
    i64, f32 = onnx.TensorProto.INT64, onnx.TensorProto.FLOAT
    nodes = [
        oh.make_node("Cast", ["input_ids"], ["idf"], to=f32),
        oh.make_node("Unsqueeze", ["idf", "axes13"], ["id4"]),
        oh.make_node("Expand", ["id4", "shape1114"], ["new"]),
        oh.make_node("Concat", ["past_key_values.0.key", "new"], ["present.0.key"], axis=2),
        oh.make_node("Cast", ["attention_mask"], ["mf"], to=f32),
        oh.make_node("Unsqueeze", ["mf", "axes13"], ["m4"]),
        oh.make_node("Mul", ["present.0.key", "m4"], ["masked"]),
        oh.make_node("Cast", ["position_ids"], ["pf"], to=f32),
        oh.make_node("ReduceSum", ["pf"], ["psum"], keepdims=0),
        oh.make_node("Add", ["masked", "psum"], ["y"]),
    ]
    graph = oh.make_graph(
        nodes,
        "step",
        [
            oh.make_tensor_value_info("input_ids", i64, ["batch", "seq"]),
            oh.make_tensor_value_info("attention_mask", i64, ["batch", "total"]),
            oh.make_tensor_value_info("position_ids", i64, ["batch", "seq"]),
            oh.make_tensor_value_info("past_key_values.0.key", f32, ["batch", 1, "past", 4]),
        ],
        [
            oh.make_tensor_value_info("y", f32, ["batch", 1, "total", 4]),
            oh.make_tensor_value_info("present.0.key", f32, ["batch", 1, "total", 4]),
        ],
        initializer=[
            onnx.numpy_helper.from_array(np.array([1, 3], dtype=np.int64), "axes13"),
            onnx.numpy_helper.from_array(np.array([1, 1, 1, 4], dtype=np.int64), "shape1114"),
        ],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])


def test_a_kv_cache_decoder_is_fed_as_it_runs():
    from graphtrim.runtime import probe_feeds
    from graphtrim.verify import make_inputs

    model = _decoder_step()
    specs = [
        ("input_ids", "tensor(int64)", ["batch", "seq"]),
        ("attention_mask", "tensor(int64)", ["batch", "total"]),
        ("position_ids", "tensor(int64)", ["batch", "seq"]),
        ("past_key_values.0.key", "tensor(float)", ["batch", 1, "past", 4]),
    ]
    feeds = make_inputs(specs, seed=0, dim_values={"past": 5, "seq": 3})
    assert feeds["input_ids"].shape == (1, 3)  # one sequence
    assert feeds["attention_mask"].shape == (1, 8)  # the cache and the new tokens
    assert (feeds["attention_mask"] == 1).all()
    assert feeds["position_ids"].tolist() == [[5, 6, 7]]  # counting on from the cache
    # the whole model verifies on those inputs, with and without sizes given
    assert verify(model, model).ok
    record = verify(model, model, dim_values={"past": 5, "seq": 3})
    assert record.ok, record.summary()
    assert record.input_shapes["attention_mask"] == [1, 8]
    # a given batch or mask length wins
    given = make_inputs(specs, seed=0, dim_values={"batch": 2, "total": 4})
    assert given["input_ids"].shape[0] == 2 and given["attention_mask"].shape == (2, 4)
    # the load probe of a built variant feeds it the same way
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    probe = probe_feeds(sess)
    assert probe["attention_mask"].shape == (1, 4) and (probe["attention_mask"] == 1).all()
    sess.run(None, probe)


def test_inputs_that_only_look_like_a_cache_change_nothing():
    from graphtrim.verify import make_inputs

    # a time-series model's past_values is no KV cache: its mask stays random
    specs = [
        ("past_values", "tensor(float)", ["batch", "seq", 3]),
        ("attention_mask", "tensor(int64)", ["batch", "total"]),
    ]
    feeds = make_inputs(specs, seed=0)
    assert feeds["attention_mask"].shape == (2, 2)
    assert not (feeds["attention_mask"] == 1).all()


def test_result_runs_use_no_memory_arena(tmp_path: Path) -> None:
    """Sessions run for their results (verification, agreement, sensitivity) give back what a
    run allocated when it ends. In onnxruntime's arena a weight-only model's weights,
    dequantized in the graph at each run, stayed as a float copy that grew run by run (a
    410 MB int4 model of a 1.5 GB decoder: 1.4 GiB after one run, 2.3 GiB after two). Timed
    sessions keep the arena."""
    from graphtrim.runtime import session_options
    from graphtrim.verify.session import Session

    plain = session_options(1, optimize=False)
    assert plain.enable_cpu_mem_arena is False
    # the weights are read in place from the file's mapping, not copied into packed buffers
    assert plain.get_session_config_entry("session.disable_prepacking") == "1"
    assert session_options(1).enable_cpu_mem_arena is True
    x = oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])
    path = tmp_path / "m.onnx"
    onnx.save(
        oh.make_model(
            oh.make_graph(
                [oh.make_node("Relu", ["x"], ["y"])],
                "g",
                [x],
                [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])],
            )
        ),
        str(path),
    )
    verifying = Session(path).session.get_session_options()
    assert verifying.enable_cpu_mem_arena is False
    assert verifying.get_session_config_entry("session.disable_prepacking") == "1"


def test_no_model_is_left_in_memory_when_optimize_returns(tmp_path: Path) -> None:
    """An IR graph is a web of references that only the cycle collector frees: the models
    optimize and its verification read lingered past ``optimize_file`` into the next step of a
    variant build (0.6 GiB of a 410 MB int4 model through its accuracy checks)."""
    import gc

    import onnx.numpy_helper as onh

    from graphtrim.optimize_file import optimize_file

    x = oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 8])
    y = oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 4])
    w = onh.from_array(np.ones((8, 4), np.float32), "w")
    nodes = [oh.make_node("Identity", ["x"], ["i"]), oh.make_node("MatMul", ["i", "w"], ["y"])]
    src = tmp_path / "m.onnx"
    onnx.save(oh.make_model(oh.make_graph(nodes, "g", [x], [y], [w])), str(src))
    gc.collect()
    # graphs that live on in this process (exporters' function libraries) are not this call's
    # type(), not isinstance(): other tests leave lazy proxies whose __class__ runs code
    kinds = (ir.Model, ir.Graph)
    before = {id(o) for o in gc.get_objects() if type(o) in kinds}
    gc.disable()  # only a collection optimize_file makes may free what it left in cycles
    try:
        optimize_file(src, tmp_path / "o.onnx", preset="safe", check=True)
        left = [o for o in gc.get_objects() if type(o) in kinds and id(o) not in before]
    finally:
        gc.enable()
    assert not left


def _int64_model(path: Path, *, overflow: bool) -> Path:
    """y = a * 0 + INT64_MIN, divided by -1 when ``overflow``: x86's integer division traps
    on INT64_MIN / -1 (SIGFPE), a check onnxruntime's Div kernel does not make."""
    ints = onnx.TensorProto.INT64
    nodes = [oh.make_node("Mul", ["a", "zero"], ["z"]), oh.make_node("Add", ["z", "min"], ["m"])]
    nodes.append(
        oh.make_node("Div", ["m", "neg"], ["y"]) if overflow else oh.make_node("Neg", ["m"], ["y"])
    )
    graph = oh.make_graph(
        nodes,
        "g",
        [oh.make_tensor_value_info("a", ints, ["n"])],
        [oh.make_tensor_value_info("y", ints, ["n"])],
        [
            oh.make_tensor("zero", ints, [], [0]),
            oh.make_tensor("min", ints, [], [-(2**63)]),
            oh.make_tensor("neg", ints, [], [-1]),
        ],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_onnxruntime_dying_on_the_reference_makes_it_unverifiable_not_a_crash(tmp_path: Path):
    """A native crash while the reference runs (here SIGFPE) is reported, in this process,
    as a model that cannot be verified on these inputs; nothing is written."""
    from graphtrim.optimize_file import optimize_file
    from graphtrim.verify import verify_isolated

    src = _int64_model(tmp_path / "m.onnx", overflow=True)
    record = verify_isolated(src, src)
    assert record.unverifiable and not record.ok
    assert "SIGFPE while running the reference model" in record.error
    assert "n=2" in record.error and "--dim" in record.error
    dst = tmp_path / "o.onnx"
    with pytest.raises(VerificationUnavailable, match="SIGFPE"):
        optimize_file(src, dst, check=True)
    assert not dst.exists() and not list(tmp_path.glob(".o.onnx*"))


def test_onnxruntime_dying_on_the_candidate_alone_is_a_mismatch(tmp_path: Path):
    from graphtrim.verify import verify_isolated

    ref = _int64_model(tmp_path / "ref.onnx", overflow=False)
    cand = _int64_model(tmp_path / "cand.onnx", overflow=True)
    record = verify_isolated(ref, cand)
    assert not record.ok and not record.unverifiable
    assert "SIGFPE while running the optimized model (the input ran)" in record.error
    # the same pair compared in this process would have ended it: the isolated record agrees
    # with the in-process one wherever nothing crashes
    same = verify_isolated(ref, ref, trials=2)
    assert same.ok and same.to_json() == verify(str(ref), str(ref), trials=2).to_json()


def test_the_commands_exit_2_with_one_line_when_onnxruntime_dies_on_the_input(tmp_path: Path):
    from tests.optimizer_core.test_modelio_and_cli import run_cli

    src = _int64_model(tmp_path / "m.onnx", overflow=True)
    for args in (
        ["optimize", str(src), "-o", str(tmp_path / "o.onnx"), "--verify"],
        ["verify", str(src), str(src)],
    ):
        proc = run_cli(*args)
        assert proc.returncode == 2, proc.stderr
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert lines[-1].startswith("graphtrim: error: cannot verify"), proc.stderr
        assert "SIGFPE while running the reference model" in lines[-1]
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o.onnx").exists()


def test_inputs_of_the_users_own_verify_what_random_inputs_cannot(tmp_path: Path):
    """A table indexed by a sample rate cannot run on random rates (exit 2 says how to give
    inputs); on the user's own feeds (a scalar: one set, fed as it is) it verifies."""
    from tests.optimizer_core.test_modelio_and_cli import run_cli

    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x, int64 rate) => (float[N, 4] y) {
          base = Constant<value = int64 {16000}>()
          idx = Sub(rate, base)
          table = Constant<value = float[4, 4] {1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16}>()
          row = Gather<axis = 0>(table, idx)
          one = Constant<value = float {1.0}>()
          z = Mul(x, one)
          y = Add(z, row)
        }
        """
    )
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(proto, str(src))
    args = ["optimize", str(src), "-o", str(dst), "--verify"]
    proc = run_cli(*args)
    assert proc.returncode == 2 and "--inputs FEEDS.npz" in proc.stderr, proc.stderr
    feeds = tmp_path / "feeds.npz"
    np.savez(feeds, x=np.ones((3, 4), np.float32), rate=np.array(16002))
    proc = run_cli(*args, "--inputs", str(feeds))
    assert proc.returncode == 0, proc.stderr
    assert "verification: equal on 1 input set(s)" in proc.stdout
    assert op_types_of(dst) == ["Sub", "Gather", "Add"]  # x * 1 went
    proc = run_cli("verify", str(src), str(dst), "--inputs", str(feeds))
    assert proc.returncode == 0 and proc.stdout.startswith("equal on 1 input set(s)"), proc.stderr
    dst.unlink()
    proc = run_cli("optimize", str(src), "-o", str(dst), "--inputs", str(feeds))
    assert proc.returncode == 2 and "--inputs gives the inputs --verify" in proc.stderr
    assert not dst.exists()


def op_types_of(path: Path) -> list[str]:
    return [n.op_type for n in onnx.load(str(path)).graph.node]


def test_declared_input_specs_are_what_onnxruntime_reports(tmp_path: Path):
    """Read from the graph alone (no session: loading is what may crash), the specs equal
    onnxruntime's, types included; initializers listed as inputs are not inputs."""
    from graphtrim.data import input_specs
    from graphtrim.verify import declared_input_specs

    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x, int64[N] code, bool flag, float16[2, M] h, float[4] w) => (float[N, 4] y)
          <float[4] w = {1.0, 2.0, 3.0, 4.0}> {
          a = Mul(x, w)
          c = Cast<to = 1>(code)
          one = Constant<value = int64[1] {1}>()
          b = Unsqueeze(c, one)
          y = Add(a, b)
        }
        """
    )
    path = tmp_path / "m.onnx"
    onnx.save(proto, str(path))
    assert declared_input_specs(path) == input_specs(path)
    assert [s[0] for s in declared_input_specs(path)] == ["x", "code", "flag", "h"]


def _ill_conditioned(gamma_change: float = 0.0) -> onnx.ModelProto:
    """Two Conv+BatchNormalization layers whose first weights are 1e4 times too large: outputs
    near 1e6, some of them small differences of such terms, so rounding alone moves them past
    the element-wise tolerance (as in a random-initialized MobileOne, logits near 1e15)."""
    rng = np.random.default_rng(11)

    def init(name: str, arr: np.ndarray) -> onnx.TensorProto:
        return onnx.numpy_helper.from_array(np.asarray(arr, np.float32), name)

    inits, nodes, cur = [], [], "x"
    for i in range(2):
        gamma = rng.uniform(0.5, 1.5, 16) * (1 + (gamma_change if i == 1 else 0.0))
        inits += [
            init(f"W{i}", rng.standard_normal((16, 16, 3, 3)) * (1e4 if i == 0 else 1.0)),
            init(f"g{i}", gamma),
            init(f"b{i}", rng.standard_normal(16)),
            init(f"m{i}", rng.standard_normal(16)),
            init(f"v{i}", rng.uniform(0.5, 2, 16)),
        ]
        nodes += [
            oh.make_node("Conv", [cur, f"W{i}"], [f"c{i}"], pads=[1, 1, 1, 1]),
            oh.make_node(
                "BatchNormalization", [f"c{i}", f"g{i}", f"b{i}", f"m{i}", f"v{i}"], [f"y{i}"]
            ),
        ]
        cur = f"y{i}"
    graph = oh.make_graph(
        nodes,
        "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 16, 16, 16])],
        [oh.make_tensor_value_info(cur, onnx.TensorProto.FLOAT, [1, 16, 16, 16])],
        inits,
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])


def test_an_ill_conditioned_output_moved_by_rounding_alone_is_equal_and_said_so(monkeypatch):
    from graphtrim.verify import compare

    ref = _ill_conditioned()
    out, _ = run_passes(ref, ["fuse-affine", "dead-code"])
    assert [n.op_type for n in out.graph.node] == ["Conv", "Conv"]
    record = verify(ref, out)
    assert record.ok, record.summary()
    (output,) = record.outputs
    assert output.input_noise is not None and output.input_noise > 0
    assert 0 < output.max_abs_diff <= compare.NOISE_FACTOR * output.input_noise
    # the element-wise tolerance alone fails it: rounding moves the small outputs too far
    monkeypatch.setattr(compare, "NOISE_FACTOR", 0.0)
    assert not verify(ref, out).ok
    assert "within the input's own rounding noise" in record.summary()
    assert record.to_json()["outputs"][0]["input_noise"] == output.input_noise


def test_a_real_change_of_an_ill_conditioned_output_is_still_a_mismatch():
    ref = _ill_conditioned()
    # one scale changed by 1e-4 of itself: far past what rounding moves
    record = verify(ref, _ill_conditioned(gamma_change=1e-4))
    assert not record.ok
    bad = record.first_failure()
    assert bad is not None and bad.input_noise is None
    assert "max abs diff" in bad.reason
