"""What the reports read off a gate record: a variant's gate, its accuracy axis, the points
of speed against accuracy and their Pareto front."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _gate(variant: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    return next((g for g in variant["gates"] if g["gate"] == name), None)


def _accuracy_axis(doc: Mapping[str, Any]) -> tuple[str, dict[str, float], bool]:
    """The accuracy measure every measured variant has, as (label, variant -> value, whether
    higher is better): the task metric's drop when a labelled data set was given, else the
    cosine similarity of the outputs, else top-1 agreement."""
    measured = {
        v["name"]: (_gate(v, "accuracy") or {}).get("measured") or {} for v in doc["variants"]
    }
    measured = {k: m for k, m in measured.items() if m}
    for key, label, higher in (
        ("metric_drop", "metric drop against the reference", False),
        ("cosine", "cosine similarity to the reference", True),
        ("top1_agreement", "top-1 agreement with the reference", True),
    ):
        values = {k: m.get(key) for k, m in measured.items()}
        if values and all(isinstance(x, int | float) for x in values.values()):
            return label, {k: float(x) for k, x in values.items()}, higher  # type: ignore[arg-type]
    return "", {}, True


def points(doc: Mapping[str, Any]) -> dict[str, tuple[float, float, float]]:
    """Each variant measured for both speed and accuracy as (p50 speedup, accuracy, size
    ratio), accuracy oriented so that higher is better; the reference is (1, best, 1)."""
    _, acc, higher = _accuracy_axis(doc)
    ref_bytes = doc["reference"]["bytes"] or 0
    out: dict[str, tuple[float, float, float]] = {}
    for v in doc["variants"]:
        speed = ((_gate(v, "latency") or {}).get("measured") or {}).get("speedup_p50")
        size = (v.get("model") or {}).get("bytes")
        if v["name"] not in acc or not isinstance(speed, int | float) or not size or not ref_bytes:
            continue
        a = acc[v["name"]] if higher else -acc[v["name"]]
        out[v["name"]] = (float(speed), a, size / ref_bytes)
    return out


def pareto_front(doc: Mapping[str, Any]) -> list[str]:
    """The variants that passed their gates and that no other passing variant, nor the
    reference itself, beats on speed, accuracy and size at once (at least as good on all three
    and better on one)."""
    pts = points(doc)
    passed = set(doc.get("passed") or [])
    candidates = {k: p for k, p in pts.items() if k in passed}
    # the reference agrees with itself: cosine and agreement 1, no metric drop
    best = (1.0, 1.0 if _accuracy_axis(doc)[2] else 0.0, 1.0)

    def beats(a: tuple[float, float, float], b: tuple[float, float, float]) -> bool:
        ge = a[0] >= b[0] and a[1] >= b[1] and a[2] <= b[2]
        return ge and (a[0] > b[0] or a[1] > b[1] or a[2] < b[2])

    return [
        k
        for k, p in candidates.items()
        if not beats(best, p) and not any(beats(q, p) for j, q in candidates.items() if j != k)
    ]
