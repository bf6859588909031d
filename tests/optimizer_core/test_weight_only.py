"""Weight-only variants (int4-weight, int8-weight): onnxruntime's quantizer, the portable
lowering of MatMulNBits, the opset conversion before it, and the variant builds."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnxruntime as ort
import pytest

from graphtrim.cli import main
from graphtrim.quantize import QuantizeConfig
from graphtrim.quantize.build import QuantizeError, build_variant
from graphtrim.quantize.nbits_lowering import lower_matmul_nbits
from graphtrim.quantize.weight_only import quantize_weights
from graphtrim.quantize.weight_settings import WeightOnlyError, WeightOnlySettings

FLOAT = onnx.TensorProto.FLOAT
K, N, N2 = 72, 40, 24  # K is no multiple of the block: the last block is padded


def _mlp(opset: int = 17, shared: bool = False) -> onnx.ModelProto:
    """``x [B, S, K] -> MatMul -> ReduceMean-centred (axes attribute below opset 18) ->
    MatMul``; with ``shared`` a third MatMul reads the second's weight again."""
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((K, N)).astype(np.float32)
    w2 = rng.standard_normal((N, N2)).astype(np.float32)
    if opset < 18:
        mean = oh.make_node("ReduceMean", ["h"], ["m"], axes=[-1], keepdims=1)
        inits = []
    else:
        mean = oh.make_node("ReduceMean", ["h", "axes"], ["m"], keepdims=1)
        inits = [onh.from_array(np.array([-1], dtype=np.int64), "axes")]
    nodes = [
        oh.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        mean,
        oh.make_node("Sub", ["h", "m"], ["c"]),
        oh.make_node("MatMul", ["c", "w2"], ["y"], name="mm2"),
    ]
    outputs = [oh.make_tensor_value_info("y", FLOAT, ["B", "S", N2])]
    if shared:
        nodes.append(oh.make_node("Tanh", ["c"], ["t"]))
        nodes.append(oh.make_node("MatMul", ["t", "w2"], ["z"], name="mm3"))
        outputs.append(oh.make_tensor_value_info("z", FLOAT, ["B", "S", N2]))
    graph = oh.make_graph(
        nodes,
        "mlp",
        [oh.make_tensor_value_info("x", FLOAT, ["B", "S", K])],
        outputs,
        initializer=[onh.from_array(w1, "w1"), onh.from_array(w2, "w2"), *inits],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])


def _x() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((2, 5, K)).astype(np.float32)


def _run(path: Path, feeds: dict[str, np.ndarray], optimize: bool = False) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if optimize
        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _ops(path: Path) -> Counter[str]:
    return Counter(n.op_type for n in onnx.load(path).graph.node)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_portable_form_computes_what_matmulnbits_computes(
    tmp_path: Path, bits: int, symmetric: bool
) -> None:
    src = tmp_path / "in.onnx"
    onnx.save(_mlp(), src)
    feeds = {"x": _x()}
    outs = {}
    for form in ("ort", "portable"):
        dst = tmp_path / f"{form}.onnx"
        # accuracy level 0: MatMulNBits computes in float, as DequantizeLinear + MatMul does
        level = 0 if form == "ort" else None
        record = quantize_weights(
            src, dst, WeightOnlySettings(bits, 32, symmetric, "rtn", form, level), work=tmp_path
        )
        assert record["matmuls_quantized"] == 2
        onnx.checker.check_model(onnx.load(dst), full_check=True)
        outs[form] = _run(dst, feeds)[0]
    assert _ops(tmp_path / "ort.onnx")["MatMulNBits"] == 2
    portable = onnx.load(tmp_path / "portable.onnx")
    assert Counter(n.op_type for n in portable.graph.node)["DequantizeLinear"] == 2
    assert {o.domain for o in portable.opset_import} == {""}
    types = {t.data_type for t in portable.graph.initializer if "_DQ_W" in t.name}
    want = {4: (onnx.TensorProto.INT4, onnx.TensorProto.UINT4), 8: (3, 2)}[bits]
    assert types == {want[0] if symmetric else want[1]}
    # the same integers and scales: equal up to float summation order
    np.testing.assert_allclose(outs["portable"], outs["ort"], rtol=1e-4, atol=1e-3)
    reference = _run(src, feeds)[0]
    err = np.abs(outs["ort"] - reference).max() / np.abs(reference).max()
    assert err < (0.2 if bits == 4 else 0.02)


