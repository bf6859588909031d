"""Markdown and self-contained HTML reports of an evaluation (its JSON document).

The HTML embeds its plots as PNG data URIs (matplotlib, headless): latency distributions of the
reference and every variant, accuracy per variant against its threshold, nodes removed per pass,
and the op-type histogram before and after. Nothing is fetched when it is opened.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from graphtrim.stats import format_bytes

_STATUS_MARK = {"pass": "PASS", "fail": "FAIL", "undecided": "UNDECIDED", "error": "ERROR"}


def _fmt(v: Any, spec: str = ".4g") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


_bytes = format_bytes


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
        if limit == "max_noise":  # the undecided rule, not a bound the spread must meet
            parts.append(
                f"{label} {_fmt(measured[key])} (above {bound} undecided only when the blocks' "
                "speedups straddle the threshold)"
            )
            continue
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


def _accuracy_axis(doc: Mapping[str, Any]) -> tuple[str, dict[str, float], bool]:
    """The accuracy measure every measured variant has, as (label, variant -> value, whether
    higher is better): the task metric's drop when a labelled data set was given, else the
    cosine similarity of the outputs, else top-1 agreement."""
    measured = {
        v["name"]: (_gate(v, "accuracy") or {}).get("measured") or {} for v in doc["variants"]
    }
    measured = {k: m for k, m in measured.items() if m}
    for key, label, higher in (
        ("metric_drop", "metric drop against the reference", False),
        ("cosine", "cosine similarity to the reference", True),
        ("top1_agreement", "top-1 agreement with the reference", True),
    ):
        values = {k: m.get(key) for k, m in measured.items()}
        if values and all(isinstance(x, int | float) for x in values.values()):
            return label, {k: float(x) for k, x in values.items()}, higher  # type: ignore[arg-type]
    return "", {}, True


def points(doc: Mapping[str, Any]) -> dict[str, tuple[float, float, float]]:
    """Each variant measured for both speed and accuracy as (p50 speedup, accuracy, size
    ratio), accuracy oriented so that higher is better; the reference is (1, best, 1)."""
    _, acc, higher = _accuracy_axis(doc)
    ref_bytes = doc["reference"]["bytes"] or 0
    out: dict[str, tuple[float, float, float]] = {}
    for v in doc["variants"]:
        speed = ((_gate(v, "latency") or {}).get("measured") or {}).get("speedup_p50")
        size = (v.get("model") or {}).get("bytes")
        if v["name"] not in acc or not isinstance(speed, int | float) or not size or not ref_bytes:
            continue
        a = acc[v["name"]] if higher else -acc[v["name"]]
        out[v["name"]] = (float(speed), a, size / ref_bytes)
    return out


def pareto_front(doc: Mapping[str, Any]) -> list[str]:
    """The variants that passed their gates and that no other passing variant, nor the
    reference itself, beats on speed, accuracy and size at once (at least as good on all three
    and better on one)."""
    pts = points(doc)
    passed = set(doc.get("passed") or [])
    candidates = {k: p for k, p in pts.items() if k in passed}
    # the reference agrees with itself: cosine and agreement 1, no metric drop
    best = (1.0, 1.0 if _accuracy_axis(doc)[2] else 0.0, 1.0)

    def beats(a: tuple[float, float, float], b: tuple[float, float, float]) -> bool:
        ge = a[0] >= b[0] and a[1] >= b[1] and a[2] <= b[2]
        return ge and (a[0] > b[0] or a[1] > b[1] or a[2] < b[2])

    return [
        k
        for k, p in candidates.items()
        if not beats(best, p) and not any(beats(q, p) for j, q in candidates.items() if j != k)
    ]


def summary_rows(doc: Mapping[str, Any]) -> list[list[str]]:
    ref_bytes = doc["reference"]["bytes"]
    front = set(pareto_front(doc))
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
                "yes" if v["name"] in front else "-",
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
    "Pareto",
]


def render_markdown(doc: Mapping[str, Any]) -> str:
    ref = doc["reference"]
    fp = doc["fingerprint"]
    lines = [
        f"# {doc.get('title') or 'graphtrim evaluation'}",
        "",
        f"Reference `{_reference_name(doc)}`: {_bytes(ref['bytes'])}, {ref['nodes']} nodes. "
        f"Device `{doc['device']}` ({', '.join(fp.get('execution_providers', []))}), "
        f"{fp.get('intra_op_threads')} thread(s), on {fp.get('cpu_model')} "
        f"({fp.get('cpu_usable')} usable CPUs), onnxruntime {fp.get('onnxruntime')}.",
        f"Data: {doc['data_source']} (sha256 {str(fp.get('eval_data_sha256'))[:16]}). "
        f"Policy {doc['policy_hash']}. Passed: {', '.join(doc['passed']) or 'none'}. "
        f"Pareto front (speed, accuracy, size): {', '.join(pareto_front(doc)) or 'none'}.",
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

    pts = points(doc)
    if pts:
        label, _, higher = _accuracy_axis(doc)
        front = set(pareto_front(doc))
        passed = set(doc.get("passed") or [])
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.scatter([1.0], [1.0 if higher else 0.0], marker="*", s=160, color="black")
        ax.annotate(
            "reference",
            (1.0, 1.0 if higher else 0.0),
            fontsize=8,
            xytext=(5, 5),
            textcoords="offset points",
        )
        for name, (speed, acc, ratio) in pts.items():
            y = acc if higher else -acc
            ax.scatter(
                [speed],
                [y],
                s=40 + 260 * min(ratio, 1.5),
                color="#c44e52" if name in front else "#4c72b0",
                marker="o" if name in passed else "x",
                alpha=0.8,
            )
            ax.annotate(
                f"{name} ({ratio:.2f}x size)",
                (speed, y),
                fontsize=8,
                xytext=(5, -12),
                textcoords="offset points",
            )
        ordered = sorted((pts[n][0], pts[n][1] if higher else -pts[n][1]) for n in front)
        if len(ordered) > 1:
            ax.plot(*zip(*ordered, strict=True), color="#c44e52", lw=1, ls="--")
        if not higher:
            ax.invert_yaxis()  # less drop is better: better is up
        ax.set_xlabel("p50 speedup over the reference (higher is better)")
        ax.set_ylabel(label)
        ax.set_title("Speed against accuracy (red: Pareto front, x: failed, area: size)")
        out["Speed against accuracy"] = _png(fig)

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


def _reference_name(doc: Mapping[str, Any]) -> str:
    """What the reference is: its registry name when a pipeline knows it, else its file."""
    ref = doc["reference"]
    return str(ref.get("label") or ref["path"])


def op_rows(doc: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Per op type: nodes in the reference and in each variant (with the change), most
    frequent first."""
    ref_ops = doc["reference"].get("op_counts") or {}
    built = [v for v in doc["variants"] if v.get("model")]
    ops = sorted(
        set(ref_ops).union(*((v["model"].get("op_counts") or {}) for v in built)),
        key=lambda o: (-ref_ops.get(o, 0), o),
    )
    rows = []
    for op in ops:
        row = [op, str(ref_ops.get(op, 0))]
        for v in built:
            n = (v["model"].get("op_counts") or {}).get(op, 0)
            d = n - ref_ops.get(op, 0)
            row.append(f"{n} ({d:+d})" if d else str(n))
        rows.append(row)
    return ["op type", "reference", *(v["name"] for v in built)], rows


