"""Decomposed LayerNormalization, RMSNormalization and Gelu replaced by the fused ops."""

from __future__ import annotations

import pytest

from tests.helpers import assert_equivalent, op_types, parse, rules_fired, run_passes

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


def test_attention_is_not_fused_with_a_nan_guard_old_opset_or_for_tensorrt():
    from graphtrim.graph.framework import OptimizeOptions

    _, result = run_passes(_attention(guard=True), ["fuse-transformer"])
    assert not rules_fired(result)
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
