"""Decomposed LayerNormalization, RMSNormalization, Gelu, attention and rotary embeddings
replaced by the fused ops."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import (
    assert_equivalent,
    op_types,
    parse,
    rules_fired,
    run_passes,
    written_out_layernorm,
)

TOL = {"rtol": 1e-5, "atol": 1e-5}
DIMS = {"B": 2, "S": 3}
IR = {17: 8, 18: 8, 20: 9, 23: 10}


def _ln(opset: int, *, square: str = "Pow", divide: str = "Div", affine: bool = True, axis=-1):
    axes_attr = opset < 18
    mean = (
        f"ReduceMean<axes = [{axis}], keepdims = 1>(x)"
        if axes_attr
        else "ReduceMean<keepdims = 1>(x, ax)"
    )
    var_in = "sq"
    mean2 = (
        f"ReduceMean<axes = [{axis}], keepdims = 1>({var_in})"
        if axes_attr
        else f"ReduceMean<keepdims = 1>({var_in}, ax)"
    )
    sq = "Pow(d, two)" if square == "Pow" else "Mul(d, d)"
    div = "n = Div(d, sd)" if divide == "Div" else "r = Reciprocal(sd)\n    n = Mul(d, r)"
    tail = "g = Mul(n, gamma)\n    y = Add(beta, g)" if affine else "y = Identity(n)"
    return parse(
        f"""
        <ir_version: {IR[opset]}, opset_import: ["" : {opset}]>
        g (float[B, S, 8] x) => (float[B, S, 8] y)
        <float two = {{2.0}}, float eps = {{1e-5}}, int64[1] ax = {{{axis}}},
         float[8] gamma = {{0.5, 1.0, 1.5, 2.0, -1.0, 0.25, 3.0, 1.0}},
         float[8] beta = {{0.1, 0.2, -0.3, 0.4, 0.0, 1.0, -1.0, 2.0}}>
        {{
            m = {mean}
            d = Sub(x, m)
            sq = {sq}
            v = {mean2}
            ve = Add(v, eps)
            sd = Sqrt(ve)
            {div}
            {tail}
        }}
        """
    )


@pytest.mark.parametrize(
    ("opset", "square", "divide", "affine"),
    [
        (17, "Pow", "Div", True),
        (18, "Mul", "Reciprocal", True),
        (20, "Pow", "Div", False),
    ],
    ids=["opset17-attr-axes", "opset18-input-axes-reciprocal", "no-affine"],
)
def test_layernorm_fused(opset, square, divide, affine):
    proto = _ln(opset, square=square, divide=divide, affine=affine)
    out, result = run_passes(proto, ["fuse-transformer"])
    assert rules_fired(result) == {"layernorm": 1}
    ops = op_types(out)
    assert ops[0] == "LayerNormalization" and "ReduceMean" not in ops
    ln = out.graph.node[0]
    assert len(ln.input) == (3 if affine else 2)
    assert_equivalent(proto, out, **TOL, dim_values=DIMS)


def test_layernorm_needs_opset_17():
    proto = _ln(17)
    proto.opset_import[0].version = 16
    _, result = run_passes(proto, ["fuse-transformer"])
    assert not rules_fired(result)


@pytest.mark.parametrize("width_known", [True, False])
def test_layernorm_of_a_value_of_unknown_rank(width_known):
    """Axes [-1] are the last axis whatever the rank (a Reshape to a shape read at run time),
    and a MatMul by a constant tells the width; without that there is no scale to write."""
    src = "MatMul(r, w)" if width_known else "Relu(r)"
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B, S, 8] x, int64[K] s) => (float y)
        <float two = {{2.0}}, float eps = {{1e-5}},
         float[8, 8] w = {{{", ".join(str((i * 7 % 11) / 10 - 0.5) for i in range(64))}}},
         float[8] gamma = {{0.5, 1.0, 1.5, 2.0, -1.0, 0.25, 3.0, 1.0}}>
        {{
            r = Reshape(x, s)
            h = {src}
            {written_out_layernorm("h")}
            y = Mul(n, gamma)
        }}
        """
    )
    out, result = run_passes(proto, ["fuse-transformer"])
    if not width_known:
        assert not rules_fired(result)
        return
    assert rules_fired(result) == {"layernorm": 1}
    assert "ReduceMean" not in op_types(out)
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    assert_equivalent(proto, out, **TOL, inputs=[{"x": x, "s": np.array([2, 3, 8])}])


