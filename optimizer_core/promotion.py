"""Alias moves by the promotion policy, and the manual promote / rollback.

Every registered variant gets ``<variant><candidate_suffix>``. The champion alias moves to the
best eligible variant that passed its gates only when it beats the version holding the alias
by the policy's margin (lower is better for both metrics: ``cand <= holder * (1 - margin)``).
Comparisons use numbers that mean the same thing on both sides:

- the holder is the candidate's own source version: the candidate's speedup over that source,
  or its bytes against the source's, from the same evaluation run;
- the holder is a graphtrim variant of the same source version: both speedups are relative to
  that source, so they compare across runs; bytes always compare;
- the holder is a graphtrim variant of another source: bytes compare; ``p50_ms`` compares only
  when both were measured on the same hardware and software (fingerprint digests agree);
- anything else is not comparable: the alias stays and the result says why.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from graphtrim.gates.policy import PromotionPolicy
from graphtrim.integrations.registry import Registry, RegistryError

T = "graphtrim."


def _better(cand: float, holder: float, margin: float) -> bool:
    """Lower is better; ``cand`` must undercut ``holder`` by ``margin`` (a fraction)."""
    return cand <= holder * (1.0 - margin)


def _compare(
    policy: PromotionPolicy,
    cand: Mapping[str, Any],
    holder_version: str,
    holder: Mapping[str, Any],
    *,
    source: Mapping[str, Any],
    target: str,
    validated: Mapping[str, Any],
) -> tuple[bool | None, str]:
    """(candidate beats holder?, why). ``None``: no comparable measurement."""
    metric, margin = policy.metric, policy.margin
    cm = cand["metrics"]
    is_source = target == source["name"] and holder_version == str(source["version"])
    holder_tags: Mapping[str, str] = holder["tags"]
    same_source = holder_tags.get(T + "source.name") == source["name"] and holder_tags.get(
        T + "source.version"
    ) == str(source["version"])
    hm: Mapping[str, Any] = holder["metrics"]
    if metric == "bytes":
        if is_source:
            if not validated.get("reference"):
                return None, "this run measured no source (every variant was judged before)"
            ref = validated["reference"]["bytes"]
            beats = _better(cm["bytes"], ref, margin)
            return beats, f"{cm['bytes']} bytes vs the source's {ref} (margin {margin:g})"
        if hm.get("bytes") is not None:
            beats = _better(cm["bytes"], hm["bytes"], margin)
            return beats, f"{cm['bytes']} bytes vs the holder's {hm['bytes']} (margin {margin:g})"
        return None, f"version {holder_version} has no graphtrim size on record"
    # p50_ms: compare through speedups over a common source where possible. A win must lie
    # outside the measured noise: the candidate's slowest block against the holder's fastest
    # (the gates' undecided rule), and beyond the margin on top of that
    speedup = cm.get("speedup")
    if speedup is None or not speedup > 0:
        return None, "the candidate has no latency measurement (its policy has no latency gate)"
    lo = float(cm.get("speedup_lo") or speedup)
    if is_source:
        # cand_p50 <= ref_p50 * (1 - margin)  <=>  speedup >= 1 / (1 - margin), in every block
        beats = lo * (1.0 - margin) >= 1.0
        return beats, (
            f"speedup {speedup:.3f}x (slowest block {lo:.3f}x) over the source version "
            f"(margin {margin:g})"
        )
    if same_source and hm.get("speedup"):
        hi = float(hm.get("speedup_hi") or hm["speedup"])
        beats = lo * (1.0 - margin) >= hi
        return beats, (
            f"speedup {speedup:.3f}x (slowest block {lo:.3f}x) vs the holder's "
            f"{hm['speedup']:.3f}x (fastest block {hi:.3f}x) over the same source "
            f"(margin {margin:g})"
        )
    if hm.get("p50_ms") is not None and cm.get("p50_ms") is not None:
        if holder_tags.get(T + "fingerprint") != validated.get("fingerprint"):
            return None, (
                f"version {holder_version} was timed on other hardware or software "
                "(fingerprints differ): its p50 is not comparable"
            )
        # the relative spread of each measurement widens the bar
        noise = _noise(cm) + _noise(hm)
        beats = _better(cm["p50_ms"] * (1.0 + noise), hm["p50_ms"], margin)
        return beats, (
            f"p50 {cm['p50_ms']:.3f} ms vs the holder's {hm['p50_ms']:.3f} ms "
            f"(noise {noise:.3f}, margin {margin:g})"
        )
    return None, (
        f"version {holder_version} has no graphtrim latency on record and is not this "
        "candidate's source version"
    )


def _noise(m: Mapping[str, Any]) -> float:
    """The relative spread of a latency measurement's block speedups (0 when unknown)."""
    lo, hi, mid = m.get("speedup_lo"), m.get("speedup_hi"), m.get("speedup")
    if not (lo and hi and mid):
        return 0.0
    return max(0.0, (float(hi) - float(lo)) / float(mid))


def _held(
    registry: Registry, target: str, alias: str, source: Mapping[str, Any]
) -> dict[str, Any] | None:
    """The hold a person put on ``alias``, unless ``source`` is newer than every source
    version there was when it was set (then the hold is released and None returned)."""
    hold = registry.hold(target, alias)
    if hold is None:
        return None
    since = hold.get("since_source")
    newer = (
        hold.get("source_name") == source["name"]
        and str(source["version"]).isdigit()
        and since is not None
        and int(source["version"]) > int(since)
    )
    if newer:
        registry.release_hold(target, alias)
        return None
    return hold