def build_rows(doc: Mapping[str, Any]) -> list[list[str]]:
    """Each variant's build record: seconds, attempts, nodes kept in float, its settings and
    how the built file agreed with the float model."""
    rows = []
    for v in doc["variants"]:
        b = v.get("build")
        if not b:
            continue
        config = b.get("config") or {}
        settings = ", ".join(
            f"{k}={config[k]}"
            for k in sorted(config)
            if config[k] not in (None, [], {}, "") and not isinstance(config[k], dict | list)
        )
        agreement = b.get("agreement") or {}
        rows.append(
            [
                v["name"],
                _fmt(b.get("seconds"), ".1f"),
                str(len(b.get("attempts") or [])),
                ", ".join(b.get("excluded_nodes") or []) or "-",
                settings or "-",
                _fmt(agreement.get("cosine"), ".6f"),
            ]
        )
    return rows


BUILD_HEADER = ["variant", "build s", "attempts", "kept in float", "settings", "cosine at build"]


def combine(docs: list[Mapping[str, Any]], *, label: str | None = None) -> dict[str, Any]:
    """One document from evaluations of the same reference made apart (one task per variant):
    every variant side by side, each with the numbers its own task measured. Each task timed
    its variants interleaved with the reference, so its reference samples keep the names of
    the variants they were timed with; differing hardware fingerprints are all kept."""
    if not docs:
        raise ValueError("no evaluations to combine")
    first = docs[0]
    variants: dict[str, Any] = {}
    samples: dict[str, list[float]] = {}
    fingerprints: list[Mapping[str, Any]] = []
    for d in docs:
        names = [v["name"] for v in d["variants"]]
        for v in d["variants"]:
            variants[v["name"]] = v
        for key, values in (d.get("latency_samples_ms") or {}).items():
            if key == "reference" and len(docs) > 1:
                key = f"reference (with {', '.join(names)})"
            samples[key] = list(values)
        if d.get("fingerprint") not in fingerprints:
            fingerprints.append(d.get("fingerprint") or {})
    reference = dict(first["reference"])
    if label:
        reference["label"] = label
    return {
        **first,
        "title": f"graphtrim comparison: {label}" if label else "graphtrim comparison",
        "reference": reference,
        "passed": [n for n, v in variants.items() if v["passed"]],
        "variants": list(variants.values()),
        "latency_samples_ms": samples,
        "fingerprints": fingerprints if len(fingerprints) > 1 else [],
        "seconds": round(sum(float(d.get("seconds") or 0) for d in docs), 3),
    }