def test_layernorm_over_another_axis_is_not_fused():
    proto = _ln(17, axis=1, affine=False)
    out, result = run_passes(proto, ["fuse-transformer"])
    assert not rules_fired(result)
    assert "LayerNormalization" not in op_types(out)


def test_layernorm_with_centered_value_read_elsewhere_is_not_fused():
    proto = _ln(17)
    from onnx import helper

    proto.graph.output.append(
        helper.make_tensor_value_info("d", proto.graph.input[0].type.tensor_type.elem_type, None)
    )
    _, result = run_passes(proto, ["fuse-transformer"])
    assert not rules_fired(result)


def _rms(opset: int) -> object:
    return parse(
        f"""
        <ir_version: {IR[opset]}, opset_import: ["" : {opset}]>
        g (float[B, S, 8] x) => (float[B, S, 8] y)
        <float two = {{2.0}}, float eps = {{1e-6}}, int64[1] ax = {{-1}},
         float[8] w = {{0.5, 1.0, 1.5, 2.0, -1.0, 0.25, 3.0, 1.0}}>
        {{
            sq = Pow(x, two)
            v = ReduceMean<keepdims = 1>(sq, ax)
            ve = Add(v, eps)
            sd = Sqrt(ve)
            r = Reciprocal(sd)
            n = Mul(x, r)
            y = Mul(w, n)
        }}
        """
    )


def test_rmsnorm_fused_at_opset_23():
    proto = _rms(23)
    out, result = run_passes(proto, ["fuse-transformer"])
    assert rules_fired(result) == {"rmsnorm": 1}
    assert op_types(out) == ["RMSNormalization"]
    assert_equivalent(proto, out, **TOL, dim_values=DIMS)


def test_rmsnorm_needs_opset_23():
    _, result = run_passes(_rms(20), ["fuse-transformer"])
    assert not rules_fired(result)


GELU_ERF = {
    "half-first": "h = Mul(x, half)\n y = Mul(h, a)",
    "half-last": "p = Mul(x, a)\n y = Mul(p, half)",
    "half-inner": "q = Mul(a, half)\n y = Mul(x, q)",
}


@pytest.mark.parametrize("form", list(GELU_ERF))
def test_gelu_erf_in_every_association(form):
    proto = parse(
        f"""
        <ir_version: 9, opset_import: ["" : 20]>
        g (float[B, S, 8] x) => (float[B, S, 8] y)
        <float rt2 = {{1.4142135}}, float one = {{1.0}}, float half = {{0.5}}>
        {{
            z = Div(x, rt2)
            e = Erf(z)
            a = Add(e, one)
            {GELU_ERF[form]}
        }}
        """
    )
    out, result = run_passes(proto, ["fuse-transformer"])
    assert rules_fired(result) == {"gelu-erf": 1}
    assert op_types(out) == ["Gelu"]
    assert_equivalent(proto, out, **TOL, dim_values=DIMS)


def _gelu_tanh(opset: int, cubic: float = 0.044715) -> object:
    return parse(
        f"""
        <ir_version: {IR[opset]}, opset_import: ["" : {opset}]>
        g (float[B, S, 8] x) => (float[B, S, 8] y)
        <float three = {{3.0}}, float c = {{{cubic}}}, float k = {{0.7978845608}},
         float one = {{1.0}}, float half = {{0.5}}>
        {{
            h = Mul(half, x)
            p = Pow(x, three)
            cp = Mul(c, p)
            s = Add(x, cp)
            ks = Mul(k, s)
            t = Tanh(ks)
            a = Add(one, t)
            y = Mul(h, a)
        }}
        """
    )


def test_gelu_tanh_fused():
    proto = _gelu_tanh(20)
    out, result = run_passes(proto, ["fuse-transformer"])
    assert rules_fired(result) == {"gelu-tanh": 1}
    assert op_types(out) == ["Gelu"]
    assert out.graph.node[0].attribute[0].s == b"tanh"
    assert_equivalent(proto, out, **TOL, dim_values=DIMS)


