"""The accuracy fallback of the weight-only variants on a small grouped-query decoder: it keeps
only the nodes the converter changes (MatMuls) in float, stops with the last built attempt when
none is left, and a failed gate on a model that predicts its text no better than chance says
which numbers mean something there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from graphtrim.examples import language
from graphtrim.gates.accuracy import accuracy_check
from graphtrim.gates.language import chance_note
from graphtrim.gates.policy import GatePolicy
from graphtrim.quantize import QuantizeConfig
from graphtrim.quantize.build import build_variant
from graphtrim.quantize.sensitivity import NodeError, fallback_nodes

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A 2-layer Qwen2-like decoder (6 query heads over 2 key/value heads, RoPE, RMSNorm;
    random weights) exported with its KV cache, and token ids of a text."""
    from graphtrim.data import input_specs, load_npz
    from graphtrim.exporter import export_causal_lm

    root = tmp_path_factory.mktemp("gqa")
    src = root / "model.onnx"
    info = export_causal_lm(language.qwen2(), src)
    assert info["kv_heads"] == 2 and info["heads"] == 6
    ids = language.tokenizer()(language.zen_text())["input_ids"]
    seq = 24
    n = len(ids) // seq
    np.savez(root / "tokens.npz", input_ids=np.array(ids[: n * seq]).reshape(n, seq))
    return {"src": src, "root": root, "data": load_npz(root / "tokens.npz", input_specs(src))}


def _matmul_weights(path: Path) -> tuple[set[str], set[str]]:
    """The MatMuls reading a float weight, and those reading a dequantized one."""
    graph = onnx.load(str(path)).graph
    weights = {t.name for t in graph.initializer}
    dq = {o for n in graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    mm = [n for n in graph.node if n.op_type == "MatMul"]
    return {n.name for n in mm if n.input[1] in weights}, {n.name for n in mm if n.input[1] in dq}


def test_the_fallback_keeps_only_matmuls_in_float(decoder: dict[str, Any], tmp_path: Path) -> None:
    """The built-in gates (top-1 agreement 0.98) fail on this near-chance model with every
    attempt; each attempt keeps more MatMuls in float and nothing else, and the variant of the
    last attempt is written with its failed check (before, a tenth of every node kept in float
    per attempt, Softmax and RMSNorm ops included, ended in 'nothing left to quantize')."""
    check = accuracy_check(decoder["src"], decoder["data"], GatePolicy(), "int4-weight")
    dst = tmp_path / "int4.onnx"
    built = build_variant(decoder["src"], dst, "int4-weight", accuracy_check=check)
    assert dst.exists() and built.accuracy_passed is False
    assert len(built.attempts) == 3
    kept = [a.excluded for a in built.attempts]
    assert kept[0] == [] and 0 < len(kept[1]) < len(kept[2])
    first = built.attempts[0].measured
    broken = first["broken"]
    assert any(b.startswith("top-1 agreement") for b in broken)
    # the note says why top-1 agreement means little here and what to set instead
    assert any("near-ties" in b and "min_top1_agreement" in b for b in broken)
    assert first["perplexity_ratio"] < 1.05
    # every node kept in float is a MatMul with its weight in float; the others read 4 bits
    floats, quantized = _matmul_weights(dst)
    assert floats == set(kept[2])
    assert len(quantized) == built.conversion["matmuls_quantized"] > 0
    assert "--block-size" in built.to_json()["advice"]


def test_judged_by_perplexity_the_int4_variant_passes(
    decoder: dict[str, Any], tmp_path: Path
) -> None:
    """What the messages tell the user to change is enough: with top-1 agreement left to the
    perplexity ratio (the note) and blocks of 16 (the cosine of the logits: 0.987 with blocks
    of 32, 0.991 with 16), the first attempt passes with every weight in 4 bits."""
    policy = GatePolicy({"variants": {"int4-weight": {"accuracy": {"min_top1_agreement": None}}}})
    check = accuracy_check(decoder["src"], decoder["data"], policy, "int4-weight")
    built = build_variant(
        decoder["src"],
        tmp_path / "int4.onnx",
        "int4-weight",
        config=QuantizeConfig(block_size=16),
        accuracy_check=check,
    )
    assert built.accuracy_passed is True and len(built.attempts) == 1
    assert built.excluded == []


def test_when_every_weight_is_kept_in_float_the_last_built_attempt_stands(
    tmp_path: Path,
) -> None:
    """Two MatMuls and a check nothing passes: attempt 2 keeps one in float, attempt 3 would
    keep both and has nothing to quantize; the build keeps attempt 2's file and says why,
    where it used to fail without a file."""
    from tests.optimizer_core.test_weight_only import _mlp

    src = tmp_path / "in.onnx"
    onnx.save(_mlp(), src)

    def never(path: Path) -> tuple[bool, dict[str, Any]]:
        return False, {"broken": ["never passes"]}

    dst = tmp_path / "out.onnx"
    built = build_variant(src, dst, "int4-weight", accuracy_check=never)
    assert [len(a.excluded) for a in built.attempts] == [0, 1]
    assert built.stopped is not None and "nothing left to quantize" in built.stopped
    assert "attempt 2's variant is kept" in built.stopped
    assert built.conversion["matmuls_quantized"] == 1
    floats, quantized = _matmul_weights(dst)
    assert floats == set(built.excluded) and len(quantized) == 1


def test_fallback_nodes_ranks_only_what_the_converter_changes() -> None:
    def e(name: str, op: str, local: float) -> NodeError:
        return NodeError(name, op, name, local, local)

    ranked = [
        e("norm", "Mul", 0.5),
        e("softmax", "Softmax", 0.4),
        e("q", "MatMul", 0.3),
        e("k", "MatMul", 0.2),
        e("v", "MatMul", 0.0),
    ]
    # a tenth of 3 MatMuls is 1 per attempt; nodes that add no error are never picked
    assert fallback_nodes(ranked, ("MatMul",), 0.1, 1) == ["q"]
    assert fallback_nodes(ranked, ("MatMul",), 0.1, 3) == ["k", "q"]
    assert fallback_nodes(ranked[-1:], ("MatMul",), 0.1, 1) == []
    # a converter that changes every node (fp16, int8): the ranking as it was
    assert fallback_nodes(ranked, None, 0.1, 1) == ["norm"]


def test_the_note_is_for_near_chance_models_only() -> None:
    assert chance_note(309.0, 300) is not None
    assert chance_note(151.0, 300) is not None
    assert chance_note(149.0, 300) is None
    assert chance_note(12.0, 32000) is None
