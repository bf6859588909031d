"""Markdown and self-contained HTML reports of an evaluation (its JSON document).

The HTML embeds its plots as PNG data URIs (matplotlib, headless): latency distributions of the
reference and every variant, accuracy per variant against its threshold, nodes removed per pass,
and the op-type histogram before and after. Nothing is fetched when it is opened.
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from graphtrim.gates.readings import _gate, pareto_front
from graphtrim.stats import format_bytes

_STATUS_MARK = {"pass": "PASS", "fail": "FAIL", "undecided": "UNDECIDED", "error": "ERROR"}


def _fmt(v: Any, spec: str = ".4g") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


_bytes = format_bytes


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
    from graphtrim.gates.plots import plots  # imports this module's readers of the record

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