def test_gelu_with_wrong_constant_or_old_opset_is_left_alone():
    _, result = run_passes(_gelu_tanh(20, cubic=0.05), ["fuse-transformer"])
    assert not rules_fired(result)
    _, result = run_passes(_gelu_tanh(18), ["fuse-transformer"])
    assert not rules_fired(result)


def test_gelu_inner_value_read_elsewhere_is_left_alone():
    proto = _gelu_tanh(20)
    from onnx import helper

    proto.graph.output.append(helper.make_tensor_value_info("t", 1, None))
    _, result = run_passes(proto, ["fuse-transformer"])
    assert not rules_fired(result)


def test_gelu_from_torch_export_fuses_after_an_opset_upgrade():
    torch = pytest.importorskip("torch")
    import io

    import onnx

    from graphtrim.graph.framework import OptimizeOptions

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.nn.functional.gelu(self.fc(x), approximate="tanh") * 2.0

    buf = io.BytesIO()
    torch.manual_seed(0)
    # opset 18: the TorchScript exporter writes the tanh approximation out (x * x * x)
    torch.onnx.export(Block().eval(), (torch.randn(2, 8),), buf, dynamo=False, opset_version=18)
    proto = onnx.load_from_string(buf.getvalue())
    assert "Tanh" in op_types(proto)

    out, result = run_passes(proto)
    assert "gelu-tanh" not in rules_fired(result)  # Gelu is not in opset 18

    out, result = run_passes(proto, options=OptimizeOptions(target_opset=20))
    assert rules_fired(result)["gelu-tanh"] == 1
    assert out.opset_import[0].version == 20
    assert "Tanh" not in op_types(out) and "Gelu" in op_types(out)
    assert any("opset raised from 18 to 20" in n for n in result.log.notes)
    assert_equivalent(proto, out, **TOL)


def test_opset_upgrade_refuses_an_unknown_opset():
    from graphtrim.errors import GraphtrimError
    from graphtrim.graph.framework import OptimizeOptions

    with pytest.raises(GraphtrimError, match="newer than this onnx knows"):
        run_passes(_gelu_tanh(20), options=OptimizeOptions(target_opset=999))


def _attention(
    opset: int = 23, *, form: str = "split-scale", guard: bool = False, mask: str = "[B, 1, S, S]"
):
    if form == "split-scale":  # dynamo's scaled dot-product attention: sqrt(scale) on both sides
        body = """
            qt = Transpose<perm = [0, 2, 1, 3]>(q)
            kt = Transpose<perm = [0, 2, 3, 1]>(k)
            vt = Transpose<perm = [0, 2, 1, 3]>(v)
            qs = Mul(qt, c)
            ks = Mul(kt, c)
            s = MatMul(qs, ks)
            p = Softmax<axis = -1>(s)
        """
        inputs = "float[B, S, 2, 4] q, float[B, S, 2, 4] k, float[B, S, 2, 4] v"
    else:  # scale after the product, additive mask, K already [batch, heads, seq, head]
        body = """
            qt = Identity(q)
            vt = Identity(v)
            kt = Transpose<perm = [0, 1, 3, 2]>(k)
            s0 = MatMul(qt, kt)
            s1 = Div(s0, d)
            s = Add(s1, mask)
            p = Softmax<axis = -1>(s)
        """
        inputs = f"float[B, 2, S, 4] q, float[B, 2, S, 4] k, float[B, 2, S, 4] v, float{mask} mask"
    tail = (
        "n = IsNaN(p)\n z = Where(n, zero, p)\n y = MatMul(z, vt)" if guard else "y = MatMul(p, vt)"
    )
    out_shape = "[B, 2, S, 4]"
    return parse(
        f"""
        <ir_version: {IR[opset]}, opset_import: ["" : {opset}]>
        g ({inputs}) => (float{out_shape} y)
        <float c = {{0.70710677}}, float d = {{2.0}}, float zero = {{0.0}}>
        {{
            {body}
            {tail}
        }}
        """
    )


