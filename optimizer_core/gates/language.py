"""What the gates measure on a language model (a decoder with its KV cache as inputs).

On the evaluation text (token ids, each sequence fed as a prefill):

* perplexity of the reference and of the variant (next-token cross-entropy over every
  position), and their ratio, judged by ``max_perplexity_ratio``;
* next-token top-1 agreement over every position (``min_top1_agreement``) and the cosine of the
  logits (``min_cosine``), as for any model;
* greedy continuation: a few prompts (the first tokens of the first sequences) continued token
  by token through the KV cache by both models; the share of generated tokens the variant
  matches before it first departs from the reference, judged by ``min_greedy_match``.

Latency: a decode step (one token after a cache of ``decode_past`` tokens) is what the latency
gate judges; a prefill of ``prefill_tokens`` is timed beside it and recorded.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from graphtrim.runtime import decoder_feeds, kv_cache_inputs

GREEDY_PROMPTS = 4
GREEDY_PROMPT_TOKENS = 8
GREEDY_NEW_TOKENS = 16


def is_decoder(specs: Sequence[tuple[str, Any, Sequence[Any]]]) -> bool:
    return bool(kv_cache_inputs(specs)) and any(s[0] == "input_ids" for s in specs)


def _specs(session: Any) -> list[tuple[str, Any, list[Any]]]:
    return [(i.name, i.type, list(i.shape)) for i in session.get_inputs()]


def _layer_kind(name: str) -> tuple[str, str] | None:
    """(layer, key|value) of a cache input or output name (``past_key_values.3.key``,
    ``present.3.value``, ``past_key.3``, ``present_value_3``)."""
    m = re.search(r"(\d+)[._](key|value)$", name) or re.search(r"(key|value)[._](\d+)$", name)
    if m is None:
        return None
    a, b = m.groups()
    return (a, b) if a.isdigit() else (b, a)


def _presents(session: Any) -> dict[str, str]:
    """KV-cache input -> the output that returns it grown (``past...`` -> ``present...``)."""
    outputs = {
        _layer_kind(o.name): o.name for o in session.get_outputs() if o.name.startswith("present")
    }
    out: dict[str, str] = {}
    for name in kv_cache_inputs(_specs(session)):
        key = _layer_kind(name)
        if key is None or key not in outputs:
            raise ValueError(f"no output returns the cache input {name} grown (present...)")
        out[name] = outputs[key]
    return out


def perplexity(logits: np.ndarray, tokens: np.ndarray) -> float:
    """exp of the mean cross-entropy of ``logits[:, :-1]`` predicting ``tokens[:, 1:]``."""
    x = logits[:, :-1].astype(np.float64)
    target = tokens[:, 1:]
    x -= x.max(axis=-1, keepdims=True)
    log_z = np.log(np.exp(x).sum(axis=-1))
    picked = np.take_along_axis(x, target[..., None], axis=-1)[..., 0]
    return float(np.exp(np.mean(log_z - picked)))


def chance_note(reference_perplexity: float, vocabulary: int) -> str | None:
    """A note for a failed gate when the reference predicts the text within a factor of two
    of a uniform guess (perplexity ``vocabulary``): there its top-1 token leads the next by a
    hair, and any variant's error flips the choice. Measured on a 2-layer random-weight Qwen2
    (vocabulary 300, perplexity 309): the reference's top token has a median probability of
    0.0057 (uniform: 0.0033); where int4 weights changed it, the token chosen instead had 0.97
    of the reference's top probability (median)."""
    if reference_perplexity < vocabulary / 2:
        return None
    return (
        f"note: the float model's perplexity on this text is {reference_perplexity:.4g} with "
        f"a vocabulary of {vocabulary} (a uniform guess: {vocabulary}), so its next-token "
        "choices are near-ties and top-1 agreement and greedy match measure which of nearly "
        "equal tokens wins; for such a model (random or untrained weights, or text unlike its "
        "training data) judge the perplexity ratio: set this variant's min_top1_agreement and "
        "min_greedy_match in the policy (null switches one off), or evaluate on text it predicts"
    )


