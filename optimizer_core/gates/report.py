"""Markdown and self-contained HTML reports of an evaluation (its JSON document).

The HTML embeds its plots as PNG data URIs (matplotlib, headless): latency distributions of the
reference and every variant, accuracy per variant against its threshold, nodes removed per pass,
and the op-type histogram before and after. Nothing is fetched when it is opened.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Mapping
from typing import Any

from optimizer_core.stats import _fmt_bytes

_STATUS_MARK = {"pass": "PASS", "fail": "FAIL", "undecided": "UNDECIDED", "error": "ERROR"}


def _fmt(v: Any, spec: str = ".4g") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


_bytes = _fmt_bytes


def _gate(variant: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    return next((g for g in variant["gates"] if g["gate"] == name), None)


# threshold -> (measured key, how it is compared, label)
_CHECKS: tuple[tuple[str, str, str, str], ...] = (
    ("min_cosine", "cosine", ">=", "cosine"),
    ("min_top1_agreement", "top1_agreement", ">=", "top-1 agreement"),
    ("max_metric_drop", "metric_drop", "<=", "metric drop"),
    ("max_abs_error", "max_abs_error", "<=", "max abs error"),
    ("max_rel_error", "max_rel_error", "<=", "max rel error"),
    ("min_speedup", "speedup_p50", ">=", "p50 speedup"),
    ("max_p50_ms", "p50_ms", "<=", "p50 ms"),
    ("max_p95_ms", "p95_ms", "<=", "p95 ms"),
    ("max_p99_ms", "p99_ms", "<=", "p99 ms"),
    ("max_noise", "spread", "<=", "timing spread"),
    ("max_ratio", "ratio", "<=", "size ratio"),
    ("max_bytes", "bytes", "<=", "bytes"),
)


def gate_numbers(gate: Mapping[str, Any]) -> str:
    """The measured value beside each threshold the gate applied (``cosine 0.99998 >= 0.99``),
    for passes as well as failures; empty when it measured nothing."""
    measured, limits = gate.get("measured") or {}, gate.get("thresholds") or {}
    parts = []
    for limit, key, op, label in _CHECKS:
        if limits.get(limit) is None or measured.get(key) is None:
            continue
        bound = _fmt(limits[limit])
        if limit == "max_metric_drop" and limits.get("metric_drop_mode") == "relative":
            bound += " of the reference's metric"
        parts.append(f"{label} {_fmt(measured[key])} (limit {op} {bound})")
    return ", ".join(parts)


def _gate_line(gate: Mapping[str, Any]) -> str:
    reasons = "; ".join(gate["reasons"]) if gate["reasons"] else "within thresholds"
    numbers = gate_numbers(gate)
    if not numbers:
        return reasons
    return f"{reasons}: {numbers}" if not gate["reasons"] else f"{reasons} ({numbers})"


def summary_rows(doc: Mapping[str, Any]) -> list[list[str]]:
    ref_bytes = doc["reference"]["bytes"]
    rows = []
    for v in doc["variants"]:
        model = v.get("model") or {}
        a = _gate(v, "accuracy")
        lt = _gate(v, "latency")
        am = (a or {}).get("measured", {})
        lm = (lt or {}).get("measured", {})
        rows.append(
            [
                v["name"],
                "PASS" if v["passed"] else "FAIL",
                _bytes(model.get("bytes")),
                _fmt(model.get("bytes", 0) / ref_bytes if ref_bytes and model else None, ".3f"),
                _fmt(model.get("nodes")),
                _fmt(am.get("cosine"), ".6f"),
                _fmt(am.get("top1_agreement"), ".4f"),
                _fmt(am.get("metric_drop"), "+.4f"),
                _fmt(lm.get("p50_ms"), ".3f"),
                _fmt(lm.get("speedup_p50"), ".3f"),
            ]
        )
    return rows


HEADER = [
    "variant",
    "verdict",
    "size",
    "size ratio",
    "nodes",
    "cosine",
    "top-1 agree",
    "metric drop",
    "p50 ms",
    "p50 speedup",
]


def render_markdown(doc: Mapping[str, Any]) -> str:
    ref = doc["reference"]
    fp = doc["fingerprint"]
    lines = [
        "# graphtrim evaluation",
        "",
        f"Reference `{ref['path']}`: {_bytes(ref['bytes'])}, {ref['nodes']} nodes. "
        f"Device `{doc['device']}` ({', '.join(fp.get('execution_providers', []))}), "
        f"{fp.get('intra_op_threads')} thread(s), on {fp.get('cpu_model')} "
        f"({fp.get('cpu_usable')} usable CPUs), onnxruntime {fp.get('onnxruntime')}.",
        f"Data: {doc['data_source']} (sha256 {str(fp.get('eval_data_sha256'))[:16]}). "
        f"Policy {doc['policy_hash']}. Passed: {', '.join(doc['passed']) or 'none'}.",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "|".join("---" if i < 2 else "---:" for i in range(len(HEADER))) + "|",
    ]
    for row in summary_rows(doc):
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    for v in doc["variants"]:
        lines.append(f"## {v['name']}: {'PASS' if v['passed'] else 'FAIL'}")
        for g in v["gates"]:
            lines.append(
                f"- **{g['gate']}** {_STATUS_MARK.get(g['status'], g['status'])}: {_gate_line(g)}"
            )
        build = v.get("build") or {}
        if build.get("excluded_nodes"):
            lines.append(
                f"- kept in float after {len(build.get('attempts', []))} attempt(s): "
                + ", ".join(f"`{n}`" for n in build["excluded_nodes"])
            )
        lines.append("")
    return "\n".join(lines)


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def plots(doc: Mapping[str, Any]) -> dict[str, str]:
    """Title -> PNG data URI for each plot the document has data for."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    out: dict[str, str] = {}
    samples = doc.get("latency_samples_ms") or {}
    if samples:
        fig, ax = plt.subplots(figsize=(7, 3.2))
        names = list(samples)
        # outliers drawn: a p95 far beyond the whiskers is what a user must see
        ax.boxplot(
            [samples[n] for n in names],
            orientation="horizontal",
            showfliers=True,
            flierprops={"marker": ".", "markersize": 3, "alpha": 0.5},
        )
        ax.set_yticks(range(1, len(names) + 1), names)
        ax.set_xlabel("latency per run, ms")
        ax.set_title("Latency distribution (interleaved runs)")
        out["Latency distributions"] = _png(fig)

    acc_rows: list[tuple[str, Mapping[str, Any]]] = []
    for v in doc["variants"]:
        g = _gate(v, "accuracy")
        if g is not None and g.get("measured"):
            acc_rows.append((v["name"], g))
    if acc_rows:
        fig, ax = plt.subplots(figsize=(7, 3.2))
        use_metric = all(g["measured"].get("variant_metric") is not None for _, g in acc_rows)
        names = [n for n, _ in acc_rows]
        if use_metric:
            values = [g["measured"]["variant_metric"] for _, g in acc_rows]
            refm = acc_rows[0][1]["measured"]["reference_metric"]
            ax.bar(names, values, color="#4c72b0")
            ax.axhline(refm, color="black", lw=1, label=f"reference {refm:.4f}")
            for i, (_, g) in enumerate(acc_rows):
                drop = g["thresholds"].get("max_metric_drop")
                if drop is not None:
                    mode = g["thresholds"].get("metric_drop_mode", "absolute")
                    floor = refm - drop * (refm if mode == "relative" else 1.0)
                    ax.plot([i - 0.4, i + 0.4], [floor, floor], color="red", lw=2)
            ax.set_ylabel(acc_rows[0][1]["measured"].get("metric") or "metric")
            lo = min([*values, refm]) - 0.05
            ax.set_ylim(max(0.0, lo), 1.0 if refm <= 1 else None)
        else:
            values = [g["measured"].get("cosine") or 0.0 for _, g in acc_rows]
            ax.bar(names, values, color="#4c72b0")
            for i, (_, g) in enumerate(acc_rows):
                floor = g["thresholds"].get("min_cosine")
                if floor is not None:
                    ax.plot([i - 0.4, i + 0.4], [floor, floor], color="red", lw=2)
            ax.set_ylabel("cosine similarity to the reference")
            ax.set_ylim(min([*values, 0.99]) - 0.001, 1.0005)
        ax.set_title("Accuracy per variant (red: threshold)")
        ax.legend(loc="lower right") if use_metric else None
        out["Accuracy per variant"] = _png(fig)

    per_pass: dict[str, int] = {}
    for v in doc["variants"]:
        opt = ((v.get("build") or {}).get("optimization") or {}).get("optimization") or {}
        for name, agg in (opt.get("per_pass") or {}).items():
            per_pass[name] = max(per_pass.get(name, 0), int(agg.get("nodes_removed", 0)))
        if per_pass:
            break
    per_pass = {k: v for k, v in per_pass.items() if v}
    if per_pass:
        fig, ax = plt.subplots(figsize=(7, 0.4 * len(per_pass) + 1.2))
        names = sorted(per_pass, key=per_pass.get)  # type: ignore[arg-type]
        ax.barh(names, [per_pass[n] for n in names], color="#55a868")
        ax.set_xlabel("nodes removed")
        ax.set_title("Nodes removed per pass (graph optimization)")
        out["Nodes removed per pass"] = _png(fig)

    ref_ops = doc["reference"].get("op_counts") or {}
    models = {"reference": ref_ops}
    for v in doc["variants"]:
        if v.get("model"):
            models[v["name"]] = v["model"].get("op_counts") or {}
    if ref_ops:
        totals: dict[str, int] = {}
        for counts in models.values():
            for op, c in counts.items():
                totals[op] = totals.get(op, 0) + c
        ops = sorted(totals, key=lambda o: -totals[o])[:16]
        fig, ax = plt.subplots(figsize=(8, 3.6))
        width = 0.8 / len(models)
        for i, (name, counts) in enumerate(models.items()):
            ax.bar(
                [j + i * width for j in range(len(ops))],
                [counts.get(op, 0) for op in ops],
                width,
                label=name,
            )
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ops))], ops, rotation=45, ha="right")
        ax.set_ylabel("nodes")
        ax.set_title("Op types before and after")
        ax.legend(fontsize=8)
        out["Op types before and after"] = _png(fig)
    return out


