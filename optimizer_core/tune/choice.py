"""How a search picks its champions: trials ranked by the objective (with the size weight),
the nearest misses where no trial is feasible, the choice per kind."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from graphtrim.tune.records import Trial
from graphtrim.tune.space import Candidate


def ranked(trials: Iterable[Trial], objective: str, size_weight: float) -> list[Trial]:
    """The feasible, timed trials with a model at hand, best first by ``objective``."""
    feasible = [t for t in trials if t.feasible and t.speedup is not None and t.path is not None]
    return sorted(feasible, key=lambda t: -t.score(objective, size_weight))


def nearest_misses(trials: Iterable[Trial], feasible_kinds: set[str]) -> list[Trial]:
    """Per kind with no feasible candidate, the built one closest to its gates: the smallest
    over the size gate, else the most accurate under the accuracy gate."""
    out = []
    missed = [
        t
        for t in trials
        if t.status in ("too-big", "inaccurate") and t.candidate.kind not in feasible_kinds
    ]

    def closeness(t: Trial) -> tuple[int, float]:
        if t.status == "too-big":
            return (0, t.size_ratio or float("inf"))
        cos = t.accuracy.get("cosine")
        return (1, -float(cos) if isinstance(cos, int | float) else 0.0)

    for kind in dict.fromkeys(t.candidate.kind for t in missed):
        out.append(min((t for t in missed if t.candidate.kind == kind), key=closeness))
    return out


def choose(
    passed: Sequence[Trial],
    objective: str,
    min_gain: float,
    incumbent: Candidate | None = None,
    *,
    size_weight: float = 0.25,
) -> tuple[Trial, str | None]:
    """The champion among trials that passed every gate in one judgement, and why the
    incumbent was kept if it was. The incumbent is the remembered champion in a search from
    memory, else the best fixed recipe; the best by ``objective`` replaces it only by more than
    that run's noise (the larger spread of their blocks' speedups, at least ``min_gain``; sizes
    are exact): a gain inside the noise is no gain."""
    ranked = sorted(passed, key=lambda t: -t.score(objective, size_weight))
    top = ranked[0]
    held = next((t for t in ranked if incumbent is not None and t.candidate == incumbent), None)
    held = held or next((t for t in ranked if t.candidate.recipe), None)
    if held is None or held is top:
        return top, None
    noise = 0.0
    if objective != "size":
        spreads = [t.timings[-1][2] for t in (top, held) if t.timings]
        noise = max([min_gain, *spreads])
    base = held.score(objective, size_weight)
    gain = top.score(objective, size_weight) / base - 1 if base else float("inf")
    if gain < noise:
        what = "remembered champion" if held.candidate == incumbent else "fixed recipe"
        return held, (
            f"{top.candidate.key} measured {gain:+.1%} against the {what} "
            f"{held.candidate.key}, inside this run's noise ({noise:.1%}): the {what} stays"
        )
    return top, None
