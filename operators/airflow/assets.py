"""Asset events for DAGs downstream of graphtrim: one per variant version registered and one
per alias moved, each on the registered model's asset (``x-mlflow://registered-models/<name>``)
through an alias a DAG can be scheduled on:

- ``graphtrim-registered`` (:data:`REGISTERED`): extra ``{"model", "version", "variant",
  "source_version", "event": "registered"}``;
- ``graphtrim-promoted`` (:data:`PROMOTED`): extra ``{"model", "version", "alias", "previous",
  "event": "promoted"}``.

``schedule=[AssetAlias("graphtrim-promoted")]`` runs a DAG (a deployment, a smoke test) each
time an alias moves; ``schedule=[model_asset("my-model")]`` on any event of one model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from airflow.sdk import Asset, AssetAlias

REGISTERED = AssetAlias("graphtrim-registered", group="graphtrim")
PROMOTED = AssetAlias("graphtrim-promoted", group="graphtrim")


def model_asset(name: str) -> Asset:
    """The asset of registered model ``name``."""
    return Asset(
        name=f"mlflow-registered-model:{name}",
        uri=f"x-mlflow://registered-models/{quote(name, safe='')}",
        group="graphtrim",
    )


def registered_events(record: Mapping[str, Any]) -> list[tuple[Asset, dict[str, Any]]]:
    """(asset, extra) per version the register record created (not those found again)."""
    source = record.get("source") or {}
    out = []
    for variant, rec in (record.get("registered") or {}).items():
        if not rec.get("created"):
            continue
        out.append(
            (
                model_asset(str(rec["name"])),
                {
                    "event": "registered",
                    "model": str(rec["name"]),
                    "version": str(rec["version"]),
                    "variant": variant,
                    "source_version": str(source.get("version", "")),
                },
            )
        )
    return out


def promoted_events(record: Mapping[str, Any], target: str) -> list[tuple[Asset, dict[str, Any]]]:
    """(asset, extra) per alias the promote record moved, the champion included."""
    moves = [
        (alias, a["version"], a.get("previous"))
        for alias, a in (record.get("aliases") or {}).items()
        if a.get("moved")
    ]
    champion = record.get("champion") or {}
    if champion.get("moved"):
        moves.append((champion["alias"], champion["version"], champion.get("holder")))
    return [
        (
            model_asset(target),
            {
                "event": "promoted",
                "model": target,
                "alias": str(alias),
                "version": str(version),
                "previous": None if previous is None else str(previous),
            },
        )
        for alias, version, previous in moves
    ]
