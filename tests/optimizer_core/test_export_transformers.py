"""The export stage's ``transformers`` flavor: a causal LM with its KV cache as explicit
inputs and outputs (one graph for prefill and decode), and a text encoder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from graphtrim.examples import language
from graphtrim.exporter import ExportError, to_onnx
from graphtrim.optimize_file import optimize_file

LAYERS, KV_HEADS, HEAD = 2, 2, 16


@pytest.fixture(scope="module")
def causal(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, Any]:
    """A tiny Llama (4 query heads over 2 key/value heads) saved with the transformers flavor,
    and its export."""
    folder = tmp_path_factory.mktemp("causal")
    model = language.llama(layers=LAYERS, heads=4, kv_heads=KV_HEADS, hidden=64)
    saved = language.save_transformers(
        model, language.tokenizer(), folder / "mlflow", "text-generation"
    )
    info = to_onnx(saved, folder / "onnx" / "model.onnx")
    return model, folder / "onnx" / "model.onnx", info


def _torch_step(
    model: Any, ids: np.ndarray, past: list[np.ndarray]
) -> tuple[np.ndarray, list[np.ndarray]]:
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for i in range(LAYERS):
        cache.update(torch.from_numpy(past[2 * i]), torch.from_numpy(past[2 * i + 1]), i)
    mask = torch.ones(ids.shape[0], past[0].shape[2] + ids.shape[1], dtype=torch.int64)
    with torch.no_grad():
        out = model(
            input_ids=torch.from_numpy(ids),
            attention_mask=mask,
            past_key_values=cache,
            use_cache=True,
        )
    present = [
        t.numpy() for layer in out.past_key_values.layers for t in (layer.keys, layer.values)
    ]
    return out.logits.numpy(), present


def _feeds(ids: np.ndarray, past: list[np.ndarray]) -> dict[str, np.ndarray]:
    feeds = {
        "input_ids": ids,
        "attention_mask": np.ones((ids.shape[0], past[0].shape[2] + ids.shape[1]), dtype=np.int64),
    }
    for i in range(LAYERS):
        feeds[f"past_key_values.{i}.key"] = past[2 * i]
        feeds[f"past_key_values.{i}.value"] = past[2 * i + 1]
    return feeds


def test_causal_lm_exports_its_kv_cache_with_named_dims(causal: tuple[Any, Path, Any]) -> None:
    _, path, info = causal
    record = info.to_json()
    assert record["flavor"] == "transformers (text-generation)"
    assert record["decoder"]["kv_heads"] == KV_HEADS and record["decoder"]["head_dim"] == HEAD
    proto = onnx.load(path)
    dims = {
        v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in [*proto.graph.input, *proto.graph.output]
    }
    assert dims["input_ids"] == ["batch", "sequence"]
    assert dims["attention_mask"] == ["batch", "total_sequence"]
    for i in range(LAYERS):
        for kv in ("key", "value"):
            assert dims[f"past_key_values.{i}.{kv}"] == ["batch", KV_HEADS, "past_sequence", HEAD]
            assert dims[f"present.{i}.{kv}"][1:] == [KV_HEADS, "past_sequence + sequence", HEAD]
    assert dims["logits"][:2] == ["batch", "sequence"]
    assert {o.domain: o.version for o in proto.opset_import}[""] == 22
    assert record["inputs"][2] == {
        "name": "past_key_values.0.key",
        "dims": dims["past_key_values.0.key"],
    }


@pytest.mark.parametrize(("batch", "past", "seq"), [(1, 0, 6), (1, 6, 1), (2, 4, 3)])
def test_one_graph_serves_prefill_and_decode(
    causal: tuple[Any, Path, Any], batch: int, past: int, seq: int
) -> None:
    model, path, _ = causal
    rng = np.random.default_rng(batch * 100 + past * 10 + seq)
    ids = rng.integers(0, 300, size=(batch, seq)).astype(np.int64)
    cache = [
        rng.standard_normal((batch, KV_HEADS, past, HEAD)).astype(np.float32)
        for _ in range(2 * LAYERS)
    ]
    want_logits, want_present = _torch_step(model, ids, cache)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    got = sess.run(None, _feeds(ids, cache))
    np.testing.assert_allclose(got[0], want_logits, rtol=1e-4, atol=1e-4)
    for g, w in zip(got[1:], want_present, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_a_decode_loop_on_the_export_continues_as_torch_does(causal: tuple[Any, Path, Any]) -> None:
    """Greedy generation: prefill, then one token at a time through the exported cache."""
    import torch

    model, path, _ = causal
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    prompt = np.array([[5, 17, 42, 7]], dtype=np.int64)
    cache = [np.zeros((1, KV_HEADS, 0, HEAD), dtype=np.float32) for _ in range(2 * LAYERS)]
    ids, tokens = prompt, []
    for _ in range(6):
        out = sess.run(None, _feeds(ids, cache))
        nxt = int(out[0][0, -1].argmax())
        tokens.append(nxt)
        cache = out[1:]
        ids = np.array([[nxt]], dtype=np.int64)
    with torch.no_grad():
        ref = model.generate(torch.from_numpy(prompt), max_new_tokens=6, do_sample=False)
    assert tokens == ref[0, prompt.shape[1] :].tolist()


def test_the_export_optimizes_and_verifies_with_decoder_inputs(
    causal: tuple[Any, Path, Any], tmp_path: Path
) -> None:
    _, path, _ = causal
    report = optimize_file(path, tmp_path / "opt.onnx", check=True)
    assert report.verification is not None and report.verification.ok
    assert report.verification.input_shapes["input_ids"][0] == 1
    # the mask spans the cache and the new tokens
    shapes = report.verification.input_shapes
    assert (
        shapes["attention_mask"][1] == shapes["past_key_values.0.key"][2] + shapes["input_ids"][1]
    )
    assert report.after.nodes <= report.before.nodes


def test_at_opset_23_the_decoder_fuses_into_attention_rotary_and_rmsnorm(
    causal: tuple[Any, Path, Any], tmp_path: Path
) -> None:
    """Each layer's attention (KV cache, grouped-query heads, the fully-masked-row guard) is one
    ``Attention``, its Q and K rotations ``RotaryEmbedding``: equal in onnxruntime on a
    left-padded batch (rows that attend to nothing) and on a prefill."""
    from graphtrim.graph.framework import OptimizeOptions

    _, path, _ = causal
    out = tmp_path / "opt23.onnx"
    report = optimize_file(path, out, options=OptimizeOptions(target_opset=23), check=True)
    assert report.verification is not None and report.verification.ok
    proto = onnx.load(out)
    onnx.checker.check_model(proto, full_check=True)
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("Attention") == LAYERS and ops.count("RotaryEmbedding") == 2 * LAYERS
    assert ops.count("RMSNormalization") == 2 * LAYERS + 1
    assert not {"Softmax", "IsNaN", "Neg"} & set(ops)
    attn = [n for n in proto.graph.node if n.op_type == "Attention"]
    assert [list(n.output[1:]) for n in attn] == [
        [f"present.{i}.key", f"present.{i}.value"] for i in range(LAYERS)
    ]
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    opt = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    for batch, past_len, seq in ((2, 3, 4), (3, 0, 5), (2, 6, 1)):
        ids = rng.integers(0, 300, (batch, seq)).astype(np.int64)
        past = [
            rng.standard_normal((batch, KV_HEADS, past_len, HEAD)).astype(np.float32)
            for _ in range(2 * LAYERS)
        ]
        feeds = _feeds(ids, past)
        feeds["attention_mask"][0, : min(past_len + seq - 1, 4)] = 0  # left padding
        for a, b in zip(ref.run(None, feeds), opt.run(None, feeds), strict=True):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)


ARCHITECTURES = {
    # name: (config class, model class, config arguments beyond the shared ones)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_key_value_heads": 2}),
    "phi": ("PhiConfig", "PhiForCausalLM", {"partial_rotary_factor": 0.5}),
    "gpt-neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"rotary_pct": 0.25}),
}


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_other_decoders_fuse_at_opset_23_too(arch: str, tmp_path: Path) -> None:
    """Qwen2 (attention biases), Phi (partial rotary, LayerNorm) and GPT-NeoX (a quarter of each
    head rotated, its own attention code): one Attention per layer, the rotations as
    RotaryEmbedding, equal on a left-padded batch."""
    import torch
    import transformers

    config_cls, model_cls, extra = ARCHITECTURES[arch]
    cfg = getattr(transformers, config_cls)(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        max_position_embeddings=256,
        **extra,
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).eval()
    saved = language.save_transformers(
        model, language.tokenizer(), tmp_path / "mlflow", "text-generation"
    )
    info = to_onnx(saved, tmp_path / "onnx" / "model.onnx")
    kv_heads = info.to_json()["decoder"]["kv_heads"]
    src, out = tmp_path / "onnx" / "model.onnx", tmp_path / "opt.onnx"
    from graphtrim.graph.framework import OptimizeOptions

    optimize_file(src, out, options=OptimizeOptions(target_opset=23), check=True)
    ops = [n.op_type for n in onnx.load(out).graph.node]
    assert ops.count("Attention") == LAYERS and ops.count("RotaryEmbedding") == 2 * LAYERS
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    opt = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds: dict[str, np.ndarray] = {
        "input_ids": rng.integers(0, 300, (2, 3)).astype(np.int64),
        "attention_mask": np.ones((2, 7), dtype=np.int64),
    }
    feeds["attention_mask"][0, :5] = 0
    for i in range(LAYERS):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = rng.standard_normal((2, kv_heads, 4, HEAD)).astype(
                np.float32
            )
    for a, b in zip(ref.run(None, feeds), opt.run(None, feeds), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)


def test_text_encoder_exports_with_dynamic_batch_and_sequence(tmp_path: Path) -> None:
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=300,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
    )
    model = BertModel(cfg).eval()
    saved = language.save_transformers(
        model, language.tokenizer(), tmp_path / "mlflow", "feature-extraction"
    )
    info = to_onnx(saved, tmp_path / "model.onnx")
    assert info.decoder is None and info.exporter == "dynamo"
    sess = ort.InferenceSession(tmp_path / "model.onnx", providers=["CPUExecutionProvider"])
    for batch, seq in ((1, 5), (3, 9)):
        ids = np.random.default_rng(seq).integers(0, 300, size=(batch, seq)).astype(np.int64)
        mask = np.ones_like(ids)
        got = sess.run(None, {"input_ids": ids, "attention_mask": mask})[0]
        with torch.no_grad():
            want = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))[0]
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-4)


def test_a_folder_without_the_model_weights_is_a_clear_error(tmp_path: Path) -> None:
    model = language.llama(layers=1)
    saved = language.save_transformers(
        model, language.tokenizer(), tmp_path / "mlflow", "text-generation"
    )
    for f in (saved / "model").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ExportError, match="cannot load the transformers model"):
        to_onnx(saved, tmp_path / "model.onnx")
    assert not (tmp_path / "model.onnx").exists()