@pytest.mark.parametrize("form", ["split-scale", "mask"])
def test_attention_fused_at_opset_23(form):
    proto = _attention(form=form)
    out, result = run_passes(proto, ["fuse-transformer", "identity", "dead-code"])
    assert rules_fired(result)["attention"] == 1
    ops = op_types(out)
    assert "Attention" in ops and "Softmax" not in ops and "MatMul" not in ops
    attn = next(n for n in out.graph.node if n.op_type == "Attention")
    assert abs(attn.attribute[0].f - 0.5) < 1e-6  # 0.7071^2, or 1/2
    assert len(attn.input) == (4 if form == "mask" else 3)
    assert_equivalent(proto, out, **TOL, dim_values={"B": 2, "S": 5})


def test_attention_with_a_nan_guard_is_fused():
    # the op gives a fully masked row zeros, what the guard makes of it
    proto = _attention(guard=True)
    out, result = run_passes(proto, ["fuse-transformer", "dead-code"])
    assert rules_fired(result)["attention"] == 1
    assert not {"IsNaN", "Where", "Softmax"} & set(op_types(out))
    assert_equivalent(proto, out, **TOL, dim_values={"B": 2, "S": 5})


def test_attention_is_not_fused_at_an_old_opset_or_for_tensorrt():
    from graphtrim.graph.framework import OptimizeOptions

    _, result = run_passes(_attention(opset=20), ["fuse-transformer"])
    assert not rules_fired(result)
    _, result = run_passes(
        _attention(), ["fuse-transformer"], options=OptimizeOptions(target="tensorrt")
    )
    assert not rules_fired(result)


def test_attention_with_a_mask_broadcast_over_queries_is_not_fused():
    # onnxruntime's kernel needs the mask's query dim spelled out
    _, result = run_passes(_attention(form="mask", mask="[B, 1, 1, S]"), ["fuse-transformer"])
    assert not rules_fired(result)


def test_attention_probabilities_read_elsewhere_are_not_fused():
    proto = _attention()
    from onnx import helper

    proto.graph.output.append(helper.make_tensor_value_info("p", 1, None))
    _, result = run_passes(proto, ["fuse-transformer"])
    assert not rules_fired(result)


def _rotary(*, angles_batch: str = "1", scale: bool = False, partial: bool = False):
    """transformers' ``apply_rotary_pos_emb`` on Q and K sharing one angle tensor."""
    half, d = (2, 8) if partial else (4, 8)  # partial: the halves do not meet at D/2
    cos = "cr = Cos(emb)\n c = Mul(cr, sc)" if scale else "c = Cos(emb)"
    sin = "sr = Sin(emb)\n s = Mul(sr, sc)" if scale else "s = Sin(emb)"
    rot = "\n".join(
        f"""
            {v}1 = Slice({v}, z, h, ax)
            {v}2 = Slice({v}, h, big, ax)
            {v}n = Neg({v}2)
            {v}r = Concat<axis = -1>({v}n, {v}1)
            {v}a = Mul({v}, cu)
            {v}b = Mul({v}r, su)
            {v}y = Add({v}a, {v}b)
        """
        for v in ("q", "k")
    )
    return parse(
        f"""
        <ir_version: 10, opset_import: ["" : 23]>
        g (float[B, 4, S, {d}] q, float[B, 2, S, {d}] k, float[{angles_batch}, S, 4] f)
            => (float[B, 4, S, {d}] qy, float[B, 2, S, {d}] ky)
        <int64[1] z = {{0}}, int64[1] h = {{{half}}}, int64[1] big = {{9223372036854775807}},
         int64[1] ax = {{3}}, int64[1] one = {{1}}, float sc = {{0.75}}>
        {{
            emb = Concat<axis = -1>(f, f)
            {cos}
            {sin}
            cu = Unsqueeze(c, one)
            su = Unsqueeze(s, one)
            {rot}
        }}
        """
    )


