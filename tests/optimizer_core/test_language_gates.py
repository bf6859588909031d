"""Gates on a language model: perplexity, next-token agreement over every position, greedy
continuation through the KV cache, and decode / prefill latency; token-id data files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from graphtrim.data import input_specs, load_npz
from graphtrim.data_check import DataError, check_data
from graphtrim.examples import language
from graphtrim.exporter import export_causal_lm
from graphtrim.gates.evaluate import evaluate
from graphtrim.gates.language import greedy, perplexity
from graphtrim.gates.policy import GatePolicy
from graphtrim.quantize import QuantizeConfig
from graphtrim.quantize.build import build_variant
from graphtrim.runtime import open_session

SEQ = 24


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama exported with its cache, one with other weights, and the Zen of Python as
    token ids."""
    folder = tmp_path_factory.mktemp("lm")
    ref = folder / "ref" / "model.onnx"
    other = folder / "other" / "model.onnx"
    for path, seed in ((ref, 0), (other, 1)):
        path.parent.mkdir()
        export_causal_lm(language.llama(seed=seed), path)
    ids = language.tokenizer()(language.zen_text())["input_ids"]
    n = len(ids) // SEQ
    tokens = folder / "tokens.npz"
    np.savez(tokens, input_ids=np.array(ids[: n * SEQ], dtype=np.int64).reshape(n, SEQ))
    return {"ref": ref, "other": other, "tokens": tokens}