def _table(head: list[str], rows: list[list[str]], *, mark: int | None = None) -> str:
    """An HTML table; the cells of column ``mark`` are coloured by PASS / FAIL."""
    esc = html.escape

    def cell(i: int, c: str) -> str:
        if i != mark:
            return f"<td>{esc(c)}</td>"
        return f'<td class="{"ok" if c == "PASS" else "bad"}">{esc(c)}</td>'

    body = "".join(
        "<tr>" + "".join(cell(i, c) for i, c in enumerate(row)) + "</tr>" for row in rows
    )
    return f"<table><tr>{''.join(f'<th>{esc(h)}</th>' for h in head)}</tr>{body}</table>"


def render_html(doc: Mapping[str, Any], sections: Mapping[str, str] | None = None) -> str:
    """The report as one HTML page; ``sections``: more sections at its end, title -> HTML
    (what the layers above add: the settings search's trials, ...)."""
    esc = html.escape
    title = str(doc.get("title") or "graphtrim evaluation")
    summary = _table(HEADER, summary_rows(doc), mark=1)
    gates = []
    for v in doc["variants"]:
        items = "".join(
            f"<li><b>{esc(g['gate'])}</b> {esc(_STATUS_MARK.get(g['status'], g['status']))}: "
            f"{esc(_gate_line(g))}</li>"
            for g in v["gates"]
        )
        gates.append(f'<h3 id="variant-{esc(v["name"])}">{esc(v["name"])}</h3><ul>{items}</ul>')
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
    builds = build_rows(doc)
    build_section = f"<h2>Builds</h2>{_table(BUILD_HEADER, builds)}" if builds else ""
    op_head, ops = op_rows(doc)
    prints = list(doc.get("fingerprints") or []) or [doc["fingerprint"]]
    fp = "".join(
        f"<table>{''.join(f'<tr><th>{esc(str(k))}</th><td>{esc(str(v))}</td></tr>' for k, v in p.items())}</table>"
        for p in prints
    )
    ref = doc["reference"]
    front = pareto_front(doc)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>
<style>
body{{font-family:system-ui,sans-serif;margin:2em;max-width:1100px}}
table{{border-collapse:collapse;margin:1em 0}} td,th{{border:1px solid #ccc;padding:4px 8px}}
td.ok{{background:#dfd}} td.bad{{background:#fdd}} figure{{display:inline-block;margin:1em}}
</style></head><body>
<h1>{esc(title)}</h1>
<p>Reference <code>{esc(_reference_name(doc))}</code>: {esc(_bytes(ref["bytes"]))}, {ref["nodes"]} nodes.
Device <code>{esc(doc["device"])}</code>. Data: {esc(doc["data_source"])}.
Passed: {esc(", ".join(doc["passed"]) or "none")}.
Pareto front (speed, accuracy, size; passing variants): {esc(", ".join(front) or "none")}.</p>
<div id="summary">{summary}</div>
<h2>Gates</h2>{"".join(gates)}
<h2>Plots</h2>{figures}
{build_section}
<h2>Op types</h2>{_table(op_head, ops)}
<h2>Measured on</h2>{fp}
{"".join(f"<h2>{esc(t)}</h2>{body}" for t, body in (sections or {}).items())}
</body></html>
"""


def write_reports(
    doc: Mapping[str, Any],
    folder: str | os.PathLike[str],
    *,
    stem: str,
    sections: Mapping[str, str] | None = None,
) -> dict[str, Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and ``<stem>.html`` of ``doc`` into ``folder``,
    each replacing its file at once (no half-written report); kind -> path. ``sections``: more
    HTML sections (:func:`render_html`)."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "json": (out / f"{stem}.json", json.dumps(doc, indent=2)),
        "markdown": (out / f"{stem}.md", render_markdown(doc)),
        "html": (out / f"{stem}.html", render_html(doc, sections)),
    }
    written: dict[str, Path] = {}
    for kind, (path, text) in files.items():
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
        written[kind] = path
    return written
