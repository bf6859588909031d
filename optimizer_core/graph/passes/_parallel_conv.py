"""Matchers of the parallel-branch fusions of ``fuse-affine``: a sum (or difference) of Convs
that read one input, or of a Conv and that input itself (or a BatchNormalization of it), is one
Conv.

This is the structural re-parameterization that RepVGG, MobileOne, RepViT and FastViT apply by
hand once training is done; exported without it, their blocks keep a 3x3 Conv, a 1x1 Conv and an
identity (or BatchNormalization) branch side by side. Convolution is linear in its weight, so
with the same input, strides, dilations and group:

- ``Conv(x, Wa, Ba) + Conv(x, Wb, Bb) = Conv(x, Wa + Wb', Ba + Bb)`` where ``Wb'`` is ``Wb``
  zero-padded to ``Wa``'s window. Output position ``i`` of a Conv with begin pad ``p`` and
  dilation ``d`` reads tap ``t`` at input ``s*i + t*d - p``, so ``Wb``'s tap ``t`` is ``Wa``'s
  tap ``t + (pa - pb) / d``: the merge needs that offset to be a whole tap, ``Wb``'s window
  inside ``Wa``'s, and the end pads to match (then the output sizes are equal). A window that
  contains neither of the two (1x3 and 3x1) would make a larger kernel: declined.
- ``Conv(x, W, B) + x = Conv(x, W + I, B)``: with stride 1, an output as large as the input
  (``p_begin + p_end = d * (k - 1)``) and as many output as input channels, output channel ``o``
  reads input channel ``o`` through ``W[o, o mod (C / group)]`` at the tap ``p_begin / d``; that
  tap gains 1.
- ``Conv(x, W, B) + BatchNormalization(x) = Conv(x, W + diag(k), B + beta - mean * k)`` with
  ``k = gamma / sqrt(var + eps)``, the same tap (an inference-mode BatchNormalization is
  ``k * x + beta - mean * k`` per channel).
- a difference (``Sub``) is the same with the second term's weight and bias negated (FastViT's
  ``mixer(x) - norm(x)``).

The merged weight is summed in float64 and rounded once to the weight's type, so results differ
by rounding only. The Convs' outputs must be read by the sum alone (a BatchNormalization read by
others too stays for them), and the weight that takes the sum by its Conv alone (a merged copy
beside a shared weight would grow the model).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.passes._affine import affine_input, bn_scale_shift


@dataclasses.dataclass
class ConvBranch:
    node: ir.Node
    w: np.ndarray
    b: np.ndarray | None
    # begin pads then end pads, one per spatial axis
    pads: list[int]
    strides: list[int]
    dilations: list[int]
    group: int


@dataclasses.dataclass
class ParallelMatch:
    """The Conv that stays (``host``) with its new weight and bias, and the branch node that
    goes (another Conv or a BatchNormalization; ``None`` for the input itself)."""

    host: ConvBranch
    w: np.ndarray
    b: np.ndarray | None
    other: ir.Node | None


def conv_branch(value: ir.Value) -> ConvBranch | str:
    """The Conv that computes ``value``, read by one node, with constant weight and bias."""
    conv = value.producer()
    if conv is None or not u.is_op(conv, "Conv"):
        return "not a Conv's output"
    if not u.single_consumer(value):
        return "the Conv's output has other readers"
    if len(conv.inputs) < 2 or conv.inputs[0] is None:
        return "the Conv has no input or weight"
    w = u.const_array(conv.inputs[1])
    if w is None or w.dtype.kind != "f" or w.ndim < 3:
        return "the weight is not a constant float tensor"
    b = None
    if len(conv.inputs) > 2 and conv.inputs[2] is not None:
        b = u.const_array(conv.inputs[2])
        if b is None or b.shape != (w.shape[0],):
            return "the bias is not a constant vector of the output channels"
    n = w.ndim - 2
    auto_pad = conv.attributes.get_string("auto_pad", "NOTSET")
    if auto_pad not in ("NOTSET", "VALID"):
        return f"the padding is automatic ({auto_pad})"
    kernel = conv.attributes.get_ints("kernel_shape", None)
    if kernel is not None and list(kernel) != list(w.shape[2:]):
        return "kernel_shape differs from the weight's"
    pads = [0] * (2 * n) if auto_pad == "VALID" else conv.attributes.get_ints("pads", [0] * (2 * n))
    strides = conv.attributes.get_ints("strides", [1] * n)
    dilations = conv.attributes.get_ints("dilations", [1] * n)
    group = conv.attributes.get_int("group", 1)
    if len(pads) != 2 * n or len(strides) != n or len(dilations) != n or group < 1:
        return "pads, strides or dilations do not match the weight's rank"
    return ConvBranch(conv, w, b, list(pads), list(strides), list(dilations), group)


def _offsets(big: ConvBranch, small: ConvBranch) -> list[int] | None:
    """Per spatial axis, the tap of ``big`` where ``small``'s window starts, when ``small``'s
    window lies inside ``big``'s and the end pads agree; else ``None``."""
    n = big.w.ndim - 2
    out = []
    for axis in range(n):
        dil = big.dilations[axis]
        kb, ks = big.w.shape[2 + axis], small.w.shape[2 + axis]
        begin = big.pads[axis] - small.pads[axis]
        end = big.pads[n + axis] - small.pads[n + axis]
        if begin % dil or end % dil:
            return None
        d = begin // dil
        if d < 0 or d + ks > kb or end // dil != kb - ks - d:
            return None
        out.append(d)
    return out


