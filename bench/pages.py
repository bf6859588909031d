"""The results sections of the documentation's benchmark pages, rendered from the published JSON.

Each benchmark writes ``docs/benchmarks/data/NAME.json`` with ``--publish`` (``bench.publish``):
its results with the machine, date and commit they were measured at. A page of the site holds
the marker ``<!-- bench-results: NAME -->``; at build time the documentation's hook replaces it
with :func:`section`, which renders that file with the benchmark's own table code, or says that
the results are pending and which command publishes them. Nothing here is typed by hand.

``python -m bench.pages NAME`` prints one section, as the site would show it.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.publish import DATA, read


@dataclasses.dataclass(frozen=True)
class Bench:
    """A benchmark whose results a page shows.

    Attributes:
        command: the make target (or module) that runs it.
        render: ``module:function`` turning the envelope's ``results`` (and ``args``) into
            Markdown.
        cost: how long it takes and what it needs, said where its results are pending.
    """

    command: str
    render: str
    cost: str


BENCHES: dict[str, Bench] = {
    "suite": Bench(
        "make bench", "bench.pages:_suite", "about 25 minutes on a 2-core machine with latency"
    ),
    "variants": Bench("make bench-variants", "bench.variants:render", "a few minutes"),
    "nodetests": Bench("make bench-nodetests", "bench.pages:_nodetests", "one to two minutes"),
    "tune": Bench("make bench-tune", "bench.pages:_tune", "about 15 minutes"),
    "olive": Bench(
        'make bench-tune BENCH_ARGS="--olive"',
        "bench.tune_olive:render_olive",
        "about 30 minutes after `make bench-tune`, Olive 0.13 installed into bench/.olive",
    ),
    "tune-pool": Bench(
        "make bench-tune-pool",
        "bench.tune_pool:render",
        "about 8 minutes; a Celery deployment on 127.0.0.1 (PostgreSQL, Redis)",
    ),
    "llm": Bench(
        "make bench-llm",
        "bench.llm:render",
        "about 30 minutes; onnxruntime-genai installed into bench/.genai on first use",
    ),
    "llm-graph": Bench("make bench-llm-graph", "bench.llm_graph:render", "about 20 minutes"),
    "llm-pipeline": Bench(
        "make bench-llm-pipeline",
        "bench.llm_pipeline:render",
        "about 20 minutes, 24 GiB of memory and 30 GB of disk",
    ),
    "scale": Bench(
        "make bench-scale",
        "bench.scale:render",
        "about 15 minutes; a Celery deployment on 127.0.0.1 (PostgreSQL, Redis)",
    ),
    "scale-load": Bench(
        'make bench-scale BENCH_ARGS="--models 10 --versions 100 --arrival-minutes 4"',
        "bench.scale_load:render_load",
        "about 40 minutes; a Celery deployment on 127.0.0.1 (PostgreSQL, Redis)",
    ),
    "sweep": Bench(
        "make corpus && make sweep",
        "bench.sweep:render",
        "hours: the corpus export (about 5 GB, a venv of its own) and the sweep of 313 files",
    ),
    "sweep-exporters": Bench(
        'make corpus BENCH_ARGS="--families tf2onnx paddle2onnx sklearn-pipelines" && '
        'make sweep BENCH_ARGS="--families tf2onnx paddle2onnx sklearn-pipelines '
        '--out bench/results-exporters --name sweep-exporters"',
        "bench.sweep:render",
        "about an hour, with a venv of its own per exporter (bench/corpus/requirements-export-*.txt)",
    ),
}


def _suite(results: Any, args: dict[str, Any]) -> str:
    from bench.tables import render

    return str(render(results, list(args.get("tools") or results[0]["tools"])))


def _tune(results: Any, args: dict[str, Any]) -> str:
    from bench.tune import render, render_budget

    return str(render(results["models"]) + render_budget(results.get("budget") or []))


def _nodetests(results: Any, args: dict[str, Any]) -> str:
    rows = [
        ("node tests generated", results["generated"]),
        ("skipped (onnxruntime cannot run the original)", results["skipped_ort_cannot_run"]),
        ("checked", results["checked"]),
        ("ok", results["ok"]),
        ("of which passed through unchanged", results["passed_through"]),
        ("changed results", results["changed"]),
        ("refused", results["refused"]),
        ("unloadable", results["unloadable"]),
        ("crashed", results["crashed"]),
    ]
    lines = ["| outcome | tests |", "|---|---:|"]
    lines += [f"| {name} | {n:,} |" for name, n in rows]
    lines += [
        "",
        f"onnx {results['onnx']}, onnxruntime {results['onnxruntime']}; "
        f"{results['seconds']:.0f} s with {results['jobs']} process(es).",
    ]
    for r in results["not_ok"]:
        lines.append(f"- {r['outcome']}: `{r['name']}`: {r['detail']}")
    return "\n".join(lines)


def _function(path: str) -> Callable[..., str]:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def _call(path: str, results: Any, args: dict[str, Any]) -> str:
    fn = _function(path)
    if path.startswith("bench.pages:"):
        return fn(results, args)
    return str(fn(results))


def provenance_block(doc: dict[str, Any]) -> str:
    """Machine, date and commit of a published result, as an admonition."""
    prov = doc["provenance"]
    m = prov["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in m.get("versions", {}).items())
    cpus = f"{m['cpu_count']} CPUs" + (
        f" ({m['cpu_usable']} usable)" if m.get("cpu_usable") != m["cpu_count"] else ""
    )
    memory = f", {m['memory_gib']} GiB memory" if m.get("memory_gib") else ""
    load = prov.get("load")
    busy = (
        f"; load average {load[0]:g} at the start (1 minute, on {m['cpu_count']} CPUs)"
        if load
        else ""
    )
    commit = prov.get("commit") or "unknown"
    dirty = " with uncommitted changes" if prov.get("dirty") else ""
    kept = (doc.get("args") or {}).get("measured_with")
    rendered = (
        [
            "    - **Rendered from kept results** (`--render`): the date and commit are the "
            "rendering's; the results were measured with graphtrim source digest(s) "
            + ", ".join(f"`{d}`" for d in kept)
            + " (`bench.sweep.source_digest`)"
        ]
        if kept
        else []
    )
    return "\n".join(
        [
            '!!! info "Measured"',
            f"    - **Machine:** {m['cpu_model']}, {cpus}{memory}; {m['system']}, "
            f"Python {m['python']}; {versions}",
            f"    - **Date:** {prov['date'].replace('T', ' ').replace('+00:00', ' UTC')}{busy}",
            f"    - **Commit:** `{commit[:12]}`{dirty}",
            f"    - **Command:** `{prov['command']}`",
            *rendered,
        ]
    )


def pending(name: str) -> str:
    """What a page says where a benchmark has published nothing."""
    bench = BENCHES[name]
    return "\n".join(
        [
            '!!! warning "Results pending"',
            f"    No results of this benchmark are published yet ({bench.cost}). "
            f"`{bench.command}` with `BENCH_ARGS=--publish` (or `--publish` on the module) "
            f"writes `docs/benchmarks/data/{name}.json`, from which this section is built.",
        ]
    )


def section(name: str, data: Path = DATA) -> str:
    """The results section of benchmark ``name``: provenance and tables, or pending."""
    if name not in BENCHES:
        raise KeyError(f"no benchmark named {name!r} (known: {', '.join(BENCHES)})")
    path = data / f"{name}.json"
    if not path.exists():
        return pending(name)
    doc = read(path)
    body = _call(BENCHES[name].render, doc["results"], doc.get("args") or {})
    # the tables' own headings sit one level below the page's section
    body = re.sub(r"(?m)^(#{1,5}) ", r"#\1 ", body)
    return provenance_block(doc) + "\n\n" + body.strip() + "\n"


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(BENCHES)
    for name in names:
        print(f"## {name}\n\n{section(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