def test_the_opset_is_converted_not_just_relabelled(tmp_path: Path) -> None:
    """onnxruntime's quantizer raises the import to 21 and leaves ReduceMean's axes
    attribute, which opset 18 moved to an input; graphtrim converts the model first."""
    src = tmp_path / "in.onnx"
    onnx.save(_mlp(opset=17), src)
    dst = tmp_path / "out.onnx"
    quantize_weights(src, dst, WeightOnlySettings(4, 32, True, "rtn", "portable"), work=tmp_path)
    out = onnx.load(dst)
    onnx.checker.check_model(out, full_check=True)
    mean = next(n for n in out.graph.node if n.op_type == "ReduceMean")
    assert len(mean.input) == 2 and not any(a.name == "axes" for a in mean.attribute)
    got, want = _run(dst, {"x": _x()})[0], _run(src, {"x": _x()})[0]
    assert np.abs(got - want).max() < 0.2 * np.abs(want).max()


def test_a_shared_weight_is_dequantized_once(tmp_path: Path) -> None:
    src = tmp_path / "in.onnx"
    onnx.save(_mlp(opset=21, shared=True), src)
    for form, level in (("ort", 0), ("portable", None)):
        dst = tmp_path / f"{form}.onnx"
        settings = WeightOnlySettings(4, 32, True, "rtn", form, level)
        quantize_weights(src, dst, settings, work=tmp_path)
        onnx.checker.check_model(onnx.load(dst), full_check=True)
    got = _run(tmp_path / "portable.onnx", {"x": _x()})
    want = _run(tmp_path / "ort.onnx", {"x": _x()})
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-3)
    portable = onnx.load(tmp_path / "portable.onnx")
    reads = Counter(i for n in portable.graph.node if n.op_type == "MatMul" for i in n.input[1:])
    assert len(portable.graph.node) >= 6
    assert sum(n.op_type == "DequantizeLinear" for n in portable.graph.node) <= 3
    assert max(reads.values()) <= 2


def test_lowering_keeps_a_bias_and_reaches_into_subgraphs(tmp_path: Path) -> None:
    src = tmp_path / "in.onnx"
    onnx.save(_mlp(opset=21), src)
    ort_form = tmp_path / "ort.onnx"
    quantize_weights(
        src, ort_form, WeightOnlySettings(8, 16, False, "rtn", "ort", 0), work=tmp_path
    )
    model = onnx.load(ort_form)
    # a bias on the last MatMulNBits (inputs: A, B, scales, zero points, g_idx, bias)
    last = [n for n in model.graph.node if n.op_type == "MatMulNBits"][-1]
    bias = np.linspace(-1, 1, N2, dtype=np.float32)
    model.graph.initializer.append(onh.from_array(bias, "bias"))
    last.input.extend(["", "bias"])
    # and the whole graph once more inside an If branch
    body = onnx.helper.make_graph(
        [onnx.NodeProto.FromString(n.SerializeToString()) for n in model.graph.node],
        "then",
        [],
        [oh.make_tensor_value_info("y", FLOAT, ["B", "S", N2])],
    )
    for i, node in enumerate(body.node):
        node.output[:] = [f"b_{o}" if o != "y" else "b_y" for o in node.output]
        node.input[:] = [
            f"b_{i}" if i in {o for n in model.graph.node for o in n.output} else i
            for i in node.input
        ]
        node.name = f"b_{i}_{node.name}"
    body.output[0].name = "b_y"
    model.graph.input.append(oh.make_tensor_value_info("cond", onnx.TensorProto.BOOL, []))
    model.graph.node.append(
        oh.make_node("If", ["cond"], ["yy"], then_branch=body, else_branch=body)
    )
    model.graph.output.append(oh.make_tensor_value_info("yy", FLOAT, ["B", "S", N2]))
    with_bias = tmp_path / "bias.onnx"
    onnx.save(model, with_bias)
    lowered = onnx.load(with_bias)
    assert lower_matmul_nbits(lowered) == 6  # 2 in the main graph, 2 per branch
    assert not any(n.domain == "com.microsoft" for n in lowered.graph.node)
    assert not any(n.domain == "com.microsoft" for n in lowered.graph.node[-1].attribute[0].g.node)
    portable = tmp_path / "portable.onnx"
    onnx.save(lowered, portable)
    onnx.checker.check_model(lowered, full_check=True)
    feeds = {"x": _x(), "cond": np.array(True)}
    want = _run(with_bias, feeds)
    got = _run(portable, feeds)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (WeightOnlySettings(4, 24, True, "rtn", "ort"), "power of two"),
        (WeightOnlySettings(3, 32, True, "rtn", "ort"), "4 or 8 bits"),
        (WeightOnlySettings(4, 32, False, "hqq", "portable"), "zero points are floats"),
        (WeightOnlySettings(4, 32, True, "hqq", "ort"), "asymmetric"),
        (WeightOnlySettings(4, 32, True, "rtn", "portable", 4), "ort form only"),
        (WeightOnlySettings(4, 32, True, "gptq", "ort"), "unknown weight algorithm"),
    ],
)
def test_settings_that_cannot_be_built_are_refused(
    tmp_path: Path, settings: WeightOnlySettings, message: str
) -> None:
    src = tmp_path / "in.onnx"
    onnx.save(_mlp(), src)
    with pytest.raises(WeightOnlyError, match=message):
        quantize_weights(src, tmp_path / "out.onnx", settings, work=tmp_path)
    assert not (tmp_path / "out.onnx").exists()