@pytest.mark.parametrize(
    ("angles_batch", "scale"), [("1", False), ("B", True)], ids=["batch-1-angles", "scaled"]
)
def test_rotary_embedding_fused_with_shared_tables(angles_batch, scale):
    proto = _rotary(angles_batch=angles_batch, scale=scale)
    out, result = run_passes(proto, ["fuse-transformer", "dead-code"])
    assert rules_fired(result)["rotary"] == 2
    ops = op_types(out)
    assert ops.count("RotaryEmbedding") == 2
    # the half-size tables once for both, expanded to the batch only where the angles lack it
    assert ops.count("Cos") == 1 and ops.count("Sin") == 1
    assert ops.count("Expand") == (2 if angles_batch == "1" else 0)
    assert not {"Slice", "Neg", "Unsqueeze"} & set(ops)
    assert_equivalent(proto, out, **TOL, dim_values={"B": 3, "S": 5})


def test_rotary_with_halves_not_at_the_middle_is_not_fused():
    _, result = run_passes(_rotary(partial=True), ["fuse-transformer"])
    assert "rotary" not in rules_fired(result)


def _partial_rotary():
    """Phi's and GPT-NeoX's partial rotation: the first 8 of 16 channels rotated, the rest
    passed, on Q and K."""
    parts = "\n".join(
        f"""
            {v}x = Slice({v}, z, eight, ax)
            {v}p = Slice({v}, eight, big, ax)
            {v}1 = Slice({v}x, z, h, ax)
            {v}2 = Slice({v}x, h, big, ax)
            {v}n = Neg({v}2)
            {v}r = Concat<axis = -1>({v}n, {v}1)
            {v}a = Mul({v}x, cu)
            {v}b = Mul({v}r, su)
            {v}e = Add({v}a, {v}b)
            {v}y = Concat<axis = -1>({v}e, {v}p)
        """
        for v in ("q", "k")
    )
    return parse(
        f"""
        <ir_version: 10, opset_import: ["" : 23]>
        g (float[B, 4, S, 16] q, float[B, 4, S, 16] k, float[1, S, 4] f)
            => (float[B, 4, S, 16] qy, float[B, 4, S, 16] ky)
        <int64[1] z = {{0}}, int64[1] h = {{4}}, int64[1] eight = {{8}},
         int64[1] big = {{9223372036854775807}}, int64[1] ax = {{-1}}, int64[1] one = {{1}}>
        {{
            emb = Concat<axis = -1>(f, f)
            c = Cos(emb)
            s = Sin(emb)
            cu = Unsqueeze(c, one)
            su = Unsqueeze(s, one)
            {parts}
        }}
        """
    )


def test_a_partial_rotation_is_one_rotary_embedding_with_its_width(tmp_path):
    import onnx
    import onnxruntime as ort

    from graphtrim.graph.framework import OptimizeOptions
    from graphtrim.optimize_file import optimize_file

    proto = _partial_rotary()
    out, result = run_passes(proto, ["fuse-transformer", "dead-code"])
    fired = rules_fired(result)
    assert fired["rotary"] == 2 and fired["rotary-partial"] == 2
    ropes = [n for n in out.graph.node if n.op_type == "RotaryEmbedding"]
    assert len(ropes) == 2 and not {"Slice", "Neg"} & set(op_types(out))
    assert op_types(out).count("Concat") == 1  # the batch the tables are expanded to
    assert all(a.name == "rotary_embedding_dim" and a.i == 8 for n in ropes for a in n.attribute)
    assert_equivalent(proto, out, **TOL, dim_values={"B": 2, "S": 3})
    # through the whole optimizer (passes run to a fixed point, each run naming new nodes):
    # the file onnxruntime loads has no node name twice
    src, dst = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(proto, src)
    optimize_file(src, dst, options=OptimizeOptions(), check=True)
    names = [n.name for n in onnx.load(dst).graph.node if n.name]
    assert len(names) == len(set(names))
    ort.InferenceSession(str(dst), providers=["CPUExecutionProvider"])


