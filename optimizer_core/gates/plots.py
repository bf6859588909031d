"""The report's plots (matplotlib, headless, as PNG data URIs): latency distributions, speed
against accuracy with the Pareto front, accuracy per variant, nodes removed per pass and op types
before and after."""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping
from typing import Any

from graphtrim.gates.readings import _accuracy_axis, _gate, pareto_front, points


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
