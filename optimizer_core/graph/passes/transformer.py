"""Decomposed transformer blocks replaced by the standard fused ops the model's opset has.

Each rule matches what exporters emit for the block (operands of commutative ops in either
order, intermediate values read by the pattern alone) and fires only when the model imports an
opset that defines the fused op; ``graphtrim optimize --opset N`` raises the opset first.

- ``layernorm`` (LayerNormalization, opset 17)::

      m = ReduceMean(x, axes=[-1]);  d = x - m;  v = ReduceMean(d * d  or  d ** 2, axes=[-1])
      y = d / Sqrt(v + eps)  (or d * Reciprocal(Sqrt(v + eps)))  [* gamma] [+ beta]

  equals ``LayerNormalization(x, gamma, beta, axis=-1, epsilon=eps)``: the op computes the
  same mean and biased variance, in float32 (``stash_type=1``). Tolerance: relative 1e-5
  (the fused kernel sums in another order).

- ``rmsnorm`` (RMSNormalization, opset 23)::

      y = x / Sqrt(ReduceMean(x ** 2, axes=[-1]) + eps)  [* w]

  equals ``RMSNormalization(x, w, axis=-1, epsilon=eps)``. Tolerance: relative 1e-5.

- ``attention`` (Attention, opset 23)::

      Softmax(Q @ Transpose(K) * scale  [+ mask], axis=-1) @ V

  on rank-4 ``[batch, heads, seq, head]`` float tensors (the scale may sit on the product or
  be split between ``Q`` and ``K``, as exporters of scaled dot-product attention write it;
  ``K`` may arrive as ``[batch, seq, heads, head]`` transposed in one step) equals
  ``Attention(Q, K, V, mask, scale=scale)``. A mask must span the query and key lengths in its
  last two dims (onnxruntime's kernel broadcasts it over batch and heads only). A decoder's KV
  cache (``Concat(past, K)``), grouped-query heads (K and V repeated to the query heads) and a
  guard on fully masked rows (``Where(IsNaN(p), 0, p)``) go into the same op; see
  :mod:`._transformer_attention` for what each needs. Tolerance: relative 1e-5.

- ``rotary`` (RotaryEmbedding, opset 23): ``x * cos + rotate_half(x) * sin`` with the tables
  of ``Concat(f, f)`` angles equals ``RotaryEmbedding(x, Cos(f), Sin(f))``; see
  :mod:`._transformer_rotary`. Tolerance: relative 1e-5. ``rotary-partial``: a rotation of
  the first ``r`` channels concatenated with the rest (Phi, GPT-NeoX) is the op with
  ``rotary_embedding_dim=r``.

- ``gelu-erf`` (Gelu, opset 20): ``x * 0.5 * (1 + Erf(x / sqrt(2)))`` in any association of the
  two products equals ``Gelu(x)``; ``gelu-tanh``:
  ``x * 0.5 * (1 + Tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3)))`` equals
  ``Gelu(x, approximate="tanh")``. Constants must match to 1e-4 relative (exporters round them
  to float32). Tolerance: relative 1e-5.

For the ``tensorrt`` target the Gelu, RMSNormalization, Attention and RotaryEmbedding rules stay
off (TensorRT's parser does not take those ops and fuses the decomposed patterns itself).

The rewritten model differs from the decomposed one by rounding only; the pass is not in the
``safe`` preset.
"""

from __future__ import annotations

import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.passes._transformer_attention import check_attention, fuse_attention
from graphtrim.graph.passes._transformer_gelu import check_gelu, fuse_gelu
from graphtrim.graph.passes._transformer_norm import check_layernorm, check_rmsnorm, fuse_norm
from graphtrim.graph.passes._transformer_rotary import (
    check_partial_rotary,
    check_rotary,
    fuse_partial_rotary,
    fuse_rotary,
)
from graphtrim.graph.rules import Rule, RulePass

_EXCLUSIVE = "; every intermediate value read by the pattern alone"

