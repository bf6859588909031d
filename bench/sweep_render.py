"""The corpus sweep's Markdown report: node counts against each anchor, the best anchor per model,
latency ratios."""

from __future__ import annotations

from typing import Any

import numpy as np

from graphtrim.verify.records import NOISE_FACTOR

ANCHORS = ("onnxsim", "onnxslim", "onnxoptimizer", "ort-basic", "onnxscript")
# a latency ratio above this is reported as slower than the input
SLOWER = 1.03


def _geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return float(np.exp(np.mean(np.log(values)))) if values else None


def best_anchor(r: dict[str, Any]) -> tuple[int | None, list[str], int | None]:
    """(nodes, tools, bytes) of the anchors with the fewest nodes among those whose output kept
    the results and stayed portable (no operator domain the input did not use: graphtrim's
    default target is the portable one)."""
    ok = {
        t: a
        for t, a in r["anchors"].items()
        if a.get("ok") and a.get("parity_ok") and not a.get("domains_added")
    }
    if not ok:
        return None, [], None
    best = min(a["nodes"] for a in ok.values())
    tools = [t for t, a in ok.items() if a["nodes"] == best]
    return best, tools, min(ok[t]["bytes"] for t in tools)


def render(results: list[dict[str, Any]]) -> str:
    tools = ["graphtrim", *ANCHORS]
    fams = sorted({r["family"] for r in results})
    out = [
        "## Per family: nodes (Σ, failed or changed outputs count as the input), "
        "graphtrim against the best anchor, latency and optimize time",
        "",
    ]
    out.append(
        "| family | models | input | "
        + " | ".join(tools)
        + " | wins / ties / losses | latency ratio, ORT all (geomean, worst) | wall s, graphtrim / onnxslim (geomean) |"
    )
    out.append("|---|---:|---:|" + "---:|" * len(tools) + "---|---|---|")

    def nodes_of(r: dict[str, Any], t: str) -> int:
        res = r["graphtrim"] if t == "graphtrim" else r["anchors"].get(t, {})
        return res["nodes"] if res.get("ok") and res.get("parity_ok") else r["original_nodes"]

    grand = dict.fromkeys(tools, 0)
    for fam in [*fams, None]:
        rows = [r for r in results if fam is None or r["family"] == fam]
        sums = {t: sum(nodes_of(r, t) for r in rows) for t in tools}
        wlt = [0, 0, 0]
        for r in rows:
            best, _, _ = best_anchor(r)
            if best is None or not r["graphtrim"].get("ok"):
                continue
            n = r["graphtrim"]["nodes"]
            wlt[0 if n < best else 1 if n == best else 2] += 1
        lat = [r["latency_ratio"] for r in rows if r.get("latency_ratio")]
        walls = [
            r for r in rows if "graphtrim" in r.get("wall", {}) and "onnxslim" in r.get("wall", {})
        ]
        g_gt = _geomean([r["wall"]["graphtrim"] for r in walls])
        g_sl = _geomean([r["wall"]["onnxslim"] for r in walls])
        label = fam or "**all**"
        lat_txt = f"{_geomean(lat):.3f}, {max(lat):.3f}" if lat else "-"
        wall_txt = f"{g_gt:.2f} / {g_sl:.2f}" if g_gt and g_sl else "-"
        out.append(
            f"| {label} | {len(rows)} | {sum(r['original_nodes'] for r in rows)} | "
            + " | ".join(str(sums[t]) for t in tools)
            + f" | {wlt[0]} / {wlt[1]} / {wlt[2]} | {lat_txt} | {wall_txt} |"
        )
        if fam is None:
            grand, _totals_wlt = sums, wlt
    out += ["", "Σ nodes: " + ", ".join(f"{t} {grand[t]}" for t in tools)]
    # what did not hold, model by model
    crashes = [r for r in results if r["graphtrim"].get("exit") not in (0, 2)]
    refused = [r for r in results if r["graphtrim"].get("exit") == 2]
    cannot_run = [
        r
        for r in results
        if r["graphtrim"].get("cannot_run")
        or "reference model" in (r["graphtrim"].get("parity_error") or "")
    ]

    def unstable(r: dict[str, Any]) -> bool:
        g = r["graphtrim"]
        noise = g.get("input_unstable_abs")
        return noise is not None and g.get("max_abs_diff", float("inf")) <= NOISE_FACTOR * noise

    changed = [
        r
        for r in results
        if r["graphtrim"].get("ok")
        and not r["graphtrim"].get("parity_ok")
        and r not in cannot_run
        and not unstable(r)
    ]
    unstable_inputs = [
        r
        for r in results
        if r["graphtrim"].get("ok") and not r["graphtrim"].get("parity_ok") and unstable(r)
    ]
    losses = []
    for r in results:
        best, names, best_bytes = best_anchor(r)
        if best is not None and r["graphtrim"].get("ok") and r["graphtrim"]["nodes"] > best:
            grows = best_bytes is not None and best_bytes > r["graphtrim"]["bytes"]
            losses.append((r, best, names, best_bytes, grows))
    slow = [r for r in results if r.get("latency_ratio", 0) > SLOWER]
    slower_wall = [
        r
        for r in results
        if r.get("wall", {}).get("graphtrim", 0) > r.get("wall", {}).get("onnxslim", float("inf"))
    ]
    out += [
        "",
        f"crashes: {len(crashes)}; changed results: {len(changed)}; unstable inputs (rounding alone moves them as far): {len(unstable_inputs)}; refused as invalid (exit 2): {len(refused)}; inputs that cannot run on random inputs: {len(cannot_run)}; "
        f"more nodes than the best anchor: {len(losses)}; slower than the input beyond {SLOWER}: {len(slow)}; "
        f"optimize slower than onnxslim's: {len(slower_wall)}",
    ]
    for r in unstable_inputs:
        g = r["graphtrim"]
        out.append(
            f"- {r['key']}: unstable input: graphtrim's output differs by {g['max_abs_diff']:.3g} "
            f"(abs), the input itself by {g['input_unstable_abs']:.3g} between onnxruntime "
            "without and with its own graph optimizations"
        )
    for r in crashes + refused + changed + cannot_run:
        if r["graphtrim"].get("parity_error"):
            out.append(f"- {r['key']}: {r['graphtrim']['parity_error']}")
            continue
        out.append(
            f"- {r['key']}: exit {r['graphtrim'].get('exit')}: {r['graphtrim'].get('error', 'parity ' + str(r['graphtrim'].get('max_rel_diff')))}"
        )
    for r, best, names, best_bytes, grows in losses:
        g = r["graphtrim"]
        note = (
            f" (the winner's file is {best_bytes - g['bytes']:+,} bytes against graphtrim's)"
            if grows
            else ""
        )
        out.append(f"- {r['key']}: graphtrim {g['nodes']} > {'/'.join(names)} {best}{note}")
    for r in results:
        for t, a in r["anchors"].items():
            if a.get("ok") and a.get("domains_added"):
                out.append(
                    f"- {r['key']}: {t}'s output ({a['nodes']} nodes) adds the operator domain "
                    f"{', '.join(a['domains_added'])}: not portable, not counted as the best anchor"
                )
    for r in slow:
        out.append(
            f"- {r['key']}: latency ratio {r['latency_ratio']:.3f} ({', '.join(f'{x:.3f}' for x in r['latency_ratios'])})"
        )
    for r in slower_wall:
        out.append(
            f"- {r['key']}: wall graphtrim {r['wall']['graphtrim']:.2f} s > onnxslim {r['wall']['onnxslim']:.2f} s"
        )
    return "\n".join(out)
