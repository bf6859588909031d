"""Small language models built offline: a byte-level BPE tokenizer trained on a text Python
ships (``this``), and ``transformers`` models with random weights from their configs."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def zen_text() -> str:
    """The Zen of Python, as the ``this`` module holds it (rot13), decoded."""
    import codecs
    import contextlib
    import io
    import sys

    with contextlib.redirect_stdout(io.StringIO()):  # importing it prints the text
        import this  # noqa: F401
    return codecs.decode(sys.modules["this"].s, "rot13")


def tokenizer(vocab_size: int = 300) -> Any:
    """A byte-level BPE tokenizer (``PreTrainedTokenizerFast``) trained on :func:`zen_text`,
    with ``<unk>``, ``<s>`` and ``</s>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([zen_text()], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def llama(
    *,
    vocab_size: int = 300,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    seed: int = 0,
) -> Any:
    """A Llama-like causal LM (grouped-query attention when ``kv_heads < heads``), random
    weights, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = (vocab_size, hidden, layers, heads, kv_heads, intermediate)
    return _causal_lm(LlamaConfig, LlamaForCausalLM, *sizes, seed=seed)


def qwen2(
    *,
    vocab_size: int = 300,
    hidden: int = 96,
    layers: int = 2,
    heads: int = 6,
    kv_heads: int = 2,
    intermediate: int = 256,
    seed: int = 0,
) -> Any:
    """A Qwen2-like causal LM (grouped-query attention, biases on q/k/v, RoPE, RMSNorm),
    random weights, in eval mode."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sizes = (vocab_size, hidden, layers, heads, kv_heads, intermediate)
    return _causal_lm(Qwen2Config, Qwen2ForCausalLM, *sizes, seed=seed)


def _causal_lm(
    config_cls: Any,
    model_cls: Any,
    vocab_size: int,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    *,
    seed: int,
) -> Any:
    """A causal LM of ``model_cls`` with these sizes, random weights drawn from ``seed``, in eval
    mode."""
    import torch

    cfg = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return model_cls(cfg).eval()


def save_transformers(model: Any, tok: Any, path: str | Path, task: str) -> Path:
    """``model`` and ``tok`` saved with MLflow's ``transformers`` flavor under ``path``."""
    import mlflow.transformers

    mlflow.transformers.save_model(
        {"model": model, "tokenizer": tok},
        str(path),
        task=task,
        # inferring them imports every package the model might need, some of which are absent
        pip_requirements=["transformers", "torch"],
    )
    return Path(path)