def _decoder_attention(
    *, fill: float = -3.4028234663852886e38, guard: bool = True, gqa: bool = True
):
    """A decoder's attention as torch's exporter writes transformers' SDPA path: KV cache
    concatenated, K and V repeated to the query heads, the mask from a boolean condition with
    a -FLT_MAX fill, the fully-masked-row guard."""
    from onnx import TensorProto, helper, numpy_helper

    hq, hk = (4, 2) if gqa else (2, 2)
    n = hq // hk
    total = "(P+S)"
    f = TensorProto.FLOAT
    ins = [
        helper.make_tensor_value_info("q", f, ["B", hq, "S", 8]),
        helper.make_tensor_value_info("k", f, ["B", hk, "S", 8]),
        helper.make_tensor_value_info("v", f, ["B", hk, "S", 8]),
        helper.make_tensor_value_info("past_k", f, ["B", hk, "P", 8]),
        helper.make_tensor_value_info("past_v", f, ["B", hk, "P", 8]),
        helper.make_tensor_value_info("cond", TensorProto.BOOL, ["B", 1, "S", total]),
    ]
    outs = [
        helper.make_tensor_value_info("y", f, ["B", hq, "S", 8]),
        helper.make_tensor_value_info("present_k", f, ["B", hk, "P + S", 8]),
        helper.make_tensor_value_info("present_v", f, ["B", hk, "P + S", 8]),
    ]
    consts = {
        "c": np.array(0.59460354, np.float32),  # 8 ** -0.25 on each side
        "zero": np.array(0.0, np.float32),
        "fill": np.array(fill, np.float32),
        "two": np.array([2], np.int64),
        "grow": np.array([1, hk, n, 1, 8], np.int64),
        "heads": np.array([0, hq, -1, 8], np.int64),
    }
    nodes = [
        helper.make_node("Concat", ["past_k", "k"], ["present_k"], axis=2),
        helper.make_node("Concat", ["past_v", "v"], ["present_v"], axis=2),
    ]
    kv = {}
    for t in ("k", "v"):
        if gqa:
            nodes += [
                helper.make_node("Unsqueeze", [f"present_{t}", "two"], [f"{t}u"]),
                helper.make_node("Expand", [f"{t}u", "grow"], [f"{t}e"]),
                helper.make_node("Reshape", [f"{t}e", "heads"], [f"{t}r"]),
            ]
            kv[t] = f"{t}r"
        else:
            kv[t] = f"present_{t}"
    nodes += [
        helper.make_node("Transpose", [kv["k"]], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("Mul", ["q", "c"], ["qs"]),
        helper.make_node("Mul", ["kt", "c"], ["ks"]),
        helper.make_node("MatMul", ["qs", "ks"], ["s"]),
        helper.make_node("Where", ["cond", "zero", "fill"], ["mask"]),
        helper.make_node("Add", ["s", "mask"], ["sm"]),
        helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
    ]
    if guard:
        nodes += [
            helper.make_node("IsNaN", ["p"], ["nan"]),
            helper.make_node("Where", ["nan", "zero", "p"], ["pz"]),
        ]
    nodes.append(helper.make_node("MatMul", ["pz" if guard else "p", kv["v"]], ["y"]))
    graph = helper.make_graph(
        nodes, "g", ins, outs, [numpy_helper.from_array(a, k) for k, a in consts.items()]
    )
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 23)])


def _decoder_feeds(batch: int = 2, past: int = 3, seq: int = 4, gqa: bool = True):
    """Inputs whose condition left-pads batch 0: its first query rows attend to nothing."""
    hq, hk = (4, 2) if gqa else (2, 2)
    rng = np.random.default_rng(0)
    feeds = {
        "q": rng.standard_normal((batch, hq, seq, 8)).astype(np.float32),
        "k": rng.standard_normal((batch, hk, seq, 8)).astype(np.float32),
        "v": rng.standard_normal((batch, hk, seq, 8)).astype(np.float32),
        "past_k": rng.standard_normal((batch, hk, past, 8)).astype(np.float32),
        "past_v": rng.standard_normal((batch, hk, past, 8)).astype(np.float32),
    }
    keep = np.ones((batch, past + seq), bool)
    keep[0, : past + 2] = False  # padding
    causal = np.arange(past + seq)[None, :] <= past + np.arange(seq)[:, None]
    feeds["cond"] = (keep[:, None, None, :] & causal[None, None]).copy()
    assert not feeds["cond"][0, 0, 0].any()  # a fully masked row
    return feeds


