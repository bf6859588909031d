"""The pass registry and the named presets.

A preset is an ordered list of pass names. Order follows onnxruntime's experience: cheap local
rewrites first, then folding and fusions, CSE last (measured on the bench suite: the same node
counts in fewer iterations than CSE before folding). Each pass removes the nodes its own
rewrites leave dead; the dead-code pass runs first for what was dead on arrival.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from graphtrim.errors import GraphtrimError
from graphtrim.graph.framework import GraphtrimPass, OptimizeOptions
from graphtrim.graph.passes.activations import RedundantActivations
from graphtrim.graph.passes.algebraic import AlgebraicSimplification
from graphtrim.graph.passes.casts import CastChainElimination
from graphtrim.graph.passes.channel_gather import ChannelGatherFusion
from graphtrim.graph.passes.constant_folding import ConstantFolding
from graphtrim.graph.passes.constants import LiftConstants
from graphtrim.graph.passes.control_flow import ConstantIfInlining
from graphtrim.graph.passes.cse import CommonSubexpressionElimination
from graphtrim.graph.passes.dead_code import DeadCodeElimination
from graphtrim.graph.passes.fusion import AffineFusion
from graphtrim.graph.passes.identity import IdentityElimination
from graphtrim.graph.passes.linear import GemmFusion
from graphtrim.graph.passes.loop_fuse import LoopFusion
from graphtrim.graph.passes.loop_hoist import LoopInvariantHoisting
from graphtrim.graph.passes.loop_unroll import LoopUnrolling
from graphtrim.graph.passes.pad import PadFusion
from graphtrim.graph.passes.qdq import QdqCleanup
from graphtrim.graph.passes.qdq_move import QdqMove
from graphtrim.graph.passes.reassociate import ReassociateConstants
from graphtrim.graph.passes.reshape_infer import ReshapeInference
from graphtrim.graph.passes.residual import ResidualAdd, ResidualSum
from graphtrim.graph.passes.rnn_defaults import RecurrentDefaults
from graphtrim.graph.passes.shapes import SymbolicShapes
from graphtrim.graph.passes.siblings import SiblingMatMulFusion
from graphtrim.graph.passes.space_to_depth import SpaceToDepthBlocks
from graphtrim.graph.passes.transformer import TransformerFusion
from graphtrim.graph.passes.transpose_sink import TransposeSinking

PASSES: dict[str, type[GraphtrimPass]] = {
    cls.name: cls
    for cls in (
        LiftConstants,
        ConstantIfInlining,
        LoopUnrolling,
        LoopInvariantHoisting,
        LoopFusion,
        IdentityElimination,
        RecurrentDefaults,
        CastChainElimination,
        QdqCleanup,
        QdqMove,
        RedundantActivations,
        AlgebraicSimplification,
        ReassociateConstants,
        SymbolicShapes,
        ReshapeInference,
        CommonSubexpressionElimination,
        ConstantFolding,
        AffineFusion,
        SpaceToDepthBlocks,
        ChannelGatherFusion,
        PadFusion,
        SiblingMatMulFusion,
        GemmFusion,
        TransformerFusion,
        TransposeSinking,
        DeadCodeElimination,
        ResidualSum,
        # in no preset: the inverse of residual-sum, kept by the onnxruntime targets where timed
        # faster on their provider
        ResidualAdd,
    )
}

_ORDER = [
    # dead code first, so nodes dead on arrival are credited to it; every other pass then
    # removes the nodes its own rewrites made dead
    "dead-code",
    "lift-constants",
    "if-inline",
    "loop-unroll",
    "loop-hoist",
    "loop-fuse",
    "identity",
    "rnn-defaults",
    "casts",
    "qdq",
    "qdq-move",
    # before the algebraic passes, which turn a Transpose of unit dims into a Reshape
    "transpose-sink",
    # before the algebraic passes: reassociating Gelu's 0.5 with a following constant factor
    # would hide the pattern
    "fuse-transformer",
    "activations",
    "algebraic",
    "reassociate",
    "symbolic-shapes",
    "reshape-infer",
    "constant-folding",
    "fuse-affine",
    "fuse-pad",
    "space-to-depth",
    "fuse-channel-gather",
    "fuse-siblings",
    "fuse-gemm",
    # last: it also merges the constants folding and fusion just made (fewer iterations)
    "cse",
    # finishing (once, after the fixed point): a residual Add in front of a normalization as
    # Sum, which keeps onnxruntime's CPU provider off its 2-4x slower SkipLayerNormalization
    "residual-sum",
]

# passes that save nodes but measured slower on onnxruntime's CPU provider are in ``compact``
# (fewest nodes) and not in ``default``: merged sibling MatMuls 2-3% (BERT, hidden 384,
# sequence 128: the Split copies what three MatMuls wrote in place); Gemm fusion changed which
# nodes the int8 quantizer fuses; data movement on quantized tensors hid a MaxPool and a Gemm
# from onnxruntime's QDQ fusions (1.65x slower int8 digits CNN)
_COMPACT_ONLY = ("fuse-siblings", "fuse-gemm", "qdq-move")

PRESETS: dict[str, list[str]] = {
    "default": [name for name in _ORDER if name not in _COMPACT_ONLY],
    "compact": list(_ORDER),
    # exact passes of ``default``: what quantization runs after its conversion
    "safe": [name for name in _ORDER if PASSES[name].exact and name not in _COMPACT_ONLY],
    "minimal": ["dead-code", "lift-constants", "identity"],
}


def resolve(
    preset: str = "default",
    passes: Sequence[str] | None = None,
    skip: Sequence[str] = (),
) -> list[str]:
    """Pass names to run: ``passes`` if given, else the preset's, minus ``skip``."""
    if passes:
        names = list(passes)
    else:
        if preset not in PRESETS:
            raise GraphtrimError(f"unknown preset '{preset}'; choose one of {', '.join(PRESETS)}")
        names = list(PRESETS[preset])
    unknown = [n for n in [*names, *skip] if n not in PASSES]
    if unknown:
        raise GraphtrimError(f"unknown pass(es) {', '.join(unknown)}; known: {', '.join(PASSES)}")
    return [n for n in names if n not in set(skip)]


def build(names: Sequence[str], options: OptimizeOptions | None = None) -> list[GraphtrimPass]:
    return [PASSES[name](options) for name in names]


def all_rules() -> list[tuple[str, Any]]:
    """Every rule of every pass, as ``(pass name, Rule)`` in registry and table order."""
    return [(name, rule) for name, cls in PASSES.items() for rule in cls.rules]