def test_hqq_fits_zero_points_in_the_ort_form(tmp_path: Path) -> None:
    src = tmp_path / "in.onnx"
    onnx.save(_mlp(), src)
    dst = tmp_path / "hqq.onnx"
    quantize_weights(src, dst, WeightOnlySettings(4, 32, False, "hqq", "ort"), work=tmp_path)
    assert _ops(dst)["MatMulNBits"] == 2
    reference = _run(src, {"x": _x()})[0]
    err = np.abs(_run(dst, {"x": _x()})[0] - reference).max() / np.abs(reference).max()
    assert err < 0.2


@pytest.mark.parametrize(
    ("variant", "form", "max_ratio"),
    [
        ("int4-weight", "portable", 0.3),
        ("int4-weight", "ort", 0.3),
        ("int8-weight", "portable", 0.4),
    ],
)
def test_weight_only_variants_build_and_record_their_settings(
    tmp_path: Path, variant: str, form: str, max_ratio: float
) -> None:
    src = tmp_path / "in.onnx"
    onnx.save(_mlp(), src)
    dst = tmp_path / f"{variant}.onnx"
    build = build_variant(src, dst, variant, config=QuantizeConfig(weight_form=form))
    record = build.to_json()
    conversion = record["conversion"]
    assert conversion["bits"] == (4 if variant == "int4-weight" else 8)
    assert conversion["form"] == form and conversion["matmuls_quantized"] == 2
    assert conversion["accuracy_level"] == (4 if form == "ort" else None)
    assert record["config"]["weight_form"] == form
    # graphtrim's clean-up after the conversion leaves the quantized weights quantized
    ops = _ops(dst)
    assert ops["MatMulNBits" if form == "ort" else "DequantizeLinear"] == 2
    assert dst.stat().st_size < max_ratio * src.stat().st_size
    assert record["agreement"]["measured"] and record["agreement"]["cosine"] > 0.99
    # onnxruntime's full optimizations run it (the portable form as fused MatMulNBits)
    got = _run(dst, {"x": _x()}, optimize=True)[0]
    assert got.shape == (2, 5, N2)


def test_a_model_without_matmul_weights_is_a_clear_failure(tmp_path: Path) -> None:
    graph = oh.make_graph(
        [oh.make_node("Relu", ["x"], ["y"])],
        "g",
        [oh.make_tensor_value_info("x", FLOAT, [2, 3])],
        [oh.make_tensor_value_info("y", FLOAT, [2, 3])],
    )
    src = tmp_path / "in.onnx"
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]), src)
    with pytest.raises(QuantizeError, match="no MatMul with a constant"):
        build_variant(src, tmp_path / "out.onnx", "int4-weight")
    assert not (tmp_path / "out.onnx").exists()


