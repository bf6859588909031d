"""The gate policy: per-variant thresholds from a declarative YAML file, with sane defaults.

```yaml
version: 1
defaults:                 # apply to every variant
  accuracy: {min_cosine: 0.99, min_top1_agreement: 0.98, max_metric_drop: 0.01}
  latency: {min_speedup: 1.0, max_noise: 0.05}
  size: {max_ratio: 1.0}
variants:                 # override per variant, key by key
  int8-static: {accuracy: {max_metric_drop: 0.01}, size: {max_ratio: 0.3}}
```

Unknown keys are errors: a misspelt threshold or variant must not silently pass everything. In a
pipeline's policy (and under ``promotion.eligible``) a variant must be one the pipeline builds;
for ``graphtrim evaluate``, which judges variants of any name, a known kind spelt another way
(``int8_static``) is refused. ``null``
switches a threshold off. A section set to ``false`` disables that gate for the variant (in
``defaults``: for every variant the file does not switch it on for). The latency measurement
settings (``runs``, ``warmup``, ``blocks``, ``threads``) are read from ``defaults`` only: all
variants are timed in one interleaved run.

Where a command or a DAG run names no policy, the file in the environment variable
``GRAPHTRIM_POLICY`` is used (a deployment's policy, mounted from a ConfigMap), else the built-in
one; a pipeline run embeds the document it used in its config, so every stage and worker judges
by the same thresholds and the config hash covers them.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from graphtrim.errors import GraphtrimError
from graphtrim.quantize.kinds import KINDS, PROMOTION_ORDER


class PolicyError(GraphtrimError):
    """A gate policy file that cannot be used."""


ENV_VAR = "GRAPHTRIM_POLICY"

_VARIANT_NAMES = tuple(k.name for k in KINDS)


def _spelling(name: str) -> str:
    return name.lower().replace("_", "-").replace(" ", "-")


def _check_variant_names(where: str, names: Any, known: tuple[str, ...] | None = None) -> None:
    """With ``known`` (a pipeline's variants), every name must be one of them. Without (the
    ``evaluate`` command judges variants of any name), a name that is a known kind's name
    spelt another way (``int8_static``, ``FP16``) is refused: it would match no variant."""
    if known is not None:
        unknown = [str(n) for n in names if n not in known]
        if unknown:
            raise PolicyError(
                f"{where}: unknown variant(s) {', '.join(map(repr, unknown))} "
                f"(known: {', '.join(known)})"
            )
        return
    for n in names:
        meant = [k for k in _VARIANT_NAMES if _spelling(str(n)) == k and n != k]
        if meant:
            raise PolicyError(f"{where}: unknown variant {n!r} (did you mean {meant[0]!r}?)")


def environment_policy_path() -> str | None:
    """The policy file named by ``GRAPHTRIM_POLICY`` (``None`` when unset or empty)."""
    return os.environ.get(ENV_VAR) or None


@dataclasses.dataclass(frozen=True)
class AccuracyThresholds:
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    min_cosine: float | None = 0.99
    min_top1_agreement: float | None = 0.98
    metric: str = "accuracy"
    max_metric_drop: float | None = 0.01
    metric_drop_mode: str = "absolute"  # or "relative" (fraction of the reference's metric)
    output: str | None = None  # the output judged; default: the first one
    # language models (a decoder with a KV cache, on token-id evaluation data)
    max_perplexity_ratio: float | None = 1.05  # variant's perplexity over the reference's
    min_greedy_match: float | None = None  # share of greedy tokens matched before departing


@dataclasses.dataclass(frozen=True)
class LatencyThresholds:
    min_speedup: float | None = 1.0  # p50 of the baseline over p50 of the variant
    max_p50_ms: float | None = None
    max_p95_ms: float | None = None
    max_p99_ms: float | None = None
    max_noise: float = 0.05  # relative spread of the speedup across blocks that still decides
    runs: int = 200
    warmup: int = 20
    blocks: int = 5
    # language models: the judged decode step follows a cache of this many tokens; a prefill
    # of prefill_tokens is timed beside it
    decode_past: int = 128
    prefill_tokens: int = 64
    threads: int = 1


@dataclasses.dataclass(frozen=True)
class SizeThresholds:
    max_ratio: float | None = 1.0
    max_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class PromotionPolicy:
    """How aliases move after registration.

    Every registered variant gets ``<variant><candidate_suffix>``. ``champion_alias`` moves only
    to a variant that passed its gates, is listed in ``eligible``, and beats the current holder's
    ``metric`` (``p50_ms`` or ``bytes``, lower is better) by ``margin`` (a fraction). A holder
    without graphtrim's measurements is compared through the candidate's own baseline run when
    it is the candidate's source version; otherwise the alias is left alone and the result says
    why.
    """

    champion_alias: str | None = "champion"
    candidate_suffix: str = "-candidate"
    metric: str = "p50_ms"
    # on top of the measured noise (a win must hold in every timing block)
    margin: float = 0.02
    eligible: tuple[str, ...] = PROMOTION_ORDER

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "eligible": list(self.eligible)}


@dataclasses.dataclass(frozen=True)
class TunePolicy:
    """What ``graphtrim tune`` optimizes among the candidates that pass every gate: p50
    latency, size, or ``balanced``: speedup x (1 / size ratio) ** ``size_weight``."""

    objective: str = "latency"
    size_weight: float = 0.25


TUNE_OBJECTIVES = ("latency", "size", "balanced")


def _tune(body: Any, source: str) -> TunePolicy:
    if body is None:
        return TunePolicy()
    if not isinstance(body, Mapping):
        raise PolicyError(f"{source}: tune: expected a mapping")
    unknown = set(body) - {"objective", "size_weight"}
    if unknown:
        raise PolicyError(
            f"{source}: tune: unknown key(s) {', '.join(sorted(unknown))} "
            "(known: objective, size_weight)"
        )
    objective = body.get("objective", "latency")
    if objective not in TUNE_OBJECTIVES:
        raise PolicyError(f"{source}: tune.objective: one of {', '.join(TUNE_OBJECTIVES)}")
    weight = body.get("size_weight", TunePolicy.size_weight)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 <= weight <= 10:
        raise PolicyError(f"{source}: tune.size_weight: a number in [0, 10], got {weight!r}")
    return TunePolicy(objective, float(weight))


@dataclasses.dataclass(frozen=True)
class VariantPolicy:
    accuracy: AccuracyThresholds | None
    latency: LatencyThresholds | None
    size: SizeThresholds | None

    def to_json(self) -> dict[str, Any]:
        return {
            k: (dataclasses.asdict(v) if v is not None else None)
            for k, v in (
                ("accuracy", self.accuracy),
                ("latency", self.latency),
                ("size", self.size),
            )
        }


_SECTIONS: dict[str, type] = {
    "accuracy": AccuracyThresholds,
    "latency": LatencyThresholds,
    "size": SizeThresholds,
}

# what a variant is expected to keep, when the file says nothing (each variant's line in
# ``graphtrim.quantize.kinds``)
BUILTIN: dict[str, Any] = {
    "version": 1,
    "defaults": {},
    "variants": {k.name: copy.deepcopy(dict(k.gates)) for k in KINDS},
}


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


# measurement settings: whole numbers with a floor, never null
_COUNTS = {
    "runs": 1,
    "warmup": 0,
    "blocks": 1,
    "threads": 1,
    "decode_past": 1,
    "prefill_tokens": 1,
}


def _check_section(where: str, section: str, body: Any) -> None:
    if body is False or body is None:
        return
    if not isinstance(body, Mapping):
        raise PolicyError(f"{where}.{section}: expected a mapping or false, got {body!r}")
    fields = {f.name: f for f in dataclasses.fields(_SECTIONS[section])}
    for key, value in body.items():
        if key not in fields:
            raise PolicyError(
                f"{where}.{section}: unknown key '{key}' (known: {', '.join(sorted(fields))})"
            )
        if key in ("metric", "metric_drop_mode", "output"):
            if value is not None and not isinstance(value, str):
                raise PolicyError(f"{where}.{section}.{key}: expected a string, got {value!r}")
            continue
        if key in _COUNTS:
            if isinstance(value, bool) or not isinstance(value, int) or value < _COUNTS[key]:
                raise PolicyError(
                    f"{where}.{section}.{key}: expected a whole number >= {_COUNTS[key]}, "
                    f"got {value!r}"
                )
            continue
        if value is None:
            if key == "max_noise":
                raise PolicyError(f"{where}.{section}.{key}: expected a number, got null")
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise PolicyError(f"{where}.{section}.{key}: expected a number, got {value!r}")
        if value < 0:
            raise PolicyError(f"{where}.{section}.{key}: must not be negative")
    mode = body.get("metric_drop_mode")
    if mode is not None and mode not in ("absolute", "relative"):
        raise PolicyError(f"{where}.{section}.metric_drop_mode: 'absolute' or 'relative'")


def _check_entry(where: str, entry: Any) -> None:
    if not isinstance(entry, Mapping):
        raise PolicyError(f"{where}: expected a mapping of gates, got {entry!r}")
    for section, body in entry.items():
        if section not in _SECTIONS:
            raise PolicyError(
                f"{where}: unknown gate '{section}' (known: {', '.join(sorted(_SECTIONS))})"
            )
        _check_section(where, section, body)


def _promotion(body: Any, source: str) -> PromotionPolicy:
    if body is None:
        return PromotionPolicy()
    if not isinstance(body, Mapping):
        raise PolicyError(f"{source}: promotion: expected a mapping")
    fields = {f.name for f in dataclasses.fields(PromotionPolicy)}
    unknown = set(body) - fields
    if unknown:
        raise PolicyError(
            f"{source}: promotion: unknown key(s) {', '.join(sorted(unknown))} "
            f"(known: {', '.join(sorted(fields))})"
        )
    kw = dict(body)
    if kw.get("metric", "p50_ms") not in ("p50_ms", "bytes"):
        raise PolicyError(f"{source}: promotion.metric: 'p50_ms' or 'bytes'")
    margin = kw.get("margin", PromotionPolicy.margin)
    if isinstance(margin, bool) or not isinstance(margin, int | float) or not 0 <= margin < 1:
        raise PolicyError(f"{source}: promotion.margin: a fraction in [0, 1), got {margin!r}")
    if "eligible" in kw:
        eligible = kw["eligible"]
        if not isinstance(eligible, list) or not all(isinstance(v, str) for v in eligible):
            raise PolicyError(f"{source}: promotion.eligible: a list of variant names")
        _check_variant_names(f"{source}: promotion.eligible", eligible, _VARIANT_NAMES)
        kw["eligible"] = tuple(eligible)
    alias = kw.get("champion_alias", "champion")
    if alias is not None and (not isinstance(alias, str) or not alias):
        raise PolicyError(f"{source}: promotion.champion_alias: a name or null")
    return PromotionPolicy(**kw)


class GatePolicy:
    """Thresholds per variant, each layer overriding the one before, key by key: the field
    defaults, the file's ``defaults``, the built-in per-variant entries (``graph`` must stay
    exact, int8 must shrink; see ``BUILTIN``), then the file's per-variant entries."""

    def __init__(self, document: Mapping[str, Any] | None = None, *, source: str = "built-in"):
        doc = dict(document or {})
        unknown = set(doc) - {"version", "defaults", "variants", "promotion", "tune"}
        if unknown:
            raise PolicyError(f"{source}: unknown top-level key(s) {', '.join(sorted(unknown))}")
        if doc.get("version", 1) != 1:
            raise PolicyError(f"{source}: unsupported policy version {doc.get('version')!r}")
        defaults = doc.get("defaults") or {}
        variants = doc.get("variants") or {}
        _check_entry(f"{source}: defaults", defaults)
        if not isinstance(variants, Mapping):
            raise PolicyError(f"{source}: 'variants' must be a mapping")
        _check_variant_names(f"{source}: variants", variants)
        for name, entry in variants.items():
            _check_entry(f"{source}: variants.{name}", entry)
        self.source = source
        self.promotion = _promotion(doc.get("promotion"), source)
        self.tune = _tune(doc.get("tune"), source)
        self.document: dict[str, Any] = {
            "version": 1,
            "defaults": defaults,
            "variants": dict(variants),
        }
        if doc.get("promotion") is not None:
            self.document["promotion"] = dict(doc["promotion"])
        if doc.get("tune") is not None:
            self.document["tune"] = dict(doc["tune"])

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None) -> GatePolicy:
        """The policy in the YAML file ``path``; with none, the file ``GRAPHTRIM_POLICY``
        names, else the built-in policy."""
        if path is None:
            path = environment_policy_path()
            if path is None:
                return cls()
        import yaml

        p = Path(path)
        try:
            doc = yaml.safe_load(p.read_text())
        except FileNotFoundError as exc:
            raise PolicyError(f"{p}: no such policy file") from exc
        except yaml.YAMLError as exc:
            raise PolicyError(f"{p}: not valid YAML ({exc})") from exc
        if doc is not None and not isinstance(doc, Mapping):
            raise PolicyError(f"{p}: expected a mapping at the top level")
        return cls(doc, source=str(p))

    def check_variants(self, known: tuple[str, ...]) -> None:
        """Refuse entries for variants other than ``known`` (the variants a pipeline builds)."""
        _check_variant_names(f"{self.source}: variants", self.document["variants"], known)

    def for_variant(self, variant: str) -> VariantPolicy:
        entry: dict[str, Any] = {}
        entry = _merge(entry, self.document["defaults"])
        builtin = BUILTIN["variants"].get(variant, {})
        # a gate the file switches off for all variants stays off unless the file itself turns
        # it on again for one variant
        off = {k for k, v in self.document["defaults"].items() if v is False}
        entry = _merge(entry, {k: v for k, v in builtin.items() if k not in off})
        entry = _merge(entry, self.document["variants"].get(variant, {}))
        built: dict[str, Any] = {}
        for section, cls in _SECTIONS.items():
            body = entry.get(section, {})
            built[section] = None if body is False else cls(**(body or {}))
        return VariantPolicy(**built)

    def to_json(self) -> dict[str, Any]:
        return self.document

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.document, sort_keys=True).encode()).hexdigest()[:16]
