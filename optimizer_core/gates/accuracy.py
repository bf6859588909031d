"""Accuracy of a variant against its reference model on the same data.

Agreement with the reference, on the judged output (the first one unless the policy names
another): max absolute error, max relative error (max |a-b| over max |a|), cosine similarity of
the flattened outputs, and top-1 agreement (argmax over the last axis, for ``[batch, classes]``
outputs only: on a hidden state the largest feature means nothing). With labels, a task metric for both models and the drop from reference to variant.
Metrics are pluggable: ``register_metric(name, fn(outputs, labels) -> float)``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from graphtrim.data import EvalData

MetricFn = Callable[[np.ndarray, np.ndarray], float]


def _accuracy(outputs: np.ndarray, labels: np.ndarray) -> float:
    pred = outputs.argmax(axis=-1) if outputs.ndim > 1 else (outputs > 0.5).astype(np.int64)
    return float(np.mean(pred.reshape(-1) == labels.reshape(-1)))


METRICS: dict[str, MetricFn] = {"accuracy": _accuracy}


def register_metric(name: str, fn: MetricFn) -> None:
    METRICS[name] = fn


@dataclasses.dataclass
class AccuracyMeasurement:
    output: str
    samples: int
    max_abs_error: float
    max_rel_error: float
    cosine: float | None
    top1_agreement: float | None
    metric: str | None = None
    reference_metric: float | None = None
    variant_metric: float | None = None
    # language models (token-id data): perplexities and the greedy continuation
    reference_perplexity: float | None = None
    variant_perplexity: float | None = None
    greedy_match: float | None = None
    greedy: list[dict[str, Any]] | None = None
    vocabulary: int | None = None  # the logits' last dim

    @property
    def perplexity_ratio(self) -> float | None:
        if self.reference_perplexity is None or self.variant_perplexity is None:
            return None
        return self.variant_perplexity / self.reference_perplexity

    @property
    def metric_drop(self) -> float | None:
        if self.reference_metric is None or self.variant_metric is None:
            return None
        return self.reference_metric - self.variant_metric

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["metric_drop"] = self.metric_drop
        out["perplexity_ratio"] = self.perplexity_ratio
        return out


def run_outputs(session: Any, data: EvalData, output: str | None) -> tuple[str, np.ndarray]:
    names = [o.name for o in session.get_outputs()]
    name = output or names[0]
    if name not in names:
        raise ValueError(f"the model has no output '{name}' (outputs: {', '.join(names)})")
    parts = [session.run([name], feeds)[0] for feeds in data]
    if not parts:
        raise ValueError("no evaluation data")
    if parts[0].ndim == 0:
        return name, np.stack(parts)
    return name, np.concatenate(parts, axis=0)


def compare(
    reference: np.ndarray,
    candidate: np.ndarray,
    *,
    output: str,
    labels: np.ndarray | None = None,
    metric: str = "accuracy",
    per_position: bool = False,
) -> AccuracyMeasurement:
    """``per_position``: the outputs are a language model's logits ``[batch, sequence,
    vocabulary]``, whose top-1 agreement is taken over every position."""
    if reference.shape != candidate.shape:
        raise ValueError(
            f"output '{output}' has shape {candidate.shape}, the reference {reference.shape}"
        )
    a = reference.astype(np.float64)
    b = candidate.astype(np.float64)
    diff = np.abs(a - b)
    max_abs = float(np.nanmax(diff)) if diff.size else 0.0
    if np.isnan(diff).any():
        max_abs = float("inf")
    scale = float(np.max(np.abs(a))) if a.size else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    cosine = float(np.dot(a.ravel(), b.ravel()) / (na * nb)) if na > 0 and nb > 0 else None
    if na == 0 and nb == 0:
        cosine = 1.0
    top1 = None
    if (a.ndim == 2 or (per_position and a.ndim >= 2)) and a.shape[-1] > 1:
        top1 = float(np.mean(a.argmax(axis=-1) == b.argmax(axis=-1)))
    m = AccuracyMeasurement(
        output, int(a.shape[0]) if a.ndim else 1, max_abs, max_rel, cosine, top1
    )
    if labels is not None:
        fn = METRICS.get(metric)
        if fn is None:
            raise ValueError(f"unknown metric '{metric}' (known: {', '.join(sorted(METRICS))})")
        m.metric = metric
        m.reference_metric = fn(reference, labels)
        m.variant_metric = fn(candidate, labels)
    return m


def judge(m: AccuracyMeasurement, thresholds: Any) -> list[str]:
    """The thresholds ``m`` breaks, as readable lines (empty: passed)."""
    broken: list[str] = []
    t = thresholds
    if t.max_abs_error is not None and not m.max_abs_error <= t.max_abs_error:
        broken.append(f"max abs error {m.max_abs_error:.4g} > {t.max_abs_error:g}")
    if t.max_rel_error is not None and not m.max_rel_error <= t.max_rel_error:
        broken.append(f"max rel error {m.max_rel_error:.4g} > {t.max_rel_error:g}")
    if t.min_cosine is not None and (m.cosine is None or not m.cosine >= t.min_cosine):
        broken.append(f"cosine {_f(m.cosine, '.6f')} < {t.min_cosine:g}")
    if (
        t.min_top1_agreement is not None
        and m.top1_agreement is not None
        and not m.top1_agreement >= t.min_top1_agreement
    ):
        broken.append(f"top-1 agreement {m.top1_agreement:.4f} < {t.min_top1_agreement:g}")
    ratio = m.perplexity_ratio
    if (
        t.max_perplexity_ratio is not None
        and ratio is not None
        and not ratio <= t.max_perplexity_ratio
    ):
        broken.append(
            f"perplexity {m.reference_perplexity:.4g} -> {m.variant_perplexity:.4g} "
            f"(x{ratio:.4f}) > x{t.max_perplexity_ratio:g}"
        )
    if t.min_greedy_match is not None and m.greedy is not None:
        if m.greedy_match is None or not m.greedy_match >= t.min_greedy_match:
            broken.append(f"greedy match {_f(m.greedy_match, '.3f')} < {t.min_greedy_match:g}")
    drop = m.metric_drop
    if t.max_metric_drop is not None and drop is not None:
        ref = m.reference_metric or 0.0
        allowed = t.max_metric_drop * (ref if t.metric_drop_mode == "relative" else 1.0)
        if not drop <= allowed + 1e-12:
            broken.append(
                f"{m.metric} dropped {drop:.4f} ({m.reference_metric:.4f} -> "
                f"{m.variant_metric:.4f}), allowed {allowed:.4f}"
            )
    if broken and m.vocabulary and m.reference_perplexity is not None:
        from graphtrim.gates.language import chance_note

        note = chance_note(m.reference_perplexity, m.vocabulary)
        if note:
            broken.append(note)
    return broken


def _f(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def labels_of(data: EvalData) -> np.ndarray | None:
    return data.all_labels()


def measure(
    reference_session: Any,
    candidate_session: Any,
    data: EvalData,
    *,
    output: str | None = None,
    metric: str = "accuracy",
    reference_outputs: tuple[str, np.ndarray] | None = None,
    language: bool = False,
    reference_greedy: list[list[int]] | None = None,
) -> AccuracyMeasurement:
    """``language``: the models are decoders with a KV cache (see
    :mod:`graphtrim.gates.language`); with token-id data their perplexities and greedy
    continuations are measured too. With ``reference_outputs`` (and, for a language model,
    ``reference_greedy``: :func:`graphtrim.gates.language.greedy_continuations`) the reference
    session is not used and may be ``None``."""
    name, ref = reference_outputs or run_outputs(reference_session, data, output)
    _, got = run_outputs(candidate_session, data, name)
    m = compare(ref, got, output=name, labels=labels_of(data), metric=metric, per_position=language)
    if language and data.tokens is not None and ref.ndim == 3:
        from graphtrim.gates.language import greedy_match, perplexity

        m.vocabulary = int(ref.shape[-1])
        m.reference_perplexity = perplexity(ref, data.tokens)
        m.variant_perplexity = perplexity(got, data.tokens)
        found = greedy_match(
            reference_greedy if reference_greedy is not None else reference_session,
            candidate_session,
            data.tokens,
        )
        m.greedy_match = found["greedy_match"]
        m.greedy = found["greedy_prompts"]
    return m


__all__: Sequence[str] = [
    "METRICS",
    "AccuracyMeasurement",
    "compare",
    "judge",
    "measure",
    "register_metric",
    "run_outputs",
]


def accuracy_check(
    reference: str | os.PathLike[str],
    data: EvalData,
    policy: Any,
    variant: str,
    *,
    device: str = "cpu",
    tensorrt: bool = False,
) -> Callable[[Path], tuple[bool, dict[str, Any]]]:
    """The accuracy gate of ``variant`` as a callable on a candidate file (for the fallback).

    The reference is run once, before the first check, and its session let go before any
    candidate's opens: it is never in memory beside the converter's work or a candidate's
    session (a 4 GiB decoder's weights)."""
    from graphtrim.data import input_specs
    from graphtrim.gates.language import is_decoder
    from graphtrim.runtime import open_session, providers_for

    thresholds = policy.for_variant(variant).accuracy
    providers = providers_for(device, tensorrt=tensorrt)
    # a session that reads its weights in place: listing the inputs holds no copy of them
    language = is_decoder(input_specs(reference))
    cache: dict[str, Any] = {}
    greedy: dict[str, list[list[int]]] = {}

    def check(path: Path) -> tuple[bool, dict[str, Any]]:
        if thresholds is None:
            return True, {}
        key = thresholds.output or ""
        if key not in cache:
            ref = open_session(reference, device=device, providers=providers)
            cache[key] = run_outputs(ref, data, thresholds.output)
            if language and data.tokens is not None:
                from graphtrim.gates.language import greedy_continuations

                greedy[key] = greedy_continuations(ref, data.tokens)
            del ref
        cand = open_session(path, device=device, providers=providers)
        m = measure(
            None,
            cand,
            data,
            metric=thresholds.metric,
            reference_outputs=cache[key],
            language=language,
            reference_greedy=greedy.get(key),
        )
        del cand
        broken = judge(m, thresholds)
        return not broken, {**m.to_json(), "broken": broken}

    return check