def _exclusive(conv: ConvBranch) -> bool:
    w = conv.node.inputs[1]
    return (
        w is not None and not w.is_graph_output() and all(user is conv.node for user, _ in w.uses())
    )


def _sum_bias(*terms: tuple[float, np.ndarray | None]) -> np.ndarray | None:
    """The signed sum of the biases present (``None`` when none is)."""
    present = [sign * b.astype(np.float64) for sign, b in terms if b is not None]
    return None if not present else np.sum(present, axis=0)


def match_pair(a: ConvBranch, sa: float, b: ConvBranch, sb: float) -> ParallelMatch | str:
    """``sa * Conv(x, Wa) + sb * Conv(x, Wb)`` (signs of a sum or a difference) as the Conv
    whose window contains the other's."""
    if a.node.inputs[0] is not b.node.inputs[0]:
        return "the Convs read different inputs"
    if a.w.dtype != b.w.dtype or a.w.ndim != b.w.ndim:
        return "the weights differ in type or rank"
    if a.group != b.group or a.w.shape[:2] != b.w.shape[:2]:
        return "the Convs differ in group or channels"
    if a.strides != b.strides or a.dilations != b.dilations:
        return "the Convs differ in strides or dilations"
    for (host, sh), (guest, sg) in (((a, sa), (b, sb)), ((b, sb), (a, sa))):
        offsets = _offsets(host, guest)
        if offsets is None:
            continue
        if not _exclusive(host):
            return (
                "the weight that would take the sum is shared (a merged copy would grow the model)"
            )
        w = sh * host.w.astype(np.float64)
        window = tuple(slice(d, d + k) for d, k in zip(offsets, guest.w.shape[2:], strict=True))
        w[(slice(None), slice(None), *window)] += sg * guest.w.astype(np.float64)
        return ParallelMatch(host, w, _sum_bias((sh, host.b), (sg, guest.b)), guest.node)
    return "neither Conv's window contains the other's (a merge would enlarge the kernel)"


def _centre(conv: ConvBranch) -> tuple[int, ...] | str:
    """The tap through which output position ``i`` reads input position ``i``, when the Conv
    keeps the input's size and channels."""
    c_out, c_in_g = conv.w.shape[:2]
    if c_out != c_in_g * conv.group:
        return "the Conv changes the number of channels"
    n = conv.w.ndim - 2
    taps = []
    for axis in range(n):
        k, dil = conv.w.shape[2 + axis], conv.dilations[axis]
        begin, end = conv.pads[axis], conv.pads[n + axis]
        if conv.strides[axis] != 1:
            return "the Conv is strided"
        if begin + end != dil * (k - 1) or begin % dil:
            return "the Conv's output is not aligned with its input"
        taps.append(begin // dil)
    return tuple(taps)


def match_diagonal(
    conv: ConvBranch,
    sign: float,
    scale: np.ndarray,
    shift: np.ndarray,
    other: ir.Node | None,
) -> ParallelMatch | str:
    """``sign * Conv(x, W, B) + (scale * x + shift)`` per channel as one Conv (the diagonal
    term's sign is in ``scale`` and ``shift``)."""
    centre = _centre(conv)
    if isinstance(centre, str):
        return centre
    if not _exclusive(conv):
        return "the weight is shared (a merged copy would grow the model)"
    c_out, c_in_g = conv.w.shape[:2]
    w = sign * conv.w.astype(np.float64)
    o = np.arange(c_out)
    w[(o, o % c_in_g, *centre)] += scale
    b = _sum_bias((sign, conv.b), (1.0, shift if np.any(shift) else None))
    return ParallelMatch(conv, w, b, other)


def check_sum(node: ir.Node, kind: str) -> ParallelMatch | str:
    """The match of ``kind`` (``"conv"``, ``"identity"`` or ``"bn"``) for the Add or Sub
    ``node``."""
    if len(node.inputs) != 2:
        return "not a sum of two values"
    first, second = node.inputs
    if first is None or second is None:
        return "not a sum of two values"
    if first is second:
        return "both terms are the same value"
    s2 = -1.0 if node.op_type == "Sub" else 1.0
    reasons = []
    for (p, sp), (q, sq) in (((first, 1.0), (second, s2)), ((second, s2), (first, 1.0))):
        conv = conv_branch(p)
        if isinstance(conv, str):
            reasons.append(conv)
            continue
        x = conv.node.inputs[0]
        if kind == "conv":
            other = conv_branch(q)
            if isinstance(other, str):
                reasons.append(f"the other term: {other}")
                continue
            return match_pair(conv, sp, other, sq)
        if kind == "identity":
            if q is not x:
                reasons.append("the other term is not the Conv's input")
                continue
            c = conv.w.shape[0]
            return match_diagonal(conv, sp, np.full(c, sq), np.zeros(c), None)
        bn = q.producer()
        if bn is None or not u.is_op(bn, "BatchNormalization") or affine_input(bn) is not x:
            reasons.append("the other term is not a BatchNormalization of the Conv's input")
            continue
        ss = bn_scale_shift(bn, conv.w.shape[0])
        if ss is None:
            return "the BatchNormalization's parameters are not constant vectors of the channels"
        # a normalization with other readers stays for them; the sum still goes
        return match_diagonal(
            conv, sp, sq * ss[0], sq * ss[1], bn if u.single_consumer(q) else None
        )
    return "; ".join(dict.fromkeys(reasons))