def test_cli_builds_int4_weight_and_refuses_bad_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "in.onnx"
    onnx.save(_mlp(), src)
    out = tmp_path / "q.onnx"
    argv = ["quantize", str(src), "-o", str(out), "--variant", "int4-weight", "-q"]
    assert main([*argv, "--block-size", "16", "--weight-asymmetric"]) == 0
    model = onnx.load(out)
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == 2 and all(len(n.input) == 3 for n in dq)  # with zero points
    assert {a.i for n in dq for a in n.attribute if a.name == "block_size"} == {16}
    capsys.readouterr()
    bad = [*argv, "--weight-algorithm", "hqq"]
    assert main(bad) == 2
    assert "HQQ" in capsys.readouterr().err


def test_excluding_every_weight_says_so(tmp_path: Path) -> None:
    """The sensitivity fallback can keep every MatMul in float: the failure says that, not
    that the model has no weights."""
    src = tmp_path / "in.onnx"
    onnx.save(_mlp(), src)
    config = QuantizeConfig(nodes_to_exclude=["mm1", "mm2"])
    with pytest.raises(QuantizeError, match="nothing left to quantize: the 2 node"):
        build_variant(src, tmp_path / "out.onnx", "int4-weight", config=config)
    assert not (tmp_path / "out.onnx").exists()