@pytest.mark.parametrize("gqa", [True, False], ids=["grouped-query", "multi-head"])
def test_decoder_attention_takes_the_cache_the_repeat_and_the_guard(gqa):
    proto = _decoder_attention(gqa=gqa)
    out, result = run_passes(proto, ["fuse-transformer", "dead-code"])
    assert rules_fired(result)["attention"] == 1
    ops = op_types(out)
    assert ops.count("Attention") == 1
    assert not {"Softmax", "MatMul", "IsNaN", "Expand", "Unsqueeze", "Concat"} & set(ops)
    attn = next(n for n in out.graph.node if n.op_type == "Attention")
    assert list(attn.input[4:]) == ["past_k", "past_v"]
    assert list(attn.output[1:]) == ["present_k", "present_v"]
    feeds = [_decoder_feeds(gqa=gqa), _decoder_feeds(batch=1, past=0, seq=5, gqa=gqa)]
    assert_equivalent(proto, out, **TOL, inputs=feeds)


def test_a_minus_flt_max_fill_is_moved_off_what_onnxruntime_reads_as_masked():
    """onnxruntime's kernel gives a row filled with exactly -FLT_MAX throughout zeros, the
    decomposed form the mean of V: the fused op gets the next float as its fill."""
    import onnxruntime as ort

    from graphtrim.graph.passes._transformer_attention import _LOWEST

    proto = _decoder_attention()
    out, _ = run_passes(proto, ["fuse-transformer", "dead-code"])
    fill = next(n for n in out.graph.node if n.op_type == "Where").input[2]
    value = next(t for t in out.graph.initializer if t.name == fill)
    from onnx import numpy_helper

    assert numpy_helper.to_array(value) == np.nextafter(_LOWEST, np.float32(0))
    # the reason: the op with -FLT_MAX itself zeroes the left-padded rows
    value.CopyFrom(numpy_helper.from_array(np.array(_LOWEST, np.float32), fill))
    feeds = _decoder_feeds()
    ref = ort.InferenceSession(proto.SerializeToString()).run(["y"], feeds)[0]
    raw = ort.InferenceSession(out.SerializeToString()).run(["y"], feeds)[0]
    assert not np.allclose(ref[0, :, 0], raw[0, :, 0], atol=1e-3)
    assert np.allclose(raw[0, :, 0], 0.0)
    assert np.allclose(ref[1], raw[1], atol=1e-5)  # rows that attend to something agree


def test_decoder_attention_with_an_unproved_repeat_is_not_fused():
    from onnx import numpy_helper

    proto = _decoder_attention()
    grow = next(t for t in proto.graph.initializer if t.name == "grow")
    grow.CopyFrom(numpy_helper.from_array(np.array([1, 2, 2, 3, 8], np.int64), "grow"))
    _, result = run_passes(proto, ["fuse-transformer"])
    assert "attention" not in rules_fired(result)


def test_a_float_mask_holding_minus_flt_max_keeps_fully_masked_rows():
    """An additive mask given as it is (eager BERT's ``(1 - m) * -FLT_MAX``, here a graph
    input): the fused op reads ``Max(mask, next float)``, so a row masked throughout is the mean
    of V in onnxruntime too; under the guard such a mask is not fused at all."""
    proto = _attention(form="mask", mask="[B, 1, S, S]")
    out, result = run_passes(proto, ["fuse-transformer", "dead-code"])
    assert rules_fired(result)["attention"] == 1 and "Max" in op_types(out)
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal((2, 2, 3, 4)).astype(np.float32) for n in ("q", "k", "v")}
    mask = np.zeros((2, 1, 3, 3), np.float32)
    mask[0, 0, 1, :] = np.finfo(np.float32).min  # a row masked throughout
    mask[1, 0, :, 2] = np.finfo(np.float32).min
    feeds["mask"] = mask
    assert_equivalent(proto, out, **TOL, inputs=[feeds])
    guarded = _attention(form="mask", mask="[B, 1, S, S]", guard=True)
    _, result = run_passes(guarded, ["fuse-transformer"])
    assert "attention" not in rules_fired(result)
