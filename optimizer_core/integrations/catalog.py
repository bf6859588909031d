"""The variants graphtrim registered, read back from the MLflow registry as one table: per
model and version its variant, source version, gate verdicts, speedup, size and aliases, with
links into MLflow's UI. Served as a page by the Airflow plugin (``/graphtrim/variants``)."""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

from graphtrim.integrations.registry import (
    VARIANT_TAG,
    Registry,
    RegistryError,
    logged_model_id,
)

COLUMNS = (
    "model",
    "version",
    "variant",
    "source",
    "gates",
    "p50 speedup",
    "size ratio",
    "p50 ms",
    "nodes",
    "aliases",
)


def registered_variants(registry: Registry, *, limit: int = 200) -> list[dict[str, Any]]:
    """The newest ``limit`` versions that carry graphtrim's variant tag, newest first, each
    with its lineage (gates and numbers) and aliases."""
    found = registry._call(
        "searching the registry for graphtrim variants",
        registry.client.search_model_versions,
        f"tags.`{VARIANT_TAG}` LIKE '%'",
        max_results=limit,
        order_by=["creation_timestamp DESC"],
    )
    rows = []
    aliases: dict[str, dict[str, list[str]]] = {}  # model -> version -> aliases
    for mv in list(found)[:limit]:
        if mv.name not in aliases:  # a search's versions carry no aliases: the model's do
            model = registry._call(
                f"registered model '{mv.name}'", registry.client.get_registered_model, mv.name
            )
            by_version: dict[str, list[str]] = {}
            for alias, version in (getattr(model, "aliases", None) or {}).items():
                by_version.setdefault(str(version), []).append(alias)
            aliases[mv.name] = by_version
        try:
            lineage = registry.lineage(mv)
        except RegistryError as exc:
            if exc.transient:
                raise
            lineage = {"tags": dict(mv.tags or {}), "gates": None, "metrics": {}}
        tags = lineage["tags"]
        rows.append(
            {
                "model": mv.name,
                "version": str(mv.version),
                "variant": tags.get(VARIANT_TAG, ""),
                "source": tags.get("graphtrim.source.version", ""),
                "source_name": tags.get("graphtrim.source.name", mv.name),
                "gates": lineage["gates"] or {},
                "metrics": lineage["metrics"],
                "aliases": sorted(aliases[mv.name].get(str(mv.version), [])),
                "model_id": logged_model_id(mv),
                "run_id": tags.get("graphtrim.pipeline_run_id") or mv.run_id,
                "created": mv.creation_timestamp,
            }
        )
    return rows


def _num(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, int | float) else "-"


def render_catalog(rows: Sequence[Mapping[str, Any]], *, ui: str | None, where: str) -> str:
    """A self-contained HTML page of :func:`registered_variants`' rows; ``ui`` is MLflow's
    UI address for the links (none without it), ``where`` the registry named in the title."""
    esc = html.escape
    body = []
    for r in rows:
        m = r["metrics"]
        passed = bool(r["gates"]) and all(s == "pass" for s in r["gates"].values())
        name = quote(str(r["model"]), safe="")
        version = esc(r["version"])
        if ui:
            version = (
                f'<a href="{esc(ui)}/#/models/{name}/versions/{esc(r["version"])}">v{version}</a>'
            )
        gates = ", ".join(f"{g} {s}" for g, s in r["gates"].items()) or "-"
        cells = [
            esc(str(r["model"])),
            version,
            esc(str(r["variant"])),
            esc(f"{r['source_name']} v{r['source']}" if r["source"] else "-"),
            f'<span class="{"ok" if passed else "bad"}">{esc(gates)}</span>',
            _num(m.get("speedup"), ".2f") + ("x" if m.get("speedup") else ""),
            _num(m.get("size_ratio"), ".2f") + ("x" if m.get("size_ratio") else ""),
            _num(m.get("p50_ms"), ".3f"),
            _num(m.get("nodes"), "d"),
            esc(", ".join(r["aliases"])) or "-",
        ]
        if ui and r.get("run_id"):
            cells.append(f'<a href="{esc(ui)}/#/runs/{esc(str(r["run_id"]))}">run</a>')
        else:
            cells.append("-")
        body.append(
            f'<tr data-model="{esc(str(r["model"]))}" data-version="{esc(r["version"])}">'
            + "".join(f"<td>{c}</td>" for c in cells)
            + "</tr>"
        )
    head = "".join(f"<th>{esc(c)}</th>" for c in (*COLUMNS, "pipeline run"))
    empty = (
        ""
        if rows
        else "<p>No graphtrim variants registered yet: run the optimize DAG on a model version.</p>"
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>graphtrim variants</title>
<style>
body{{font-family:system-ui,sans-serif;margin:1.5em}}
table{{border-collapse:collapse}} td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left}}
span.ok{{color:#161}} span.bad{{color:#a11}}
</style></head><body>
<h1>graphtrim variants</h1>
<p>{len(rows)} registered variant(s) in {esc(where)}, newest first. Speedups and sizes are each
variant's against its own source version, measured on the worker class it targets.</p>
{empty}<table id="variants"><tr>{head}</tr>{"".join(body)}</table>
</body></html>
"""