@pytest.mark.parametrize("algorithm", ["rtn", "hqq"])
def test_weights_are_read_one_at_a_time_and_quantized_as_in_one_pass(
    algorithm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each MatMul's float weight is read from the external data file when its turn comes:
    never more than one is in memory while the quantizer works (a 4 GiB decoder's weights
    held 2.5x their size before). The result is byte for byte what onnxruntime's quantizer
    gives on the whole model at once, unnamed and shared-weight MatMuls included."""
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    model = _mlp(opset=21, shared=True)
    for node in model.graph.node:
        node.name = ""  # the quantizer picks nodes by name: these get names of their own
    src = tmp_path / "in" / "m.onnx"
    src.parent.mkdir()
    onnx.save(model, str(src), save_as_external_data=True, size_threshold=0)
    symmetric = algorithm == "rtn"  # HQQ fits its zero points
    settings = WeightOnlySettings(4, 32, symmetric, algorithm, "ort", accuracy_level=4)

    loaded: list[int] = []
    node_quantizer = (
        mnq.HQQWeightOnlyQuantizer if algorithm == "hqq" else mnq.DefaultWeightOnlyQuantizer
    )
    inner, load = node_quantizer.quantize, onnx.load
    models: list[onnx.ModelProto] = []

    def loading(*args: object, **kwargs: object) -> onnx.ModelProto:
        models.append(load(*args, **kwargs))
        return models[-1]

    def counting(self: object, node: onnx.NodeProto, stack: list[onnx.GraphProto]) -> object:
        # float weights with their data, in the model and in what the quantizer is given
        graphs = [models[0].graph, *stack]
        loaded.append(
            sum(
                t.name in ("w1", "w2") and len(t.raw_data) > 0
                for g in graphs
                for t in g.initializer
            )
        )
        return inner(self, node, stack)

    monkeypatch.setattr(onnx, "load", loading)
    monkeypatch.setattr(node_quantizer, "quantize", counting)
    dst = tmp_path / "q.onnx"
    record = quantize_weights(src, dst, settings)
    monkeypatch.undo()
    assert record["matmuls_quantized"] == 3
    # written tensor by tensor to a data file, never serialized whole
    assert (tmp_path / "q.onnx.data").stat().st_size > 0
    # the weight being quantized alone, w2 (two readers) read again for its second reader
    assert loaded == [1, 1, 1], loaded

    whole = onnx.load(str(src))
    for node in whole.graph.node:
        node.name = ""
    algo = (
        mnq.HQQWeightOnlyQuantConfig(block_size=32, bits=4, op_types_to_quantize=("MatMul",))
        if algorithm == "hqq"
        else mnq.DefaultWeightOnlyQuantConfig(
            block_size=32,
            is_symmetric=True,
            accuracy_level=4,
            op_types_to_quantize=("MatMul",),
            bits=4,
        )
    )
    at_once = mnq.MatMulNBitsQuantizer(
        whole, bits=4, block_size=32, is_symmetric=symmetric, accuracy_level=4, algo_config=algo
    )
    at_once.process()
    want = {t.name: onh.to_array(t) for t in at_once.model.model.graph.initializer}
    got = {t.name: onh.to_array(t) for t in onnx.load(str(dst)).graph.initializer}
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    feeds = {"x": _x()}
    for a, b in zip(
        _run(dst, feeds),
        ort.InferenceSession(
            at_once.model.model.SerializeToString(), providers=["CPUExecutionProvider"]
        ).run(None, feeds),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def _embedding(vocab: int = 500, hidden: int = 64) -> onnx.ModelProto:
    """ids [B, S] -> Gather(table [vocab, hidden]) -> MatMul(w [hidden, 48]) -> y."""
    rng = np.random.default_rng(2)
    table = rng.standard_normal((vocab, hidden)).astype(np.float32)
    w = rng.standard_normal((hidden, 48)).astype(np.float32)
    graph = oh.make_graph(
        [
            oh.make_node("Gather", ["table", "ids"], ["e"], name="embed"),
            oh.make_node("MatMul", ["e", "w"], ["y"], name="proj"),
        ],
        "emb",
        [oh.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["B", "S"])],
        [oh.make_tensor_value_info("y", FLOAT, ["B", "S", 48])],
        initializer=[onh.from_array(table, "table"), onh.from_array(w, "w")],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)])


def test_embedding_tables_are_quantized_on_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--quantize-embeddings``: the Gather's table becomes onnxruntime's
    GatherBlockQuantized with 4-bit blocks along the hidden axis (the float table goes), the
    rows it looks up are the table's within the blocks' rounding; settings the op cannot take
    are refused."""
    src = tmp_path / "in" / "m.onnx"
    src.parent.mkdir()
    onnx.save(_embedding(), str(src), save_as_external_data=True, size_threshold=0)
    dst = tmp_path / "q.onnx"
    settings = WeightOnlySettings(4, 32, True, "rtn", "ort", 4, embeddings=True)
    record = quantize_weights(src, dst, settings)
    assert record["gathers_quantized"] == 1 and record["matmuls_quantized"] == 1
    model = onnx.load(str(dst))
    assert [n.op_type for n in model.graph.node] == ["GatherBlockQuantized", "MatMulNBits"]
    assert "table" not in {t.name for t in model.graph.initializer}
    ids = np.array([[0, 7, 499], [3, 3, 250]], dtype=np.int64)
    want = _run(src, {"ids": ids})[0]
    got = _run(dst, {"ids": ids})[0]
    cos = float((want * got).sum() / np.sqrt((want**2).sum() * (got**2).sum()))
    assert 0.98 < cos < 1
    # without the option the table stays float
    plain = quantize_weights(
        src, tmp_path / "p.onnx", WeightOnlySettings(4, 32, True, "rtn", "ort", 4)
    )
    assert "gathers_quantized" not in plain
    assert "table" in {t.name for t in onnx.load(str(tmp_path / "p.onnx")).graph.initializer}
    for bad in (
        WeightOnlySettings(4, 32, True, "rtn", "portable", embeddings=True),
        WeightOnlySettings(8, 32, True, "rtn", "ort", embeddings=True),
        WeightOnlySettings(4, 32, False, "hqq", "ort", embeddings=True),
    ):
        with pytest.raises(WeightOnlyError, match="embedding tables"):
            quantize_weights(src, tmp_path / "bad.onnx", bad)
    # the command line, and the tag the registered version gets
    out = tmp_path / "cli.onnx"
    argv = ["quantize", str(src), "-o", str(out), "--variant", "int4-weight", "-q"]
    assert main([*argv, "--weight-form", "ort", "--quantize-embeddings"]) == 0
    assert "GatherBlockQuantized" in {n.op_type for n in onnx.load(str(out)).graph.node}
    capsys.readouterr()
    assert main([*argv, "--quantize-embeddings"]) == 2  # the portable form has no such op
    assert "embedding tables" in capsys.readouterr().err
    from graphtrim.stages.version_notes import _conversion_tags

    assert _conversion_tags(record)["graphtrim.weights.embeddings"] == "1"


def test_weights_in_branches_are_quantized_and_a_returned_constant_stays(tmp_path: Path) -> None:
    """A MatMul inside an If branch reads its weight from the main graph (quantized there)
    or from the branch's own initializers; a branch that returns one of its initializers as
    it is keeps it."""
    rng = np.random.default_rng(3)
    outer_w = rng.standard_normal((K, N)).astype(np.float32)
    inner_w = rng.standard_normal((K, N)).astype(np.float32)
    const = np.full((2, 5, N), 0.5, np.float32)
    y = oh.make_tensor_value_info("y", FLOAT, ["B", "S", N])
    then = oh.make_graph(
        [
            oh.make_node("MatMul", ["x", "outer_w"], ["a"], name="mm_outer"),
            oh.make_node("MatMul", ["x", "inner_w"], ["b"], name="mm_inner"),
            oh.make_node("Add", ["a", "b"], ["t"]),
        ],
        "then",
        [],
        [oh.make_tensor_value_info("t", FLOAT, ["B", "S", N])],
        initializer=[onh.from_array(inner_w, "inner_w")],
    )
    other = oh.make_graph(
        [],
        "else",
        [],
        [oh.make_tensor_value_info("c", FLOAT, [2, 5, N])],
        initializer=[onh.from_array(const, "c")],
    )
    graph = oh.make_graph(
        [oh.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)],
        "g",
        [
            oh.make_tensor_value_info("x", FLOAT, ["B", "S", K]),
            oh.make_tensor_value_info("cond", onnx.TensorProto.BOOL, []),
        ],
        [y],
        initializer=[onh.from_array(outer_w, "outer_w")],
    )
    src = tmp_path / "in" / "m.onnx"
    src.parent.mkdir()
    onnx.save(
        oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)]),
        str(src),
        save_as_external_data=True,
        size_threshold=0,
    )
    for form, level in (("ort", 4), ("portable", None)):
        dst = tmp_path / f"{form}.onnx"
        record = quantize_weights(src, dst, WeightOnlySettings(8, 16, True, "rtn", form, level))
        assert record["matmuls_quantized"] == 2
        model = onnx.load(str(dst))
        onnx.checker.check_model(model, full_check=True)
        names = {t.name for t in model.graph.initializer}
        assert "outer_w" not in names
        x = _x()[..., :K]
        for cond in (True, False):
            feeds = {"x": x, "cond": np.array(cond)}
            want, got = _run(src, feeds)[0], _run(dst, feeds)[0]
            if cond:  # 8-bit weights (and, at level 4, activations): close, not equal
                assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.02
            else:
                np.testing.assert_array_equal(got, const)