def greedy(session: Any, prompt: np.ndarray, steps: int) -> list[int]:
    """``steps`` tokens after ``prompt`` (``[1, n]``), argmax each, through the KV cache."""
    specs = _specs(session)
    presents = _presents(session)
    feeds = decoder_feeds(specs, prompt)
    tokens: list[int] = []
    for _ in range(steps):
        outs = session.run(None, feeds)
        named = dict(zip([o.name for o in session.get_outputs()], outs, strict=True))
        logits = named.get("logits", outs[0])
        nxt = int(np.asarray(logits)[0, -1].argmax())
        tokens.append(nxt)
        cache = {name: named[out] for name, out in presents.items()}
        feeds = decoder_feeds(specs, np.array([[nxt]], dtype=np.int64), cache=cache)
    return tokens


def greedy_continuations(session: Any, tokens: np.ndarray) -> list[list[int]]:
    """The greedy continuations :func:`greedy_match` compares, of one model."""
    prompts = tokens[:GREEDY_PROMPTS, :GREEDY_PROMPT_TOKENS]
    return [greedy(session, prompt[None, :], GREEDY_NEW_TOKENS) for prompt in prompts]


def greedy_match(reference: Any, candidate: Any, tokens: np.ndarray) -> dict[str, Any]:
    """Greedy continuations of the first sequences' first tokens by both sessions.

    ``reference`` is a session or its :func:`greedy_continuations` (so that its session need
    not be open beside the candidate's)."""
    prompts = tokens[:GREEDY_PROMPTS, :GREEDY_PROMPT_TOKENS]
    wanted = reference if isinstance(reference, list) else greedy_continuations(reference, tokens)
    matched, per_prompt = 0, []
    for prompt, want in zip(prompts, wanted, strict=True):
        got = greedy(candidate, prompt[None, :], GREEDY_NEW_TOKENS)
        same = next(
            (i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), len(want)
        )
        matched += same
        per_prompt.append({"reference": want, "variant": got, "matched": same})
    total = GREEDY_NEW_TOKENS * len(prompts)
    return {
        "greedy_match": matched / total if total else None,
        "greedy_prompts": per_prompt,
        "greedy_new_tokens": GREEDY_NEW_TOKENS,
    }


def step_feeds(
    specs: Sequence[tuple[str, Any, Sequence[Any]]],
    tokens: np.ndarray | None,
    past: int,
    *,
    seed: int = 0,
) -> dict[str, Any]:
    """A decode step: one token after a (random) cache of ``past`` tokens."""
    rng = np.random.default_rng(seed)
    cache: dict[str, Any] = {}
    cached = set(kv_cache_inputs(specs))
    for name, type_, shape in specs:
        if name not in cached:
            continue
        dims = [1 if i == 0 else past if i == len(shape) - 2 else d for i, d in enumerate(shape)]
        if not all(isinstance(d, int) and d >= 0 for d in dims):
            raise ValueError(f"{name} {shape}: a named head dim; the cache cannot be shaped")
        dtype = np.float16 if "float16" in str(type_) else np.float32
        cache[name] = rng.standard_normal(dims).astype(dtype)
    token = int(tokens[0, 0]) if tokens is not None and tokens.size else 1
    return decoder_feeds(specs, np.array([[token]], dtype=np.int64), cache=cache)


def prefill_feeds(
    specs: Sequence[tuple[str, Any, Sequence[Any]]], tokens: np.ndarray | None, length: int
) -> dict[str, Any]:
    """A prompt of ``length`` tokens (the evaluation text's first, repeated as needed)."""
    if tokens is not None and tokens.size:
        flat = np.resize(tokens.reshape(-1), length)
    else:
        flat = np.arange(length) % 7 + 1
    return decoder_feeds(specs, flat[None, :].astype(np.int64))