def render_html(doc: Mapping[str, Any]) -> str:
    esc = html.escape
    rows = "".join(
        "<tr>"
        + "".join(
            f'<td class="{("ok" if c == "PASS" else "bad") if i == 1 else ""}">{esc(c)}</td>'
            for i, c in enumerate(row)
        )
        + "</tr>"
        for row in summary_rows(doc)
    )
    head = "".join(f"<th>{esc(h)}</th>" for h in HEADER)
    gates = []
    for v in doc["variants"]:
        items = "".join(
            f"<li><b>{esc(g['gate'])}</b> {esc(_STATUS_MARK.get(g['status'], g['status']))}: "
            f"{esc(_gate_line(g))}</li>"
            for g in v["gates"]
        )
        gates.append(f"<h3>{esc(v['name'])}</h3><ul>{items}</ul>")
    try:
        figures = "".join(
            f'<figure><img alt="{esc(title)}" src="{uri}">'
            f"<figcaption>{esc(title)}</figcaption></figure>"
            for title, uri in plots(doc).items()
        )
    except ModuleNotFoundError as exc:  # plotting is an extra
        if not (exc.name or "").startswith("matplotlib"):
            raise
        figures = "<p>The plots need matplotlib: <code>pip install 'graphtrim[reports]'</code>.</p>"
    fp = "".join(
        f"<tr><th>{esc(str(k))}</th><td>{esc(str(v))}</td></tr>"
        for k, v in doc["fingerprint"].items()
    )
    ref = doc["reference"]
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>graphtrim evaluation</title>
<style>
body{{font-family:system-ui,sans-serif;margin:2em;max-width:1100px}}
table{{border-collapse:collapse;margin:1em 0}} td,th{{border:1px solid #ccc;padding:4px 8px}}
td.ok{{background:#dfd}} td.bad{{background:#fdd}} figure{{display:inline-block;margin:1em}}
</style></head><body>
<h1>graphtrim evaluation</h1>
<p>Reference <code>{esc(ref["path"])}</code>: {esc(_bytes(ref["bytes"]))}, {ref["nodes"]} nodes.
Device <code>{esc(doc["device"])}</code>. Data: {esc(doc["data_source"])}.
Passed: {esc(", ".join(doc["passed"]) or "none")}.</p>
<table><tr>{head}</tr>{rows}</table>
<h2>Gates</h2>{"".join(gates)}
<h2>Plots</h2>{figures}
<h2>Measured on</h2><table>{fp}</table>
</body></html>
"""
