"""Examples of the transformer fusions' rules (pass ``fuse-transformer``)."""

from __future__ import annotations

import onnx

from tests.helpers import parse
from tests.optimizer_core.graph.rule_examples import Example
from tests.optimizer_core.graph.test_transformer import (
    _attention,
    _gelu_tanh,
    _ln,
    _partial_rotary,
    _rms,
    _rotary,
)

# the fused kernels sum in another order
_TOL = {"rtol": 1e-5, "atol": 1e-5}


def _gelu_erf() -> onnx.ModelProto:
    return parse(
        """
        <ir_version: 9, opset_import: ["" : 20]>
        g (float[B, S, 8] x) => (float[B, S, 8] y)
        <float rt2 = {1.4142135}, float one = {1.0}, float half = {0.5}>
        {
            z = Div(x, rt2)
            e = Erf(z)
            a = Add(e, one)
            h = Mul(x, half)
            y = Mul(h, a)
        }
        """
    )


EXAMPLES = {
    ("fuse-transformer", "layernorm"): Example(model=lambda: _ln(17), **_TOL),
    ("fuse-transformer", "rmsnorm"): Example(model=lambda: _rms(23), **_TOL),
    ("fuse-transformer", "attention"): Example(model=lambda: _attention(form="mask"), **_TOL),
    ("fuse-transformer", "rotary"): Example(model=_rotary, **_TOL),
    ("fuse-transformer", "rotary-partial"): Example(model=_partial_rotary, **_TOL),
    ("fuse-transformer", "gelu-erf"): Example(model=_gelu_erf, **_TOL),
    ("fuse-transformer", "gelu-tanh"): Example(model=lambda: _gelu_tanh(20), **_TOL),
}
