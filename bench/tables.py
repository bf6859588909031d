"""The benchmark's tables (``python -m bench``): per model, the nodes, bytes, parity and latency
of graphtrim's output and of each anchor's, and the summary over the models (geometric means
against the anchors)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

ANCHORS = ("onnxsim", "onnxslim", "onnxoptimizer", "ort-basic", "onnxscript")


def _geomean(values: list[float]) -> float | None:
    return float(np.exp(np.mean(np.log(values)))) if values else None


def _summary(rows: list[dict[str, Any]], tools: list[str], totals: dict[str, int]) -> list[str]:
    out = ["", "## graphtrim against the best anchor per model (nodes; anchors with parity)", ""]
    mine = [t for t in tools if t.startswith("graphtrim")]
    anchors = [t for t in tools if t in ANCHORS]
    out.append("| model | best anchor | " + " | ".join(mine) + " |")
    out.append("|---|---|" + "---|" * len(mine))
    wins = dict.fromkeys(mine, 0)
    for r in rows:
        ok = {
            t: r["tools"][t]["nodes"]
            for t in anchors
            if r["tools"].get(t, {}).get("ok") and r["tools"][t].get("parity_ok")
        }
        if not ok:
            continue
        best = min(ok.values())
        names = "/".join(t for t, n in ok.items() if n == best)
        cells = []
        for t in mine:
            res = r["tools"].get(t, {})
            if not res.get("ok"):
                cells.append("✗")
                continue
            n = res["nodes"]
            wins[t] += n <= best
            cells.append(f"{n} ({'≤' if n <= best else '>'} {best})")
        out.append(f"| {r['model']} | {names} {best} | " + " | ".join(cells) + " |")
    out.append("")
    out.append(
        "models at or below the best anchor: "
        + ", ".join(f"{t} {wins[t]}/{len(rows)}" for t in mine)
    )
    out.append("node totals: " + ", ".join(f"{t} {totals[t]}" for t in tools))
    # optimize time: geometric mean over the models every tool optimized
    common = [r for r in rows if all(r["tools"].get(t, {}).get("ok") for t in tools)]
    times = {t: _geomean([r["tools"][t]["seconds"] for r in common]) for t in tools}
    out.append(
        f"optimize time geomean over {len(common)} models, s: "
        + ", ".join(f"{t} {v:.3f}" for t, v in times.items() if v is not None)
    )
    for key, label in (("latency_ratio_ort_on", "on"), ("latency_ratio_ort_off", "off")):
        geo = {
            t: _geomean([r["tools"][t][key] for r in rows if r["tools"].get(t, {}).get(key)])
            for t in tools
        }
        if any(v is not None for v in geo.values()):
            out.append(
                f"latency ratio to the original, geomean (ORT opt {label}): "
                + ", ".join(f"{t} {v:.3f}" for t, v in geo.items() if v is not None)
            )
    return out


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _per_tool(
    title: str,
    rows: list[dict[str, Any]],
    tools: list[str],
    cell: Callable[[dict[str, Any], dict[str, Any]], str],
    *,
    original: Callable[[dict[str, Any]], str] | None = None,
    align: str = "---:|",
) -> list[str]:
    """A section with a table of a row per model and a cell per tool: ``cell(result, row)`` where
    the tool succeeded, ✗ where it failed; ``original(row)`` first where given."""
    out = ["", f"## {title}", ""]
    out.append(("| model | original | " if original else "| model | ") + " | ".join(tools) + " |")
    out.append(("|---|---:|" if original else "|---|") + align * len(tools))
    for r in rows:
        cells = []
        for t in tools:
            res = r["tools"].get(t, {})
            cells.append(cell(res, r) if res.get("ok") else "✗")
        first = f"| {r['model']} | " + (f"{original(r)} | " if original else "")
        out.append(first + " | ".join(cells) + " |")
    return out


def _parity_cell(res: dict[str, Any], r: dict[str, Any]) -> str:
    rel = res.get("max_rel_diff")
    lat = f"{_fmt(res.get('latency_ratio_ort_off'), '.2f')}/{_fmt(res.get('latency_ratio_ort_on'), '.2f')}"
    return f"{'ok' if res.get('parity_ok') else 'FAIL'} {_fmt(rel, '.0e')} {lat}"


def render(rows: list[dict[str, Any]], tools: list[str]) -> str:
    out = ["## Nodes after (fewer is better; ✗ = failed or changed results)", ""]
    out.append("| model | original | " + " | ".join(tools) + " |")
    out.append("|---|---:|" + "---:|" * len(tools))
    totals = dict.fromkeys(tools, 0)
    complete = dict.fromkeys(tools, True)
    for r in rows:
        cells = []
        for t in tools:
            res = r["tools"].get(t, {})
            if res.get("ok"):
                totals[t] += res["nodes"]
                mark = "" if res.get("parity_ok") else " ✗"
                cells.append(f"{res['nodes']}{mark}")
            else:
                complete[t] = False
                totals[t] += r["original_nodes"]
                cells.append("✗")
        out.append(f"| {r['model']} | {r['original_nodes']} | " + " | ".join(cells) + " |")
    out.append(
        f"| **total** | {sum(r['original_nodes'] for r in rows)} | "
        + " | ".join(f"**{totals[t]}**" for t in tools)
        + " |"
    )
    out += _per_tool(
        "Optimize time, s (peak RSS, MB)",
        rows,
        tools,
        lambda res, r: f"{res['seconds']:.2f} ({res['peak_rss_mb']:.0f})",
    )
    out += _per_tool(
        "Model size after / before (file plus external data)",
        rows,
        tools,
        lambda res, r: f"{res['bytes'] / r['original_bytes']:.2f}x",
        original=lambda r: f"{r['original_bytes'] / 1024:.0f} KiB",
    )
    out += _per_tool(
        "Parity (max relative diff) and latency ratio to the original, p50 (ORT opt off / on)",
        rows,
        tools,
        _parity_cell,
        align="---|",
    )
    fails = {
        t: sum(
            1
            for r in rows
            if r["tools"].get(t, {}).get("ok") and not r["tools"][t].get("parity_ok")
        )
        for t in tools
    }
    out += ["", "parity failures: " + ", ".join(f"{t} {n}" for t, n in fails.items())]
    out += _summary(rows, tools, totals)
    return "\n".join(out)
