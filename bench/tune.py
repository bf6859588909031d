"""``python -m bench.tune`` (or ``make bench-tune``): the settings search against the fixed
recipes, on six models of different kinds, and the registry memory on a second version of each.

Per model (built offline with torch, random or briefly trained weights, fixed seeds):

1. **fixed**: ``graphtrim variants`` of the searched kinds, each with its fixed recipe (the
   sensitivity fallback included); the best is the fastest that passes every gate.
2. **tuned**: ``graphtrim tune`` with ``--budget`` (default 5 min) and a fresh memory file.
3. **head to head**: the fixed best and the champion judged again by ``graphtrim evaluate``,
   interleaved in one run against the reference: the ratio of their p50 speedups is the
   number quoted (both had to pass the same gates).
4. **memory**: a second version of the architecture (other seed: other weights, same graph
   signature) tuned with the first version's memory; its search time against the first's, and
   its champion's speedup against the first champion's (the same computation).

Results go to ``bench/results-tune/`` (``results.json``, ``results.md``, each search's reports).
Timings are of this machine, measured as ratios in the same run; absolute times are noisy.
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench import publish
from bench.tune_models import (
    POLICY,
    Model,
    _decoder_model,
    _detector,
    _encoder_model,
    _f,
    _image_model,
    _kws_model,
    _mobilenet_v2,
    _resnet,
    _speedup,
)
from bench.tune_olive import olive_compare, render_olive

ROOT = Path(__file__).resolve().parent
log = logging.getLogger("bench.tune")


# -- models ------------------------------------------------------------------------------------


MODELS: dict[str, Model] = {
    m.name: m
    for m in (
        _image_model("resnet", "CNN, residual adds", _resnet, (1, 3, 96, 96)),
        _image_model(
            "mobilenet-v2",
            "mobile CNN, depthwise, inverted residuals",
            _mobilenet_v2,
            (1, 3, 160, 160),
        ),
        _encoder_model(),
        _image_model("detector", "YOLO-style detector", _detector, (1, 3, 160, 160)),
        _kws_model(),
        _decoder_model(),
    )
}


# -- the runs ----------------------------------------------------------------------------------


def run_model(m: Model, cache: Path, out: Path, budget: float) -> dict[str, Any]:
    from graphtrim.data import input_specs, load_npz
    from graphtrim.gates import GatePolicy, evaluate
    from graphtrim.quantize import QuantizeConfig
    from graphtrim.stages.pipeline import build_and_evaluate
    from graphtrim.tune.memory import FileMemory
    from graphtrim.tune.search import TuneSettings, tune, write_result

    folder = out / m.name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    v1, calib_path, eval_path = m.files(cache, 0)
    v2, _, _ = m.files(cache, 1)
    specs = input_specs(v1)
    # batch 1, as served
    calib = load_npz(calib_path, specs, batch_size=1) if m.calibrated else None
    data = load_npz(eval_path, specs, batch_size=1)
    policy = GatePolicy(POLICY)
    say = lambda line: log.info("%s: %s", m.name, line)  # noqa: E731

    log.info("%s: fixed recipes %s", m.name, ",".join(m.kinds))
    t0 = time.perf_counter()
    fixed = build_and_evaluate(
        v1,
        folder / "fixed",
        [k for k in m.kinds if k != "int8-static" or m.calibrated],
        config=QuantizeConfig(tune_device="cpu"),
        calibration=calib_path if m.calibrated else None,
        eval_data=eval_path,
        policy=policy,
        batch_size=1,
    )
    fixed_s = time.perf_counter() - t0
    passed = [v for v in fixed.evaluation.variants if v.passed]
    best = max(passed, key=lambda v: _speedup(v) or 0.0, default=None)

    memory = FileMemory(folder / "memory.json")

    def search(model: Path, name: str) -> tuple[Any, float]:
        t0 = time.perf_counter()
        result = tune(
            model,
            folder / name,
            policy=policy,
            data=data,
            calibration=calib,
            kinds=m.kinds,
            settings=TuneSettings(budget_s=budget),
            memory=memory,
            progress=say,
        )
        seconds = time.perf_counter() - t0
        write_result(result, folder / name)
        return result, seconds

    log.info("%s: tuning version 1 (budget %.0f s)", m.name, budget)
    first, first_s = search(v1, "tuned-v1")

    head: dict[str, Any] = {}
    if best is not None and first.output is not None:
        log.info("%s: head to head, fixed %s against the champion", m.name, best.name)
        champion_kind = first.champion.candidate.kind if first.champion else best.name
        ev = evaluate(
            v1,
            {"fixed": fixed.outputs[best.name], "tuned": Path(first.output)},
            policy=GatePolicy(
                {**POLICY, "defaults": {**POLICY["defaults"], "latency": {"runs": 400}}}
            ),
            data=data,
            kinds={"fixed": best.name, "tuned": champion_kind},
        )
        sf, st = _speedup(ev.variant("fixed")), _speedup(ev.variant("tuned"))
        head = {
            "fixed_speedup": sf,
            "tuned_speedup": st,
            "tuned_over_fixed": st / sf if sf and st else None,
            "fixed_passed": ev.variant("fixed").passed,
            "tuned_passed": ev.variant("tuned").passed,
        }

    log.info("%s: tuning version 2 from the memory", m.name)
    second, second_s = search(v2, "tuned-v2")

    # the two versions' champions in one timing run: the same graph with other weights times
    # as its first version does, so both are timed against version 1's reference, interleaved
    same_run: dict[str, Any] = {}
    if first.output is not None and second.output is not None:
        log.info("%s: the two versions' champions in one timing run", m.name)
        kind = lambda r: r.champion.candidate.kind  # noqa: E731
        ev = evaluate(
            v1,
            {"v1": Path(first.output), "v2": Path(second.output)},
            policy=GatePolicy(
                {**POLICY, "defaults": {**POLICY["defaults"], "latency": {"runs": 400}}}
            ),
            data=data,
            kinds={"v1": kind(first), "v2": kind(second)},
        )
        s1, s2 = _speedup(ev.variant("v1")), _speedup(ev.variant("v2"))
        same_run = {
            "v1_speedup": s1,
            "v2_speedup": s2,
            "v2_over_v1": s2 / s1 if s1 and s2 else None,
        }

    def champion(r: Any) -> dict[str, Any] | None:
        c = r.champion
        return (
            None
            if c is None
            else {"key": c.candidate.key, "speedup": c.speedup, "size": c.size_ratio}
        )

    return {
        "model": m.name,
        "kind": m.kind,
        "kinds": list(m.kinds),
        "fixed": {
            "seconds": fixed_s,
            "best": best.name if best else None,
            "best_speedup": _speedup(best),
            "passed": [v.name for v in passed],
            "speedups": {v.name: _speedup(v) for v in fixed.evaluation.variants},
        },
        "tuned": {
            "seconds": first_s,
            "trials": len(first.trials),
            "stopped": first.stopped,
            "champion": champion(first),
            "against_recipe": first.against_recipe(),
        },
        "head_to_head": head,
        "memory": {
            "seconds": second_s,
            "time_ratio": second_s / first_s if first_s else None,
            "trials": len(second.trials),
            "mode": second.mode,
            "champion": champion(second),
            "same_run": same_run,
        },
    }


def budget_check(m: Model, cache: Path, out: Path, budgets: list[float]) -> list[dict[str, Any]]:
    """Searches with budgets too short to converge: how far past its budget each ended, against
    its longest trial (a build plus its screening) and the finalists' judgement."""
    from graphtrim.data import input_specs, load_npz
    from graphtrim.gates import GatePolicy
    from graphtrim.tune.search import TuneSettings, tune

    v1, calib_path, eval_path = m.files(cache, 0)
    specs = input_specs(v1)
    calib = load_npz(calib_path, specs, batch_size=1) if m.calibrated else None
    data = load_npz(eval_path, specs, batch_size=1)
    rows = []
    for budget in budgets:
        log.info("%s: a search with a budget of %.0f s", m.name, budget)
        t0 = time.perf_counter()
        result = tune(
            v1,
            out / f"budget-{m.name}-{budget:.0f}",
            policy=GatePolicy(POLICY),
            data=data,
            calibration=calib,
            kinds=m.kinds,
            settings=TuneSettings(budget_s=budget),
        )
        wall = time.perf_counter() - t0
        rows.append(
            {
                "model": m.name,
                "budget_s": budget,
                "wall_s": wall,
                "over_s": wall - budget,
                "longest_build_s": max((t.build_s for t in result.trials), default=0.0),
                "trials": len(result.trials),
                "stopped": result.stopped,
                "champion": result.champion.candidate.key if result.champion else None,
            }
        )
    return rows


