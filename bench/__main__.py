"""``python -m bench`` (or ``make bench``): graphtrim beside onnxsim, onnxslim, onnxoptimizer,
onnxruntime's offline optimizer (basic level) and onnxscript's optimizer.

For every suite model and tool it reports: nodes after (subgraphs included), optimize wall time
and peak RSS (each tool runs in a fresh process, imports excluded from the time; the median of
`--repeat` runs, tools interleaved), parity with
the original in onnxruntime (max relative difference over seeded random inputs), and the latency
ratio to the original model (p50, one thread, runs of all variants interleaved in one process),
with onnxruntime's graph optimizations disabled and enabled.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import onnx

from bench import publish
from bench.suite import build_suite
from bench.tables import render
from bench.worker import TOOLS
from graphtrim.modelio.protos import all_nodes

ROOT = Path(__file__).resolve().parent
log = logging.getLogger("bench")


def count_nodes(path: Path) -> int:
    model = onnx.load(str(path), load_external_data=False)
    return sum(1 for _ in all_nodes(model.graph))


def external_locations(model: onnx.ModelProto) -> list[str]:
    """The external data files ``model``'s initializers reference, each once, in the order
    first referenced."""
    return list(
        dict.fromkeys(
            entry.value
            for init in model.graph.initializer
            for entry in init.external_data
            if entry.key == "location"
        )
    )


def model_bytes(path: Path) -> int:
    """The model file plus the external data files it references."""
    model = onnx.load(str(path), load_external_data=False)
    data = [path.parent / name for name in external_locations(model)]
    return path.stat().st_size + sum(f.stat().st_size for f in data if f.exists())


def run_tool(tool: str, src: Path, dst: Path, timeout: int) -> dict[str, Any]:
    dst.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "bench.worker", tool, str(src), str(dst)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=ROOT.parent,
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timeout after {timeout}s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        err = (proc.stderr.strip().splitlines() or ["failed"])[-1]
        return {"ok": False, "error": err[:200]}
    result = json.loads(lines[-1])
    result["ok"] = bool(result.get("ok")) and dst.exists()
    if result["ok"]:
        result["nodes"] = count_nodes(dst)
        result["bytes"] = model_bytes(dst)
    return result


def parity(src: Path, dst: Path, dim_values: dict[str, int] | None = None) -> dict[str, Any]:
    from graphtrim.verify import Tolerance, verify

    rec = verify(
        src,
        dst,
        trials=2,
        dim_values=dim_values,
        tolerance=Tolerance(rtol=1e-4, atol=1e-5, min_cosine=0.0),
    )
    if rec.error:
        return {"parity_ok": False, "max_rel_diff": None, "parity_error": rec.error[:200]}
    # exact rewrites leave at most rounding noise: relative diff <= 1e-5 of the output's scale
    ok = rec.ok and (rec.max_rel_diff <= 1e-5 or rec.max_abs_diff <= 1e-6)
    return {"parity_ok": ok, "max_rel_diff": rec.max_rel_diff, "max_abs_diff": rec.max_abs_diff}


MIN_SECONDS = 8.0  # per model and setting, for models fast enough to afford it
MAX_RUNS = 2000


def latency(
    paths: dict[str, Path],
    runs: int,
    enable_ort_opt: bool,
    *,
    min_seconds: float = MIN_SECONDS,
    dim_values: dict[str, int] | None = None,
) -> dict[str, float]:
    """p50 latency (ms) per variant; variants run interleaved so drift hits all alike."""
    import onnxruntime as ort

    from graphtrim.verify import make_inputs

    sessions = {}
    for key, path in paths.items():
        so = ort.SessionOptions()
        so.graph_optimization_level = (
            ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            if enable_ort_opt
            else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        )
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        try:
            sessions[key] = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        except Exception:
            continue
    if "original" not in sessions:
        return {}
    specs = [(i.name, i.type, list(i.shape)) for i in sessions["original"].get_inputs()]
    feeds = make_inputs(specs, seed=0, dim_values=dim_values)
    for key in list(sessions):
        # a variant whose interface changed (onnxruntime's offline output can grow inputs)
        # cannot run on the original's feeds: no latency for it
        try:
            sessions[key].run(None, feeds)
        except Exception:
            del sessions[key]
    if "original" not in sessions:
        return {}
    times: dict[str, list[float]] = {k: [] for k in sessions}
    t0 = time.perf_counter()
    for _ in range(3):  # warm-up
        for s in sessions.values():
            s.run(None, feeds)
    per_round = (time.perf_counter() - t0) / 3
    # small models get more rounds (at least ``runs``, up to about MIN_SECONDS of them: their
    # sub-millisecond medians need many samples); big ones (vgg19 runs seconds per round)
    # stay within about a minute per setting
    if per_round > 0:
        runs = max(runs, min(MAX_RUNS, int(min_seconds / per_round)))
        runs = max(5, min(runs, int(60 / per_round)))
    keys = list(sessions)
    for r in range(runs):
        # rotate the order: no variant always runs first (or right after the same one)
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            t0 = time.perf_counter()
            sessions[key].run(None, feeds)
            times[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1000 for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = publish.parser(__doc__, "python -m bench")
    ap.add_argument("--models", nargs="*", help="suite model names (default: all)")
    ap.add_argument("--tools", nargs="*", default=list(TOOLS), choices=list(TOOLS))
    ap.add_argument(
        "--cache", type=Path, default=ROOT / "models", help="where suite models are built"
    )
    ap.add_argument(
        "--out", type=Path, default=ROOT / "results", help="where outputs and results.json go"
    )
    ap.add_argument(
        "--runs",
        type=int,
        default=30,
        help="interleaved latency runs per variant at least (small models get more, up to "
        f"about {MIN_SECONDS:.0f} s per model and setting)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="optimize each model this many times per tool, tools interleaved; the median "
        "time is reported",
    )
    ap.add_argument("--no-latency", action="store_true")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per tool and model")
    publish.add_publish_argument(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="bench: %(message)s")
    logging.getLogger("torch").setLevel(logging.ERROR)

    suite = build_suite(args.cache, args.models)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for name, src in suite.items():
        row: dict[str, Any] = {
            "model": name,
            "original_nodes": count_nodes(src),
            "original_bytes": model_bytes(src),
            "tools": {},
        }
        outputs = {"original": src}
        runs: dict[str, list[dict[str, Any]]] = {tool: [] for tool in args.tools}
        for _ in range(max(1, args.repeat)):
            for tool in args.tools:
                if runs[tool] and not runs[tool][-1].get("ok"):
                    continue  # a failure is not retried
                dst = args.out / f"{name}.{tool}.onnx"
                runs[tool].append(run_tool(tool, src, dst, args.timeout))
        for tool in args.tools:
            dst = args.out / f"{name}.{tool}.onnx"
            res = runs[tool][-1]
            if res.get("ok"):
                res["seconds_runs"] = [r["seconds"] for r in runs[tool]]
                res["seconds"] = statistics.median(res["seconds_runs"])
                res["peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs[tool])
                res.update(parity(src, dst))
                outputs[tool] = dst
            row["tools"][tool] = res
            log.info(
                "%-28s %-14s %s",
                name,
                tool,
                {k: res.get(k) for k in ("nodes", "seconds", "parity_ok", "error") if k in res},
            )
        if not args.no_latency:
            for enabled in (False, True):
                p50 = latency(outputs, args.runs, enabled)
                base = p50.get("original")
                for tool in args.tools:
                    if base and tool in p50:
                        row["tools"][tool][
                            f"latency_ratio_{'ort_on' if enabled else 'ort_off'}"
                        ] = p50[tool] / base
        rows.append(row)
    publish.write(args.out / "results.json", "suite", rows, args, publish=args.publish)
    print(render(rows, args.tools))
    return 0


if __name__ == "__main__":
    sys.exit(main())
