"""The settings search against Olive's auto-opt on the same models: both sides' variants measured
in one run."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from bench.tune_models import (
    POLICY,
    Model,
    _f,
    _speedup,
)

log = logging.getLogger("bench.tune")


def olive_compare(
    m: Model, cache: Path, out: Path, *, max_samples: int, timeout: float
) -> dict[str, Any] | None:
    """Olive 0.13 on the same file: ``olive auto-opt`` and a JSON workflow whose search covers
    its quantization space (``bench.olive``), each a fresh process; then their outputs and the
    champion of this bench's search (``out/<model>/tuned-v1``) judged in one run against the
    reference, under the same gates."""
    from bench import olive
    from graphtrim.data import input_specs, load_npz
    from graphtrim.gates import GatePolicy, evaluate

    folder = out / m.name
    tuned = json.loads((folder / "tuned-v1" / "tune.json").read_text())
    if not tuned.get("output"):
        log.info("%s: no champion to compare with Olive", m.name)
        return None
    v1, calib_path, eval_path = m.files(cache, 0)
    shutil.rmtree(folder / "olive", ignore_errors=True)
    log.info("%s: olive auto-opt", m.name)
    auto = olive.run_auto_opt(v1, folder / "olive" / "auto-opt", timeout=timeout)
    log.info("%s: olive workflow search (%d samples at most)", m.name, max_samples)
    search = olive.run_workflow(
        v1,
        folder / "olive" / "workflow",
        calibration=calib_path if m.calibrated else None,
        data=calib_path,
        max_samples=max_samples,
        timeout=timeout,
    )
    outputs = {"graphtrim": Path(tuned["output"])}
    for name, run in (("olive-auto-opt", auto), ("olive-search", search)):
        if run.get("ok") and run.get("output"):
            outputs[name] = Path(run["output"])
    specs = input_specs(v1)
    data = load_npz(eval_path, specs, batch_size=1)
    kinds = {"graphtrim": tuned["champion"]["kind"]}
    # graphtrim's search again, its budget Olive's search's wall time
    timed: dict[str, Any] = {}
    if search.get("seconds"):
        from graphtrim.tune.search import TuneSettings, tune

        calib = load_npz(calib_path, specs, batch_size=1) if m.calibrated else None
        log.info("%s: graphtrim tune within Olive's %.0f s", m.name, search["seconds"])
        t0 = time.perf_counter()
        short = tune(
            v1,
            folder / "tuned-olive-time",
            policy=GatePolicy(POLICY),
            data=data,
            calibration=calib,
            kinds=m.kinds,
            settings=TuneSettings(budget_s=float(search["seconds"])),
        )
        timed = {
            "seconds": time.perf_counter() - t0,
            "stopped": short.stopped,
            "champion": short.champion.candidate.key if short.champion else None,
        }
        if short.output and short.champion:
            outputs["graphtrim-olive-time"] = Path(short.output)
            kinds["graphtrim-olive-time"] = short.champion.candidate.kind
    # the same gates for all: Olive's outputs are held to int8-static's, which int8-dynamic's
    # equal (size 0.35x, the accuracy defaults)
    kinds.update({n: "int8-static" for n in outputs if n not in kinds})
    ev = evaluate(
        v1,
        outputs,
        policy=GatePolicy({**POLICY, "defaults": {**POLICY["defaults"], "latency": {"runs": 400}}}),
        data=data,
        kinds=kinds,
    )
    judged = {
        v.name: {
            "passed": v.passed,
            "speedup": _speedup(v),
            "size_ratio": (v.gate("size").measured.get("ratio") if v.gate("size") else None),
            "failed": [f"{g.gate}: {'; '.join(g.reasons)}" for g in v.gates if not g.passed],
        }
        for v in ev.variants
    }
    return {
        "model": m.name,
        "graphtrim_tune_s": tuned["seconds"],
        "graphtrim_champion": tuned["champion"]["key"],
        "olive_auto_opt_s": auto.get("seconds"),
        "olive_auto_opt_error": auto.get("error"),
        "olive_search_s": search.get("seconds"),
        "olive_search_error": search.get("error"),
        "olive_search_samples": search.get("samples"),
        "olive_search_passes": search.get("passes"),
        "graphtrim_in_olive_time": timed,
        "judged": judged,
    }


def render_olive(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | graphtrim search s | its champion | graphtrim within Olive's time: s | its "
        "champion | Olive auto-opt s | its output | Olive search s | its output | graphtrim "
        "(Olive's time) / best Olive that passed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(j: dict[str, Any] | None) -> str:
        if not j:
            return "failed"
        mark = "" if j["passed"] else " (fails gates)"
        return f"{_f(j['speedup'], '.2f')}x{mark}"

    for r in rows:
        j = r["judged"]
        best = max(
            (v["speedup"] or 0 for k, v in j.items() if k.startswith("olive") and v["passed"]),
            default=None,
        )
        short = j.get("graphtrim-olive-time") or {}
        ours = short.get("speedup") if short.get("passed") else None
        ratio = ours / best if ours and best else None
        lines.append(
            f"| {r['model']} | {r['graphtrim_tune_s']:.0f} | {cell(j.get('graphtrim'))} "
            f"| {_f((r.get('graphtrim_in_olive_time') or {}).get('seconds'), '.0f')} "
            f"| {cell(j.get('graphtrim-olive-time'))} "
            f"| {_f(r['olive_auto_opt_s'], '.0f')} | {cell(j.get('olive-auto-opt'))} "
            f"| {_f(r['olive_search_s'], '.0f')} | {cell(j.get('olive-search'))} "
            f"| {_f(ratio, '.2f') if best else 'no Olive output passed'} |"
        )
    return "\n".join(lines) + "\n"
