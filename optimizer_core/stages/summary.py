"""The pipeline's result as a table: each variant, its gate verdicts, key numbers, the version
registered and the aliases on it. Printed by ``graphtrim pipeline run`` and logged by the DAG's
summary task."""

from __future__ import annotations

from typing import Any


def table(records: dict[str, Any]) -> str:
    """Variants, their gate verdicts, key numbers and the versions registered."""
    validated = records.get("validate", {})
    registered = records.get("register", {}).get("registered", {})
    existing = records.get("register", {}).get("existing", {})
    aliases = records.get("promote", {}).get("aliases", {})
    champion = records.get("promote", {}).get("champion", {})
    rows = [
        (
            "variant",
            "result",
            "serving",
            "size gate",
            "accuracy",
            "latency",
            "speedup",
            "size ratio",
            "registered",
        )
    ]
    for name, s in validated.get("variants", {}).items():
        g, m = s["gates"], s["metrics"]
        reg = registered.get(name)
        where = "-"
        if reg:
            where = f"v{reg['version']}" + ("" if reg["created"] else " (existing)")
            tags = [a for a, rec in aliases.items() if rec["version"] == reg["version"]]
            holder = champion.get("version") if champion.get("moved") else champion.get("holder")
            if champion.get("alias") and holder == reg["version"]:
                tags.append(str(champion["alias"]))
            if tags:
                where += " @" + ",".join(tags)
        outcome = "PASS" if s["passed"] else "FAIL"
        if s.get("measured") is False:
            outcome = "NOT REACHED"
        if name in existing:
            outcome += f" (existing v{existing[name]['version']})"
        elif s.get("reused"):
            outcome += " (recorded)"
        rows.append(
            (
                name,
                outcome,
                g.get("serving", g.get("runtime", "-")),
                g.get("size", "-"),
                g.get("accuracy", g.get("build", "-")),
                g.get("latency", "-"),
                f"{m['speedup']:.2f}x" if m.get("speedup") else "-",
                f"{m['size_ratio']:.2f}x" if m.get("size_ratio") else "-",
                where,
            )
        )
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if champion:
        lines.append("")
        lines.append(
            f"{champion.get('alias')}: "
            + (f"moved to v{champion['version']} " if champion.get("moved") else "unchanged ")
            + f"({champion.get('reason', '')})"
        )
    comparison = (records.get("register", {}).get("reports") or {}).get("html")
    every = [r.get("html") for r in validated.get("all_reports", []) if r.get("html")]
    if comparison:
        lines.append(f"report (every variant side by side): {comparison}")
    elif len(every) > 1:
        lines.append(f"reports ({len(every)}, one per variant): {every[0].rsplit('/', 1)[0]}/")
    elif validated.get("reports"):
        lines.append(f"report: {validated['reports'].get('html')}")
    return "\n".join(lines)