RULES: tuple[Rule, ...] = (
    Rule(
        "layernorm",
        "m = ReduceMean(x, [-1]); d = x - m; y = d / Sqrt(ReduceMean(d * d or d ** 2, [-1]) + eps) "
        "(or d * Reciprocal(...)) [* gamma] [+ beta] -> LayerNormalization(x, gamma, beta, "
        "axis=-1, epsilon=eps) for float x with a static last dim, eps >= 0 and per-channel "
        "constant gamma, beta (opset 17; rtol 1e-5)" + _EXCLUSIVE,
        ("ReduceMean",),
        check_layernorm,
        fuse_norm,
    ),
    Rule(
        "rmsnorm",
        "y = x / Sqrt(ReduceMean(x ** 2 or x * x, [-1]) + eps) [* w] -> RMSNormalization(x, w, "
        "axis=-1, epsilon=eps) for float x with a static last dim, eps >= 0 and a per-channel "
        "constant w (opset 23, not for tensorrt; rtol 1e-5)" + _EXCLUSIVE,
        ("ReduceMean",),
        check_rmsnorm,
        fuse_norm,
    ),
    Rule(
        "attention",
        "Softmax(Q @ Transpose(K) * scale [+ mask], axis=-1) @ V -> Attention(Q, K, V, mask, "
        "scale=scale) for rank-4 float [batch, heads, seq, head] Q, K, V (scale on the product "
        "or split between Q and K; K may be [batch, seq, heads, head], transposed in one step) "
        "and a float or bool mask whose last two dims are the query and key lengths (opset 23; "
        "rtol 1e-5)" + _EXCLUSIVE,
        ("Softmax",),
        check_attention,
        fuse_attention,
    ),
    Rule(
        "rotary",
        "x * Unsqueeze(Cos(Concat(f, f)) [* s], 1) + Concat(-x[..., D/2:], x[..., :D/2]) * "
        "Unsqueeze(Sin(Concat(f, f)) [* s], 1) -> RotaryEmbedding(x, Cos(f) [* s], Sin(f) [* s]) "
        "for rank-4 float [batch, heads, seq, D] x, D static and even, and angles f of "
        "[1 or batch, seq, D/2] (expanded to x's batch; opset 23, not for tensorrt; rtol 1e-5)"
        + _EXCLUSIVE,
        ("Add",),
        check_rotary,
        fuse_rotary,
    ),
    Rule(
        "rotary-partial",
        "Concat(RotaryEmbedding(x[..., :r], cos, sin), x[..., r:], axis=-1) -> "
        "RotaryEmbedding(x, cos, sin, rotary_embedding_dim=r) for rank-4 x with a static last "
        "dim (opset 23, not for tensorrt; exact)" + _EXCLUSIVE,
        ("Concat",),
        check_partial_rotary,
        fuse_partial_rotary,
    ),
    Rule(
        "gelu-erf",
        "x * 0.5 * (1 + Erf(x / sqrt(2))) in any association of the products -> Gelu(x) for "
        "float x, constants within 1e-4 relative (opset 20, not for tensorrt; rtol 1e-5)"
        + _EXCLUSIVE,
        ("Erf",),
        check_gelu,
        fuse_gelu,
    ),
    Rule(
        "gelu-tanh",
        "x * 0.5 * (1 + Tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3))) -> Gelu(x, "
        'approximate="tanh") for float x, constants within 1e-4 relative (opset 20, not for '
        "tensorrt; rtol 1e-5)" + _EXCLUSIVE,
        ("Tanh",),
        check_gelu,
        fuse_gelu,
    ),
)


class TransformerFusion(RulePass):
    name = "fuse-transformer"
    exact = False
    summary = (
        "decomposed LayerNormalization (opset 17), Gelu (20), RMSNormalization, Attention (with "
        "a KV cache) and RotaryEmbedding (23) replaced by the fused op"
    )
    rules = RULES

    def apply(self, model: ir.Model) -> bool:
        self.opset = u.opset_version(model)
        if self.opset < 17:
            return False
        self._namer: u.NameGenerator | None = None
        self._model = model
        self.fixed_masks: dict[int, ir.Value] = {}  # attention masks given a new fill
        self.rotary_caches: dict[tuple[object, ...], tuple[ir.Value, ir.Value]] = {}
        return super().apply(model)

    def new_name(self, hint: str) -> str:
        """A fresh name; the generator is made on first use (it sees the names made before)."""
        if self._namer is None:
            self._namer = u.NameGenerator(self._model)
        return self._namer(hint)