@pytest.fixture(scope="module")
def int8_weight(lm: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference's int8 weight-only variant, built once for the tests that judge it (they
    only read it)."""
    variant = tmp_path_factory.mktemp("int8-weight") / "int8.onnx"
    build_variant(lm["ref"], variant, "int8-weight", config=QuantizeConfig())
    return variant


def _policy(**accuracy: float) -> GatePolicy:
    return GatePolicy(
        {
            "version": 1,
            "defaults": {
                "accuracy": accuracy,
                "latency": {
                    "runs": 10,
                    "warmup": 2,
                    "blocks": 2,
                    "min_speedup": None,
                    "decode_past": 16,
                    "prefill_tokens": 8,
                },
                "size": False,
            },
        },
        source="test",
    )


def test_token_data_feeds_prefills(lm: dict[str, Path]) -> None:
    specs = input_specs(lm["ref"])
    summary = check_data(lm["tokens"], specs, role="evaluation")
    assert summary["samples"] >= 4
    data = load_npz(lm["tokens"], specs, batch_size=2)
    assert data.tokens is not None and data.tokens.shape[1] == SEQ
    first = data.batches[0]
    assert first["input_ids"].shape == (2, SEQ)
    assert first["attention_mask"].shape == (2, SEQ)
    assert first["past_key_values.0.key"].shape == (2, 2, 0, 16)  # an empty cache


def test_token_files_that_cannot_serve_are_refused(lm: dict[str, Path], tmp_path: Path) -> None:
    specs = input_specs(lm["ref"])
    bad = tmp_path / "bad.npz"
    np.savez(bad, tokens=np.zeros((2, 8), dtype=np.int64))
    with pytest.raises(DataError, match="input_ids"):
        check_data(bad, specs, role="evaluation")
    np.savez(bad, input_ids=np.zeros((2, 1), dtype=np.int64))
    with pytest.raises(DataError, match="nothing to predict"):
        load_npz(bad, specs)


def test_perplexity_is_the_exponent_of_the_next_token_cross_entropy() -> None:
    tokens = np.array([[0, 1, 2]])
    uniform = np.zeros((1, 3, 4))
    assert perplexity(uniform, tokens) == pytest.approx(4.0)
    sure = np.full((1, 3, 4), -50.0)
    sure[0, 0, 1] = sure[0, 1, 2] = 50.0
    assert perplexity(sure, tokens) == pytest.approx(1.0)


def test_greedy_through_the_cache_is_greedy_over_whole_prefixes(lm: dict[str, Path]) -> None:
    sess = open_session(lm["ref"], device="cpu", threads=1)
    prompt = np.array([[5, 17, 42, 7]], dtype=np.int64)
    got = greedy(sess, prompt, 5)
    from graphtrim.runtime import decoder_feeds

    specs = [(i.name, i.type, list(i.shape)) for i in sess.get_inputs()]
    ids = prompt
    for token in got:  # each token is the argmax after the whole prefix, run without a cache
        logits = sess.run(["logits"], decoder_feeds(specs, ids))[0]
        assert int(logits[0, -1].argmax()) == token
        ids = np.concatenate([ids, [[token]]], axis=1)


def test_a_weight_only_variant_is_judged_on_perplexity_greedy_and_decode(
    lm: dict[str, Path], int8_weight: Path
) -> None:
    variant = int8_weight
    specs = input_specs(lm["ref"])
    data = load_npz(lm["tokens"], specs, batch_size=2)
    ev = evaluate(
        lm["ref"],
        {"int8-weight": variant, "other": lm["other"]},
        policy=_policy(
            min_cosine=0.9,
            min_top1_agreement=0.5,
            max_perplexity_ratio=1.05,
            min_greedy_match=0.5,
            max_metric_drop=None,
        ),
        data=data,
    )
    good = ev.variant("int8-weight").gate("accuracy")
    assert good is not None and good.status == "pass", good.reasons
    m = good.measured
    assert m["reference_perplexity"] > 1 and 0.95 < m["perplexity_ratio"] < 1.05
    assert m["top1_agreement"] > 0.9 and m["greedy_match"] > 0.5
    assert len(m["greedy"]) == 4 and len(m["greedy"][0]["reference"]) == 16
    # a model with other weights departs at once and predicts the text no better
    bad = ev.variant("other").gate("accuracy")
    assert bad is not None and bad.status == "fail"
    assert any("greedy match" in r for r in bad.reasons)
    assert any("top-1 agreement" in r for r in bad.reasons)
    # latency: the decode step is judged, the prefill recorded beside it
    lat = ev.variant("int8-weight").gate("latency")
    assert lat is not None and lat.status == "pass"
    assert lat.measured["decode"]["past"] == 16 and lat.measured["decode"]["tokens_per_s"] > 0
    assert lat.measured["prefill"]["tokens"] == 8 and lat.measured["prefill"]["p50_ms"] > 0


def test_without_token_data_perplexity_is_not_claimed(lm: dict[str, Path]) -> None:
    ev = evaluate(lm["ref"], {"same": lm["ref"]}, policy=_policy(max_metric_drop=None))
    gate = ev.variant("same").gate("accuracy")
    assert gate is not None and gate.status == "pass", gate.reasons
    assert gate.measured["reference_perplexity"] is None
    assert gate.measured["top1_agreement"] == 1.0


def _tracked(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[str]:
    """Wrap ``module.name`` (a session opener): each call asserts that no session it opened
    before is still alive, and records the path it opened."""
    import gc
    import weakref

    opened: list[str] = []
    live: list[weakref.ref[object]] = []
    inner = getattr(module, name)

    def opener(path: object, *args: object, **kwargs: object) -> object:
        gc.collect()
        alive = [r() for r in live if r() is not None]
        assert not alive, f"a session is still open when {path} opens: {opened}"
        session = inner(path, *args, **kwargs)
        opened.append(str(path))
        live.append(weakref.ref(session))
        return session

    monkeypatch.setattr(module, name, opener)
    return opened


def test_the_fallback_check_never_holds_the_reference_beside_a_candidate(
    lm: dict[str, Path], int8_weight: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reference runs once, before the first check, and its session goes before a
    candidate's opens: a large decoder's float weights are never in memory twice. The verdict
    is the one ``evaluate`` gives with both sessions open."""
    import graphtrim.runtime
    from graphtrim.gates.accuracy import accuracy_check

    variant = int8_weight
    specs = input_specs(lm["ref"])
    data = load_npz(lm["tokens"], specs, batch_size=2)
    policy = _policy(min_cosine=0.9, min_greedy_match=0.5, max_metric_drop=None)
    want = evaluate(lm["ref"], {"int8-weight": variant}, policy=policy, data=data)
    measured = want.variant("int8-weight").gate("accuracy").measured

    opened = _tracked(monkeypatch, graphtrim.runtime, "open_session")
    check = accuracy_check(lm["ref"], data, policy, "int8-weight")
    for _ in range(2):
        passed, got = check(variant)
        assert passed
        assert got["greedy"] == measured["greedy"]
        assert got["perplexity_ratio"] == pytest.approx(measured["perplexity_ratio"])
    check(lm["other"])
    assert opened == [str(lm["ref"]), str(variant), str(variant), str(lm["other"])]