def _best(
    policy: PromotionPolicy, validated: Mapping[str, Any], registered: Mapping[str, Any]
) -> str | None:
    ranked = []
    for order, variant in enumerate(policy.eligible):
        summary = validated["variants"].get(variant)
        if variant not in registered or summary is None or not summary["passed"]:
            continue
        m = summary["metrics"]
        if policy.metric == "bytes":
            if m.get("bytes") is None:
                continue
            score = float(m["bytes"])
        else:
            if not m.get("speedup"):
                continue
            score = 1.0 / float(m["speedup"])
        ranked.append((score, order, variant))
    return min(ranked)[2] if ranked else None


def apply_policy(
    registry: Registry,
    policy: PromotionPolicy,
    *,
    target: str,
    source: Mapping[str, Any],
    validated: Mapping[str, Any],
    registered: Mapping[str, Any],
    why: str,
    force: bool = False,
) -> dict[str, Any]:
    """Move the candidate aliases, then the champion (see the module's docstring). The
    champion never moves between versions with the same content (sha256), nor where a person
    holds it (``promote`` / ``rollback``) unless ``force``."""
    aliases: dict[str, Any] = {}
    for variant, reg in registered.items():
        alias = f"{variant}{policy.candidate_suffix}"
        previous = registry.move_alias(target, alias, reg["version"], why=why)
        aliases[alias] = {
            "version": reg["version"],
            "previous": previous,
            "moved": previous != reg["version"],
        }
    champion: dict[str, Any] = {"alias": policy.champion_alias, "moved": False}
    if policy.champion_alias is None:
        champion["reason"] = "the policy names no champion alias"
        return {"aliases": aliases, "champion": champion}
    registry.complete_move(target, policy.champion_alias)  # one an earlier attempt left
    holder = registry.alias_version(target, policy.champion_alias)
    champion["holder"] = holder
    best = _best(policy, validated, registered)
    if best is None:
        champion["reason"] = (
            "no eligible variant passed its gates"
            if not any(validated["variants"].get(v, {}).get("passed") for v in policy.eligible)
            else f"no eligible variant has a '{policy.metric}' measurement"
        )
        return {"aliases": aliases, "champion": champion}
    hold = _held(registry, target, policy.champion_alias, source)
    if hold is not None and not force:
        champion["held"] = hold
        champion["reason"] = (
            f"held on v{hold.get('version')} by {hold.get('who')} since {hold.get('when')} "
            f"({hold.get('why')}): a source version newer than v{hold.get('since_source')} "
            "or a forced promotion releases it"
        )
        return {"aliases": aliases, "champion": champion}
    version = str(registered[best]["version"])
    champion.update(variant=best, version=version)
    if holder == version:
        champion["reason"] = f"version {version} already holds it"
        return {"aliases": aliases, "champion": champion}
    beats: bool | None
    if holder is None:
        beats, reason = True, "the alias was unset"
    else:
        lineage = registry.version_lineage(target, holder)
        sha = (validated["variants"][best].get("model") or {}).get("sha256")
        if sha and lineage["tags"].get(T + "sha256") == sha:
            champion["reason"] = (
                f"left on version {holder}: v{version} has the same content (sha256 {sha[:12]})"
            )
            return {"aliases": aliases, "champion": champion}
        beats, reason = _compare(
            policy,
            validated["variants"][best],
            holder,
            lineage,
            source=source,
            target=target,
            validated=validated,
        )
    champion["reason"] = reason
    if beats:
        registry.move_alias(target, policy.champion_alias, version, why=f"{why}: {reason}")
        champion["moved"] = True
    elif beats is None:
        champion["reason"] = f"left on version {holder}: {reason}"
    else:
        champion["reason"] = f"left on version {holder}: not better by the margin: {reason}"
    return {"aliases": aliases, "champion": champion}


def promote_version(
    registry: Registry,
    name: str,
    version: str,
    alias: str,
    *,
    why: str,
    who: str | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Point ``alias`` at ``version`` by hand. A version whose recorded gates did not all pass
    is refused unless ``force``."""
    gates = registry.version_lineage(name, version)["gates"]
    if gates and not force:
        failed = {g: s for g, s in gates.items() if s != "pass"}
        if failed:
            raise RegistryError(
                f"version {version} of '{name}' did not pass its gates "
                f"({', '.join(f'{g}: {s}' for g, s in failed.items())}); use --force to promote it anyway"
            )
    previous = registry.move_alias(name, alias, version, why=why, who=who)
    hold = registry.set_hold(name, alias, str(version), why=why, who=who)
    return {
        "name": name,
        "alias": alias,
        "version": str(version),
        "previous": previous,
        "held_until_source_after": hold.get("since_source"),
    }


def rollback_alias(
    registry: Registry, name: str, alias: str, *, why: str, who: str | None = None
) -> dict[str, Any]:
    """Move ``alias`` back to its previous version and hold it there (the pipeline leaves it
    until a newer source version arrives)."""
    old, new = registry.rollback(name, alias, why=why, who=who)
    hold = registry.set_hold(name, alias, new, why=why, who=who)
    return {"name": name, "alias": alias, "from": old, "to": new, "held": hold}
