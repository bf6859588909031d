"""A search's report: every trial, the Pareto front (speed, size, accuracy) and the champion,
as JSON, Markdown and HTML (the front drawn with matplotlib when installed)."""

from __future__ import annotations

import html
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

HEADER = [
    "#",
    "candidate",
    "origin",
    "status",
    "size",
    "speedup p50",
    "runs",
    "cosine",
    "build s",
    "verdict",
]


def _f(v: Any, spec: str) -> str:
    return format(v, spec) if isinstance(v, int | float) else "-"


def summary(doc: Mapping[str, Any]) -> str:
    """One line: the champion, its speedup and size, and why the search stopped."""
    c = doc.get("champion")
    trials = len(doc.get("trials") or [])
    head = f"{trials} trial(s) in {doc['seconds']:.0f} s ({doc['mode']}; stopped: {doc['stopped']})"
    if not c:
        return f"no champion: {head}"
    timing = c["timings"][-1] if c.get("timings") else {}
    versus = ""
    vs = doc.get("against_recipe") or {}
    if vs.get("champion_over_recipe"):
        verdict = "" if vs["recipe_passed"] else ", which failed its gates"
        versus = f", {vs['champion_over_recipe']:.3f}x the fixed recipe {vs['recipe']}{verdict}"
    return (
        f"champion {c['key']}: {timing.get('speedup_p50', 0):.3f}x p50, "
        f"{c.get('size_ratio') or 0:.3f}x the size{versus}; {head}"
    )


def rows(doc: Mapping[str, Any]) -> list[list[str]]:
    front = set(doc.get("front") or [])
    champion = (doc.get("champion") or {}).get("number")
    out = []
    for t in doc["trials"]:
        timing = t["timings"][-1] if t["timings"] else {}
        verdict = t.get("verdict")
        mark = "champion" if t["number"] == champion else ("front" if t["number"] in front else "")
        out.append(
            [
                str(t["number"]),
                t["key"] + (f" ({mark})" if mark else ""),
                t["origin"],
                t["status"] + (f": {t['error']}" if t.get("error") else ""),
                _f(t.get("size_ratio"), ".3f"),
                _f(timing.get("speedup_p50"), ".3f"),
                str(timing.get("runs", "-")),
                _f((t.get("accuracy") or {}).get("cosine"), ".5f"),
                _f(t.get("build_s"), ".1f"),
                "-"
                if verdict is None
                else ("PASS" if verdict["passed"] else "FAIL: " + "; ".join(verdict["reasons"])),
            ]
        )
    return out


def render_markdown(doc: Mapping[str, Any]) -> str:
    lines = [
        f"# graphtrim tune: {Path(doc['source']).name} on {doc['device']}",
        "",
        summary(doc),
        "",
        f"Objective: {doc['objective']}. Budget {doc['budget_s']:.0f} s. "
        f"Graph signature `{doc['signature']}`.",
    ]
    if doc.get("remembered"):
        lines.append(f"Started from the remembered `{doc['remembered'].get('key')}`.")
    lines += [f"- {n}" for n in doc.get("notes") or []]
    lines += ["", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows(doc)]
    return "\n".join(lines) + "\n"


def front_plot(doc: Mapping[str, Any]) -> str | None:
    """The trials' speed against size, the front and the champion marked, as a PNG data URI."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from graphtrim.gates.plots import _png

    pts = [
        (t, t["timings"][-1]["speedup_p50"], t["size_ratio"])
        for t in doc["trials"]
        if t["timings"] and t.get("size_ratio")
    ]
    if not pts:
        return None
    front = set(doc.get("front") or [])
    champion = (doc.get("champion") or {}).get("number")
    fig, ax = plt.subplots(figsize=(7, 4))
    for t, speed, size in pts:
        on = t["number"] in front
        ax.scatter(size, speed, s=60 if on else 25, c="tab:green" if on else "tab:gray", zorder=2)
        if t["number"] == champion:
            ax.scatter(size, speed, s=180, facecolors="none", edgecolors="tab:red", zorder=3)
        ax.annotate(
            str(t["number"]), (size, speed), fontsize=7, xytext=(3, 3), textcoords="offset points"
        )
    ax.axhline(1.0, color="#999", lw=0.8)
    ax.set_xlabel("size / reference")
    ax.set_ylabel("p50 speedup over the reference")
    ax.set_title("trials (green: Pareto front, circled: champion)")
    return _png(fig)


def _figure(doc: Mapping[str, Any]) -> str:
    try:
        uri = front_plot(doc)
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("matplotlib"):
            raise
        return "<p>The plot needs matplotlib: <code>pip install 'graphtrim[reports]'</code>.</p>"
    return f'<figure><img alt="Pareto front" src="{uri}"></figure>' if uri else ""


def search_section(kind: str, doc: Mapping[str, Any]) -> str:
    """The search of one variant kind as a section of another report (the pipeline's
    comparison): its summary line and its trials' speed/size front."""
    esc = html.escape
    return f'<h3 id="search-{esc(kind)}">{esc(kind)}</h3><p>{esc(summary(doc))}</p>{_figure(doc)}'


def render_html(doc: Mapping[str, Any]) -> str:
    from graphtrim.gates.report import _table

    esc = html.escape
    figure = _figure(doc)
    notes = "".join(f"<li>{esc(n)}</li>" for n in doc.get("notes") or [])
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>graphtrim tune</title>
<style>
body{{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}}
table{{border-collapse:collapse;margin:1em 0}} td,th{{border:1px solid #ccc;padding:4px 8px}}
</style></head><body>
<h1>graphtrim tune: {esc(Path(doc["source"]).name)} on {esc(doc["device"])}</h1>
<p id="summary">{esc(summary(doc))}</p>
<p>Objective {esc(doc["objective"])}, budget {doc["budget_s"]:.0f} s, graph signature
<code>{esc(doc["signature"])}</code>.</p><ul>{notes}</ul>
{figure}
<h2>Trials</h2>{_table(HEADER, rows(doc))}
</body></html>
"""


def write_tune_reports(doc: Mapping[str, Any], folder: str | os.PathLike[str]) -> dict[str, Path]:
    """``tune.json``, ``tune.md``, ``tune.html`` in ``folder``, each replaced at once."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    for kind, name, text in (
        ("json", "tune.json", json.dumps(doc, indent=2)),
        ("markdown", "tune.md", render_markdown(doc)),
        ("html", "tune.html", render_html(doc)),
    ):
        path = out / name
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
        written[kind] = path
    return written