def test_agreement_runs_the_float_model_then_the_variant(
    lm: dict[str, Path], int8_weight: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from graphtrim.quantize import agreement

    variant = int8_weight
    opened = _tracked(monkeypatch, agreement, "_session")
    same = agreement.measure_agreement(lm["ref"], lm["ref"])
    assert same.measured and same.outputs["logits"]["max_abs_error"] == 0
    near = agreement.measure_agreement(lm["ref"], variant)
    assert near.measured and 0.99 < near.outputs["logits"]["cosine"] < 1
    far = agreement.measure_agreement(lm["ref"], lm["other"])
    assert far.outputs["logits"]["cosine"] < 0.9
    ref = str(lm["ref"])
    assert opened == [ref, ref, ref, str(variant), ref, str(lm["other"])]


def test_models_too_large_to_hold_together_are_judged_one_session_at_a_time(
    lm: dict[str, Path], int8_weight: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above ``max_open_bytes`` no two sessions are ever open at once: the reference's outputs
    and greedy continuations are taken first, each variant is judged in its own session, and
    the latency runs take turns block by block, each session opened afresh. The accuracy
    verdicts are the ones measured with every session open together."""
    import sys

    variant = int8_weight
    data = load_npz(lm["tokens"], input_specs(lm["ref"]), batch_size=2)
    policy = _policy(min_cosine=0.9, min_greedy_match=0.5, max_metric_drop=None)
    variants = {"int8-weight": variant, "other": lm["other"]}
    together = evaluate(lm["ref"], variants, policy=policy, data=data)

    # the module, not the function the package exports under its name
    opened = _tracked(monkeypatch, sys.modules["graphtrim.gates.evaluate"], "open_session")
    alone = evaluate(lm["ref"], variants, policy=policy, data=data, max_open_bytes=1)
    ref, v, other = str(lm["ref"]), str(variant), str(lm["other"])
    blocks = 2  # the policy's; the order of the models rotates every block
    assert opened == [ref, v, other, *[ref, v, other], *[v, other, ref]]
    for name in variants:
        want = together.variant(name).gate("accuracy")
        got = alone.variant(name).gate("accuracy")
        assert want is not None and got is not None
        assert got.status == want.status and got.reasons == want.reasons
        for key in ("greedy", "top1_agreement", "max_abs_error"):
            assert got.measured[key] == want.measured[key], key
        assert got.measured["perplexity_ratio"] == pytest.approx(want.measured["perplexity_ratio"])
        latency = alone.variant(name).gate("latency")
        assert latency is not None and latency.status == "pass", latency
        settings = latency.measured["settings"]
        assert settings["interleaved"] == "blocks" and settings["models"] == 3
        assert settings["sessions_opened"] == blocks * 3
        assert latency.measured["runs"] == 10 and latency.measured["prefill"]["p50_ms"] > 0
        assert len(latency.measured["block_speedups"]) == blocks
    latency = together.variant("other").gate("latency")
    assert latency is not None and latency.measured["settings"]["interleaved"] == "runs"


def test_a_reference_that_cannot_give_the_judged_output_fails_each_variant_alike(
    lm: dict[str, Path],
) -> None:
    """One session at a time or all together: an output the reference lacks is each variant's
    failed accuracy gate, with why, not an error of the whole evaluation."""
    data = load_npz(lm["tokens"], input_specs(lm["ref"]), batch_size=2)
    policy = _policy(output="no_such_output", max_metric_drop=None)  # type: ignore[arg-type]
    verdicts = []
    for bound in (None, 1):
        ev = evaluate(
            lm["ref"], {"other": lm["other"]}, policy=policy, data=data, max_open_bytes=bound
        )
        gate = ev.variant("other").gate("accuracy")
        assert gate is not None and gate.status == "error"
        assert "no output 'no_such_output'" in gate.reasons[0]
        verdicts.append((gate.status, gate.reasons))
    assert verdicts[0] == verdicts[1]
