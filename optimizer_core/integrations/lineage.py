"""A registered variant's identity, the verdicts recorded on it, and the clean-up of registries
that hold copies of one variant.

A variant's **identity** is what determines its bytes: the source version (name, version and
the logged model or source it was registered from), the variant kind, the build settings that
kind reads (preset, target opset, device; for a converting kind also its fallback, the accuracy
thresholds and data its fallback checks against, its calibration data, weight settings and
settings search) and the versions of the optimizer and the converters. The gate policy's other
sections and the list of other variants requested in the same run are not part of it: two runs
that build the same bytes find one version.

A version is registered once per identity. Each gate policy that judged it leaves a tag on it,
``graphtrim.verdict.<policy hash>``, with the verdict and its numbers: a run under another
policy records its verdict there instead of registering a copy.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from graphtrim.integrations.registry import (
    KEY_TAG,
    TAG,
    VARIANT_TAG,
    RegistryError,
    _quote,
)

if TYPE_CHECKING:
    from graphtrim.gates.policy import GatePolicy
    from graphtrim.integrations.registry import Registry

IDENTITY_VERSION = 1  # raised when what enters the identity changes
VERDICT_TAG = TAG + "verdict."  # version tag per policy hash: that policy's verdict (JSON)
POLICY_TAG = TAG + "policy_hash"  # the policy the version was registered under
DUPLICATE_TAG = TAG + "duplicate_of"  # set by ``registry dedupe`` on the copies it archives
ARCHIVED_TAG = TAG + "archived"
SHA_TAG = TAG + "sha256"
SOURCE_NAME_TAG = TAG + "source.name"
SOURCE_VERSION_TAG = TAG + "source.version"
# the libraries whose versions change a variant's bytes (MLflow's does not)
BUILD_LIBRARIES = ("graphtrim", "onnx", "onnx-ir", "onnxruntime", "onnxscript", "torch")
VERDICT_METRICS = (
    "speedup",
    "p50_ms",
    "reference_p50_ms",
    "bytes",
    "size_ratio",
    "nodes",
    "cosine",
    "max_abs_error",
    "top1_agreement",
    "metric_drop",
    "perplexity_ratio",
)


def build_settings(variant: str, config: Any, policy: GatePolicy | None = None) -> dict[str, Any]:
    """The settings of a :class:`~graphtrim.stages.context.PipelineConfig` that decide the
    bytes of ``variant``: what its build reads, nothing of the gates it is judged by."""
    from graphtrim.quantize.kinds import KINDS

    kind = next((k for k in KINDS if k.name == variant), None)
    shas = dict(config.data_sha256 or {})
    out: dict[str, Any] = {
        "preset": config.preset,
        "opset": config.opset,
        "device": config.device,
        "tensorrt": bool(config.tensorrt),
        "fx_simplify": bool(config.fx_simplify),
    }
    if kind is not None and kind.converter is not None:
        out["weights"] = dict(config.weights) if config.weights else None
        out["tune"] = config.tune
        if kind.needs_calibration or config.tune is not None:
            out["calibration"] = shas.get("calibration") or shas.get("eval_data")
        out["fallback"] = bool(config.fallback)
        if config.fallback:
            # the sensitivity fallback keeps nodes in float until the accuracy gate holds:
            # its thresholds and the data it checks on decide which nodes stay float
            pol = policy if policy is not None else config.gate_policy()
            accuracy = pol.for_variant(variant).accuracy
            out["accuracy"] = dataclasses.asdict(accuracy) if accuracy is not None else None
            out["fallback_data"] = shas.get("eval_data") or shas.get("calibration")
    return out


def identity_key(
    source: Mapping[str, Any],
    variant: str,
    config: Any,
    versions: Mapping[str, str],
    *,
    policy: GatePolicy | None = None,
) -> str:
    """The identity of one variant of one source version (see the module's docstring), as
    the hex sha256 stored in the version's ``graphtrim.key`` tag."""
    doc = {
        "identity": IDENTITY_VERSION,
        "source": {
            "name": source["name"],
            "version": str(source["version"]),
            "content": source.get("model_id") or source.get("source") or "",
        },
        "variant": variant,
        "build": build_settings(variant, config, policy),
        "versions": {k: versions[k] for k in BUILD_LIBRARIES if k in versions},
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def verdict_tag(policy_hash: str) -> str:
    return VERDICT_TAG + policy_hash[:16]


def verdict_doc(summary: Mapping[str, Any], policy_hash: str, run_id: str) -> str:
    """One policy's verdict on a variant as a version tag's value: passed, each gate's
    verdict, the key numbers, the run that measured it (under MLflow's 5000 characters)."""
    metrics = summary.get("metrics") or {}
    doc: dict[str, Any] = {
        "passed": bool(summary.get("passed")),
        "gates": dict(summary.get("gates") or {}),
        "metrics": {k: metrics[k] for k in VERDICT_METRICS if metrics.get(k) is not None},
        "reasons": [str(r)[:300] for r in (summary.get("reasons") or [])][:5],
        "policy_hash": policy_hash,
        "run_id": run_id,
        "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    text = json.dumps(doc, sort_keys=True)
    while len(text) > 5000 and doc["reasons"]:
        doc["reasons"].pop()
        text = json.dumps(doc, sort_keys=True)
    return text


def recorded_verdict(tags: Mapping[str, str], policy_hash: str) -> dict[str, Any] | None:
    """The verdict ``policy_hash`` left on a version with these tags, if any."""
    raw = tags.get(verdict_tag(policy_hash))
    if not raw:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and "passed" in doc else None


def find_existing(
    registry: Registry,
    name: str,
    *,
    key: str,
    source: Mapping[str, Any] | None = None,
    variant: str | None = None,
    sha256: str | None = None,
) -> Any | None:
    """The version of ``name`` that already holds this variant: the oldest one with identity
    ``key``, else (with ``sha256``) the oldest of ``source``'s versions of ``variant`` whose
    files have that sha256 (a version registered before identities, or by another config
    that built the same bytes). Archived copies are never the answer."""
    try:
        mv = registry.find_by_key(name, key)
    except RegistryError:
        return None  # no such registered model yet
    if mv is not None and not dict(mv.tags or {}).get(ARCHIVED_TAG):
        return mv
    if not (sha256 and source and variant):
        return None
    found = registry.client.search_model_versions(
        f"name='{_quote(name)}' and tags.`{SHA_TAG}`='{_quote(sha256)}'"
    )
    same = [
        v
        for v in found
        if dict(v.tags or {}).get(VARIANT_TAG) == variant
        and dict(v.tags or {}).get(SOURCE_NAME_TAG) == str(source["name"])
        and dict(v.tags or {}).get(SOURCE_VERSION_TAG) == str(source["version"])
        and not dict(v.tags or {}).get(ARCHIVED_TAG)
    ]
    return min(same, key=lambda v: int(v.version)) if same else None


# ------------------------------------------------------------------ registry dedupe


@dataclasses.dataclass(frozen=True)
class CopyGroup:
    """Versions of one registered model holding the same bytes of one variant of one source:
    ``kept`` stays, ``copies`` are archived, ``protected`` are copies an alias points to (left
    as they are)."""

    source: str
    variant: str
    sha256: str
    kept: str
    copies: tuple[str, ...]
    protected: dict[str, tuple[str, ...]]

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "protected": dict(self.protected)}


def copy_groups(registry: Registry, name: str) -> list[CopyGroup]:
    """The versions of ``name`` whose files have the same sha256 and the same source (and
    variant): per group the version kept (the oldest, or the one an alias points to when the
    oldest carries none and another does), the later copies and those an alias holds."""
    versions = registry._call(
        f"versions of registered model '{name}'",
        registry.client.search_model_versions,
        f"name='{_quote(name)}'",
    )
    rm = registry._call(f"registered model '{name}'", registry.client.get_registered_model, name)
    aliases: dict[str, list[str]] = {}
    for alias, version in dict(getattr(rm, "aliases", None) or {}).items():
        aliases.setdefault(str(version), []).append(str(alias))
    groups: dict[tuple[str, str, str, str], list[Any]] = {}
    for mv in versions:
        tags = dict(mv.tags or {})
        sha = tags.get(SHA_TAG)
        if not sha or tags.get(ARCHIVED_TAG):
            continue
        key = (
            tags.get(SOURCE_NAME_TAG, ""),
            tags.get(SOURCE_VERSION_TAG, ""),
            tags.get(VARIANT_TAG, ""),
            sha,
        )
        groups.setdefault(key, []).append(mv)
    out = []
    for (src_name, src_version, variant, sha), members in sorted(groups.items()):
        if len(members) < 2:
            continue
        numbers = sorted(str(m.version) for m in members)
        numbers.sort(key=int)
        kept = numbers[0]
        rest = numbers[1:]
        out.append(
            CopyGroup(
                source=f"{src_name}/{src_version}",
                variant=variant,
                sha256=sha,
                kept=kept,
                copies=tuple(v for v in rest if v not in aliases),
                protected={v: tuple(sorted(aliases[v])) for v in rest if v in aliases},
            )
        )
    return out


def archive_copies(
    registry: Registry, name: str, groups: Sequence[CopyGroup], *, why: str
) -> list[str]:
    """Archive each group's copies: each gets ``graphtrim.duplicate_of`` (the kept version)
    and ``graphtrim.archived`` (when and why), and the verdicts it carries are copied onto
    the kept version where that one lacks them. A version an alias points to now is left
    alone (checked again just before each write). Returns the versions archived."""
    done = []
    when = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    for group in groups:
        kept_tags = registry.version_tags(name, group.kept)
        for version in group.copies:
            mv = registry._call(
                f"version {version} of registered model '{name}'",
                registry.client.get_model_version,
                name,
                version,
            )
            if list(getattr(mv, "aliases", None) or []):
                continue  # an alias moved onto it since the listing
            tags = dict(mv.tags or {})
            for key, value in tags.items():
                if key.startswith(VERDICT_TAG) and key not in kept_tags:
                    registry.client.set_model_version_tag(name, group.kept, key, value)
                    kept_tags[key] = value
            registry.client.set_model_version_tag(name, version, DUPLICATE_TAG, group.kept)
            registry.client.set_model_version_tag(
                name, version, ARCHIVED_TAG, json.dumps({"when": when, "why": why})
            )
            done.append(version)
    return done


__all__ = [
    "ARCHIVED_TAG",
    "DUPLICATE_TAG",
    "KEY_TAG",
    "POLICY_TAG",
    "VERDICT_TAG",
    "CopyGroup",
    "archive_copies",
    "build_settings",
    "copy_groups",
    "find_existing",
    "identity_key",
    "recorded_verdict",
    "verdict_doc",
    "verdict_tag",
]
