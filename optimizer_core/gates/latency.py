"""Latency of variants against a baseline, measured so that the comparison is fair.

All models run in one process on the same execution provider with the same thread settings and
the same feeds. After warm-up, runs are interleaved (the order rotates every round) so that
drift in the machine's speed hits every model alike. Models too large to have their sessions
open together take turns block by block instead (:func:`measure_alternating`). Per model: p50, p95, p99, mean and
throughput. The speedup of a variant is the baseline's p50 over the variant's p50.

Noise: the runs are cut into consecutive blocks and the speedup computed per block. A gate whose
threshold falls inside the range of block speedups, when that range is wider than the policy's
``max_noise`` (relative to the speedup), is *undecided*: it fails closed and says so with the
spread, rather than pass or fail on a coin toss.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np


@dataclasses.dataclass
class LatencyStats:
    samples_ms: list[float]
    batch: int

    @property
    def p50_ms(self) -> float:
        return float(np.percentile(self.samples_ms, 50))

    @property
    def p95_ms(self) -> float:
        return float(np.percentile(self.samples_ms, 95))

    @property
    def p99_ms(self) -> float:
        return float(np.percentile(self.samples_ms, 99))

    @property
    def mean_ms(self) -> float:
        return float(np.mean(self.samples_ms))

    @property
    def throughput(self) -> float:
        """Samples per second at the mean latency."""
        return self.batch * 1000.0 / self.mean_ms if self.mean_ms > 0 else float("inf")

    def to_json(self, *, samples: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "p50_ms": round(self.p50_ms, 4),
            "p95_ms": round(self.p95_ms, 4),
            "p99_ms": round(self.p99_ms, 4),
            "mean_ms": round(self.mean_ms, 4),
            "throughput_per_s": round(self.throughput, 2),
            "runs": len(self.samples_ms),
            "batch": self.batch,
        }
        if samples:
            out["samples_ms"] = [round(s, 4) for s in self.samples_ms]
        return out


@dataclasses.dataclass
class LatencyRun:
    baseline: str
    stats: dict[str, LatencyStats]
    blocks: int
    settings: dict[str, Any]

    def speedup(self, name: str) -> float:
        return self.stats[self.baseline].p50_ms / self.stats[name].p50_ms

    def block_speedups(self, name: str) -> list[float]:
        base = self.stats[self.baseline].samples_ms
        var = self.stats[name].samples_ms
        n = min(len(base), len(var))
        size = max(1, n // self.blocks)
        out = []
        for start in range(0, size * self.blocks, size):
            b, v = base[start : start + size], var[start : start + size]
            if b and v:
                out.append(statistics.median(b) / statistics.median(v))
        return out

    def spread(self, name: str) -> float:
        blocks = self.block_speedups(name)
        return (max(blocks) - min(blocks)) / self.speedup(name) if blocks else float("inf")


def measure_latency(
    sessions: Mapping[str, Any],
    feeds: Mapping[str, np.ndarray],
    *,
    baseline: str,
    runs: int = 200,
    warmup: int = 20,
    blocks: int = 5,
    progress: Callable[[str], None] | None = None,
) -> LatencyRun:
    """Time ``session.run`` of every session on ``feeds``, interleaved, after warm-up."""
    if baseline not in sessions:
        raise ValueError(f"baseline '{baseline}' is not among the sessions")
    names = list(sessions)
    batch = int(next(iter(feeds.values())).shape[0]) if feeds else 1
    feeds = dict(feeds)
    for name in names:
        for _ in range(warmup):
            sessions[name].run(None, feeds)
    samples: dict[str, list[float]] = {n: [] for n in names}
    step = max(1, runs // 10)
    for r in range(runs):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            sessions[name].run(None, feeds)
            samples[name].append((time.perf_counter() - t0) * 1000.0)
        if progress is not None and ((r + 1) % step == 0 or r + 1 == runs):
            progress(f"latency: {r + 1}/{runs} interleaved rounds of {len(names)} model(s)")
    return LatencyRun(
        baseline,
        {n: LatencyStats(samples[n], batch) for n in names},
        max(1, blocks),
        {
            "runs": runs,
            "warmup": warmup,
            "blocks": blocks,
            "batch": batch,
            "models": len(names),
            "interleaved": "runs",
        },
    )


@dataclasses.dataclass(frozen=True)
class Phase:
    """One timed workload of :func:`measure_alternating`: its feeds, timed runs per model (over
    all blocks) and warm-up runs per model."""

    feeds: Mapping[str, np.ndarray]
    runs: int
    warmup: int


def measure_alternating(
    opens: Mapping[str, Callable[[], Any]],
    phases: Mapping[str, Phase],
    *,
    baseline: str,
    blocks: int = 5,
    progress: Callable[[str], None] | None = None,
) -> dict[str, LatencyRun]:
    """Time every model on every phase with one session open at a time.

    Models too large to hold beside each other take turns block by block: in each block every
    model's session is opened (``opens[name]()``), warmed up, timed on each phase for its share
    of the runs and let go before the next model's opens; the order rotates every block. Drift
    in the machine's speed between blocks hits every model alike, and the per-block speedups
    (:meth:`LatencyRun.block_speedups`, whose blocks are these) say how much it moved.
    """
    if baseline not in opens:
        raise ValueError(f"baseline '{baseline}' is not among the models")
    names = list(opens)
    blocks = max(1, blocks)
    share = {p: max(1, ph.runs // blocks) for p, ph in phases.items()}
    warm = {p: max(1, -(-ph.warmup // blocks)) for p, ph in phases.items()}
    samples: dict[str, dict[str, list[float]]] = {p: {n: [] for n in names} for p in phases}
    for b in range(blocks):
        k = b % len(names)
        for name in names[k:] + names[:k]:
            if progress is not None:
                progress(f"latency: block {b + 1}/{blocks}, {name}: opening its session")
            session = opens[name]()
            for p, ph in phases.items():
                feeds = dict(ph.feeds)
                for _ in range(warm[p]):
                    session.run(None, feeds)
                for _ in range(share[p]):
                    t0 = time.perf_counter()
                    session.run(None, feeds)
                    samples[p][name].append((time.perf_counter() - t0) * 1000.0)
            del session
    out: dict[str, LatencyRun] = {}
    for p, ph in phases.items():
        batch = int(next(iter(ph.feeds.values())).shape[0]) if ph.feeds else 1
        settings = {
            "runs": share[p] * blocks,
            "warmup": warm[p] * blocks,
            "blocks": blocks,
            "batch": batch,
            "models": len(names),
            "interleaved": "blocks",
            "sessions_opened": blocks * len(names),
        }
        out[p] = LatencyRun(
            baseline, {n: LatencyStats(samples[p][n], batch) for n in names}, blocks, settings
        )
    return out


def judge(run: LatencyRun, name: str, thresholds: Any) -> tuple[str, list[str]]:
    """``("pass"|"fail"|"undecided", reasons)`` for variant ``name``."""
    t = thresholds
    reasons: list[str] = []
    status = "pass"
    st = run.stats[name]
    for label, value, limit in (
        ("p50", st.p50_ms, t.max_p50_ms),
        ("p95", st.p95_ms, t.max_p95_ms),
        ("p99", st.p99_ms, t.max_p99_ms),
    ):
        if limit is not None and not value <= limit:
            status = "fail"
            reasons.append(f"{label} {value:.3f} ms > budget {limit:g} ms")
    if t.min_speedup is not None:
        speedup = run.speedup(name)
        blocks = run.block_speedups(name)
        lo, hi = (min(blocks), max(blocks)) if blocks else (speedup, speedup)
        spread = run.spread(name)
        if lo >= t.min_speedup:
            pass
        elif hi < t.min_speedup:
            status = "fail"
            reasons.append(
                f"p50 speedup {speedup:.3f}x < {t.min_speedup:g}x "
                f"(every block below: {lo:.3f}-{hi:.3f}x)"
            )
        elif spread > t.max_noise:
            if status != "fail":
                status = "undecided"
            reasons.append(
                f"too noisy to decide: speedup {lo:.3f}-{hi:.3f}x across {len(blocks)} blocks "
                f"(spread {spread:.1%} > {t.max_noise:.1%}) around the threshold "
                f"{t.min_speedup:g}x; rerun on a quieter machine or with more runs"
            )
        elif speedup < t.min_speedup:
            status = "fail"
            reasons.append(f"p50 speedup {speedup:.3f}x < {t.min_speedup:g}x")
    return status, reasons
