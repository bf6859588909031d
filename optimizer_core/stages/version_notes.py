"""What a registered version carries besides its model: its description (the gates' verdicts and
measurements, within MLflow's limit), the comparison report of its run, and the tags of its
conversion and its settings search."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from graphtrim.redact import redact
from graphtrim.stages.context import PipelineConfig, StageContext
from graphtrim.stages.records import ValidateRecord
from graphtrim.stages.tracking import T, publish_reports

logger = logging.getLogger("graphtrim.stages")

DESCRIPTION_LIMIT = 5000  # MLflow's column for a version's description
COMPARISON = "comparison"


def comparison_report(
    ctx: StageContext,
    client: Any,
    config: PipelineConfig,
    val: ValidateRecord,
    tmp: Path,
) -> tuple[dict[str, Any] | None, dict[str, str] | None]:
    """One report of every variant this run judged, side by side (the validate tasks'
    evaluations combined, each variant's build record from the run): written to the artifact
    store beside the evaluations and to the run's ``graphtrim/reports``. (None, None) when the
    run judged nothing new (every verdict was recorded before)."""
    from graphtrim.gates.report import combine, write_reports

    every = [r for r in (val.all_reports or [val.reports]) if r and r.get("json")]
    if not every:
        return None, None
    docs = []
    for i, r in enumerate(every):
        docs.append(json.loads(ctx.fetch_file(r["json"], tmp / f"evaluation-{i}.json").read_text()))
    source = val.source
    doc = combine(docs, label=f"models:/{source['name']}/{source['version']}")
    for v in doc["variants"]:
        if v.get("build") is None:
            with contextlib.suppress(Exception):  # a variant that was never built has none
                got = client.download_artifacts(
                    val.run_id, f"graphtrim/build-{v['name']}.json", str(tmp / "builds")
                )
                v["build"] = json.loads(Path(got).read_text())
    doc["pipeline"] = {"run_id": val.run_id, "config_hash": config.config_hash}
    written = write_reports(
        doc, tmp / COMPARISON, stem=COMPARISON, sections=_search_sections(client, val, tmp)
    )
    uris = publish_reports(ctx.store(), client, val.run_id, source, config.config_hash, written)
    return doc, uris


def _search_sections(client: Any, val: ValidateRecord, tmp: Path) -> dict[str, str]:
    """The settings search of each variant a search chose (its trials' speed/size front), as
    a section of the comparison report; none without a search."""
    from graphtrim.tune.report import search_section

    parts = []
    for kind, summary in sorted(val.variants.items()):
        if not summary.get("tuning"):
            continue
        try:
            got = client.download_artifacts(
                val.run_id, f"graphtrim/tune-{kind}.json", str(tmp / "searches")
            )
            parts.append(search_section(kind, json.loads(Path(got).read_text())))
        except Exception as exc:  # the report goes on without it
            logger.warning("register: no search section for %s: %s", kind, redact(exc))
    return {"Settings search": "".join(parts)} if parts else {}


def describe(
    variant: str,
    source: Mapping[str, Any],
    summary: Mapping[str, Any],
    *,
    config: PipelineConfig,
    run_id: str,
    gates: list[Mapping[str, Any]] | None = None,
    report: str | None = None,
    report_link: str | None = None,
) -> str:
    """A registered variant's description in Markdown: what it is, its gates with their
    numbers against their limits (``gates``: the evaluation's gate documents; their verdicts
    alone without them), its key numbers and where the comparison report is (``report_link``:
    its page in MLflow's UI, when there is one)."""
    from graphtrim.gates.report import gate_numbers
    from graphtrim.stats import format_bytes

    m = summary.get("metrics") or {}
    lines = [
        f"graphtrim **{variant}** variant of `{source['name']}` version {source['version']} "
        f"(preset `{config.preset}`, device `{config.device}`).",
        "",
        "| gate | verdict | measured (limit) |",
        "|---|---|---|",
    ]
    for g in gates or [{"gate": k, "status": v} for k, v in (summary.get("gates") or {}).items()]:
        numbers = gate_numbers(g) if g.get("measured") else ""
        lines.append(f"| {g['gate']} | {str(g['status']).upper()} | {numbers or '-'} |")
    facts = []
    if m.get("speedup"):
        facts.append(f"p50 speedup **{m['speedup']:.2f}x**")
        if m.get("p50_ms") and m.get("reference_p50_ms"):
            facts.append(f"p50 {m['p50_ms']:.3f} ms against {m['reference_p50_ms']:.3f} ms")
    if m.get("bytes"):
        size = format_bytes(m["bytes"])
        facts.append(f"{size} ({m['size_ratio']:.2f}x the source)" if m.get("size_ratio") else size)
    if m.get("nodes"):
        facts.append(f"{m['nodes']} nodes")
    if facts:
        lines += ["", ", ".join(facts) + "."]
    lines += [""]
    if report_link:
        lines.append(f"[Comparison of every variant of this run]({report_link}).")
    if report:
        lines.append(f"Comparison report: `{report}`")
        lines.append(f"(artifact `graphtrim/reports/{COMPARISON}.html` of the run).")
    lines.append(f"Pipeline run `{run_id}`, config `{config.config_hash[:16]}`.")
    text = "\n".join(lines)
    return text if len(text) <= DESCRIPTION_LIMIT else text[: DESCRIPTION_LIMIT - 3] + "..."


def _conversion_tags(conversion: Mapping[str, Any] | None) -> dict[str, str]:
    """A weight-only variant's settings as searchable tags (``graphtrim.weights.form`` =
    ``portable``, ``graphtrim.weights.bits`` = ``4``, ...)."""
    if not conversion:
        return {}
    keys = (
        "bits",
        "block_size",
        "symmetric",
        "algorithm",
        "form",
        "accuracy_level",
        "opset",
        "activations",
    )
    out = {
        f"{T}weights.{k}": str(conversion[k]).lower() for k in keys if conversion.get(k) is not None
    }
    if conversion.get("matmuls_quantized") is not None:
        out[f"{T}weights.matmuls"] = str(conversion["matmuls_quantized"])
    if conversion.get("gathers_quantized") is not None:
        out[f"{T}weights.embeddings"] = str(conversion["gathers_quantized"])
    return out


def _tuning_tags(tuning: Mapping[str, Any] | None) -> dict[str, str]:
    """What the settings search found for a variant (``graphtrim.tune.key`` =
    ``int8-static[activation_type="uint8"]``, its settings as JSON, the trials it took)."""
    if not tuning:
        return {}
    out = {
        f"{T}tune.key": str(tuning.get("key", ""))[:5000],
        f"{T}tune.settings": json.dumps(tuning.get("settings") or {}, sort_keys=True)[:5000],
        f"{T}tune.trials": str(tuning.get("trials", "")),
        f"{T}tune.mode": str(tuning.get("mode", "")),
        f"{T}tune.signature": str(tuning.get("signature", "")),
    }
    return {k: v for k, v in out.items() if v}