def render(results: list[dict[str, Any]]) -> str:
    lines = [
        "| model | fixed best | fixed speedup | champion | tuned speedup | tuned / fixed "
        "(same run) | fixed s | tune s | trials | stopped | v2 tune s | v2 / v1 time | "
        "v2 champion speedup | v2 / v1 champion (same run) |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in results:
        h, t, mem = r["head_to_head"], r["tuned"], r["memory"]
        c, c2 = t["champion"] or {}, mem["champion"] or {}
        lines.append(
            f"| {r['model']} | {r['fixed']['best'] or 'none passed'} | {_f(h.get('fixed_speedup'), '.2f')}x "
            f"| `{c.get('key', 'none')}` | {_f(h.get('tuned_speedup'), '.2f')}x "
            f"| **{_f(h.get('tuned_over_fixed'), '.3f')}** | {r['fixed']['seconds']:.0f} "
            f"| {t['seconds']:.0f} | {t['trials']} | {t['stopped']} | {mem['seconds']:.0f} "
            f"| {_f(mem['time_ratio'], '.2f')} | {_f(c2.get('speedup'), '.2f')}x "
            f"| {_f((mem.get('same_run') or {}).get('v2_over_v1'), '.3f')} |"
        )
    return "\n".join(lines) + "\n"


def render_budget(checks: list[dict[str, Any]]) -> str:
    """The table of the budget checks (``--budget-check``); empty without them."""
    if not checks:
        return ""
    lines = [
        "",
        "| model | budget s | wall s | past the budget s | longest build s | trials | stopped |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    lines += [
        f"| {c['model']} | {c['budget_s']:.0f} | {c['wall_s']:.1f} | {c['over_s']:+.1f} "
        f"| {c['longest_build_s']:.1f} | {c['trials']} | {c['stopped']} |"
        for c in checks
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = publish.parser(__doc__, "python -m bench.tune")
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--budget", type=float, default=300.0, help="seconds per search")
    ap.add_argument(
        "--budget-check",
        type=float,
        nargs="*",
        default=[20.0, 45.0],
        help="budgets (s) of the searches that check how far past its budget a search ends "
        "(on MobileNetV2, whose full search takes about 2 min here; none: skipped)",
    )
    ap.add_argument(
        "--olive",
        action="store_true",
        help="only the comparison with Olive 0.13 (installed into bench/.olive), on the "
        "champions of an earlier run in --out",
    )
    ap.add_argument("--olive-samples", type=int, default=16, help="Olive search's samples at most")
    ap.add_argument("--olive-timeout", type=float, default=900.0)
    ap.add_argument("--cache", type=Path, default=ROOT / "models" / "tune")
    ap.add_argument("--out", type=Path, default=ROOT / "results-tune")
    publish.add_publish_argument(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="bench: %(message)s")
    for noisy in ("torch", "torch.onnx", "onnxruntime", "graphtrim"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.olive:
        rows = []
        for name in args.models:
            if not MODELS[name].calibrated:
                # the Olive runner feeds the .npz's arrays as the model's inputs: a KV-cache
                # decoder's token data holds input_ids alone
                continue
            row = olive_compare(
                MODELS[name],
                args.cache,
                args.out,
                max_samples=args.olive_samples,
                timeout=args.olive_timeout,
            )
            if row is not None:
                rows.append(row)
            publish.write(args.out / "olive.json", "olive", rows, args)
            (args.out / "olive.md").write_text(render_olive(rows))
        if args.publish:
            publish.write(args.out / "olive.json", "olive", rows, args, publish=True)
        print(render_olive(rows))
        return 0
    results = []
    for name in args.models:
        results.append(run_model(MODELS[name], args.cache, args.out, args.budget))
        publish.write(args.out / "results.json", "tune", {"models": results}, args)
        (args.out / "results.md").write_text(render(results))
    checks: list[dict[str, Any]] = []
    if args.budget_check:
        checks = budget_check(MODELS["mobilenet-v2"], args.cache, args.out, args.budget_check)
        (args.out / "results.md").write_text(render(results) + render_budget(checks))
    publish.write(
        args.out / "results.json",
        "tune",
        {"models": results, "budget": checks},
        args,
        publish=args.publish,
    )
    print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