@pytest.mark.parametrize("form", ["portable", "ort"])
def test_int4_fp16_quantizes_float16_weights_and_computes_in_float16(
    tmp_path: Path, form: str
) -> None:
    """Mixed int4 weights and float16 activations (GPU targets): every MatMul reads float16
    (its weight dequantized to float16 with float16 scales, or MatMulNBits on float16); the
    float32 inputs and outputs stay (keep_io_types)."""
    src = tmp_path / "in.onnx"
    onnx.save(_mlp(opset=21), src)
    dst = tmp_path / "int4-fp16.onnx"
    build = build_variant(src, dst, "int4-fp16", config=QuantizeConfig(weight_form=form))
    record = build.to_json()
    conversion = record["conversion"]
    assert conversion["bits"] == 4 and conversion["form"] == form
    assert conversion["activations"] == "float16" and conversion["matmuls_quantized"] == 2
    model = onnx.load(dst)
    f16 = onnx.TensorProto.FLOAT16
    scales = [t for t in model.graph.initializer if "scale" in t.name]
    assert scales and all(t.data_type == f16 for t in scales)
    assert [i.type.tensor_type.elem_type for i in model.graph.input] == [FLOAT]
    if form == "portable":
        assert _ops(dst)["DequantizeLinear"] == 2 and _ops(dst)["MatMul"] == 2
    else:
        assert _ops(dst)["MatMulNBits"] == 2
    # smaller than int4-weight's float32 scales and activations; close to the float model
    plain = tmp_path / "int4.onnx"
    build_variant(src, plain, "int4-weight", config=QuantizeConfig(weight_form=form))
    size = sum(p.stat().st_size for p in tmp_path.glob("int4-fp16.onnx*"))
    assert size < sum(p.stat().st_size for p in tmp_path.glob("int4.onnx*"))
    assert record["agreement"]["measured"] and record["agreement"]["cosine"] > 0.99
    got = _run(dst, {"x": _x()}, optimize=True)[0]
    want = _run(plain, {"x": _x()}, optimize=True)[0]
    assert got.dtype == np.float32 and got.shape == (2, 5, N2)
    # the same 4-bit grid up to float16 rounding of the weights and the scales
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05 * np.abs(want).max())
