"""``python -m bench.nodetests`` (or ``make bench-nodetests``): graphtrim on every node test of
the installed onnx that onnxruntime runs.

The node tests are generated from ``onnx.backend.test.case.node`` (a model of one op, or of the
function body of an op for the ``_expanded`` tests, with its inputs and expected outputs). A test
onnxruntime cannot run as given (load error, run error, or outputs that do not match the expected
ones) is skipped. Every other model is optimized with ``optimize_file`` (default preset), the
result loaded into onnxruntime and its outputs compared with the expected ones at the test's own
tolerance (rtol 1e-3, atol 1e-7, onnx's backend test runner's comparison). Outcomes:

- ``ok``: the optimized model gives the expected outputs (``passed through`` counts those written
  unchanged because the passes do not handle their opset; they are in ``ok`` too);
- ``changed``: it loads but gives other outputs;
- ``refused``: ``optimize_file`` raised a graphtrim error other than a pass failure (exit 2);
- ``unloadable``: onnxruntime refuses the optimized model;
- ``crashed``: a pass failed (exit 3), another exception escaped, or the process died.

Each model runs in a child process (``graphtrim.isolation``), so a runtime crash costs one
test, not the sweep; ``--jobs`` children work through shards side by side.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import publish

ROOT = Path(__file__).resolve().parent
log = logging.getLogger("bench.nodetests")

OUTCOMES = ("ok", "changed", "refused", "unloadable", "crashed")


def collect(pattern: str | None = None) -> list[dict[str, Any]]:
    """The node tests whose name matches ``pattern`` (``re.search``), as picklable items: name,
    serialized model, inputs, expected outputs and tolerances."""
    import numpy as np
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")  # the generators overflow casts on purpose
        cases = collect_testcases()
    rx = re.compile(pattern) if pattern else None
    items = []
    for case in cases:
        if case.model is None or not case.data_sets:
            continue
        if rx is not None and not rx.search(case.name):
            continue
        inputs, outputs = case.data_sets[0]
        items.append(
            {
                "name": case.name,
                "model": case.model.SerializeToString(),
                "inputs": list(inputs),
                "outputs": list(outputs),
                "rtol": case.rtol,
                "atol": case.atol,
            }
        )
    return sorted(items, key=lambda item: item["name"])


def _arrays(values: Sequence[Any]) -> list[Any]:
    import onnx

    return [onnx.numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else v for v in values]


def _run(model: bytes | str, item: dict[str, Any]) -> None:
    """Run ``model`` on the item's inputs in onnxruntime (as its backend test series does) and
    raise when its outputs are not the expected ones."""
    import onnxruntime.backend as backend
    from onnx.backend.test.runner import Runner

    rep = backend.prepare(model)
    got = rep.run(_arrays(item["inputs"]))
    Runner.assert_similar_outputs(
        _arrays(item["outputs"]), list(got), rtol=item["rtol"], atol=item["atol"]
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line}"[:300]


def check_case(item: dict[str, Any], *, workdir: str) -> dict[str, Any]:
    """One node test: run the original, optimize it, run the result. Called in a child."""
    import numpy as np

    from graphtrim.errors import GraphtrimError, PassFailure
    from graphtrim.isolation import step
    from graphtrim.optimize_file import optimize_file

    name = item["name"]
    record: dict[str, Any] = {"name": name, "outcome": None, "detail": ""}
    folder = Path(workdir) / name
    folder.mkdir(parents=True, exist_ok=True)
    src, dst = folder / "model.onnx", folder / "optimized.onnx"
    src.write_bytes(item["model"])
    warnings.simplefilter("ignore")
    with np.errstate(all="ignore"):
        step(f"{name}: running the original")
        try:
            _run(str(src), item)
        except Exception as exc:
            return {**record, "outcome": "skipped", "detail": _first_line(exc)}
        step(f"{name}: optimizing")
        t0 = time.perf_counter()
        try:
            report = optimize_file(src, dst)
        except PassFailure as exc:
            return {**record, "outcome": "crashed", "detail": _first_line(exc)}
        except GraphtrimError as exc:
            return {**record, "outcome": "refused", "detail": _first_line(exc)}
        except Exception as exc:
            return {**record, "outcome": "crashed", "detail": _first_line(exc)}
        record["seconds"] = round(time.perf_counter() - t0, 4)
        record["nodes"] = [report.before.nodes, report.after.nodes]
        passed = getattr(report.log, "passed_through", None)  # absent before pass-through
        if passed:
            record["passed_through"] = passed
        step(f"{name}: loading the optimized model")
        try:
            import onnxruntime.backend as backend

            backend.prepare(str(dst))
        except Exception as exc:
            return {**record, "outcome": "unloadable", "detail": _first_line(exc)}
        step(f"{name}: running the optimized model")
        try:
            _run(str(dst), item)
        except Exception as exc:
            return {**record, "outcome": "changed", "detail": _first_line(exc)}
    return {**record, "outcome": "ok"}


def sweep(
    items: Sequence[dict[str, Any]], *, jobs: int = 1, timeout: float = 300.0
) -> list[dict[str, Any]]:
    """Check every item, ``jobs`` child processes side by side; one record per item."""
    from graphtrim.isolation import map_isolated

    jobs = max(1, min(jobs, len(items) or 1))
    shards = [list(items[i::jobs]) for i in range(jobs)]
    results: list[list[Any]] = [[] for _ in shards]
    done = Counter[str]()
    lock = threading.Lock()

    def on_result(_index: int, value: Any) -> None:
        with lock:
            done["n"] += 1
            if done["n"] % 200 == 0:
                log.info("%d of %d checked", done["n"], len(items))

    with tempfile.TemporaryDirectory(prefix="graphtrim-nodetests-") as workdir:

        def work(k: int) -> None:
            results[k] = map_isolated(
                "bench.nodetests:check_case",
                shards[k],
                common={"workdir": workdir},
                timeout=timeout,
                what=lambda item: item["name"],
                on_result=on_result,
            )

        threads = [threading.Thread(target=work, args=(k,)) for k in range(jobs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    records: list[dict[str, Any]] = []
    for shard, shard_results in zip(shards, results, strict=True):
        for item, value in zip(shard, shard_results, strict=True):
            if isinstance(value, BaseException):  # the child died or ran out of time
                value = {"name": item["name"], "outcome": "crashed", "detail": str(value)}
            records.append(value)
    return sorted(records, key=lambda r: r["name"])


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    counts = Counter(r["outcome"] for r in records)
    ran = [r for r in records if r["outcome"] != "skipped"]
    return {
        "generated": len(records),
        "skipped_ort_cannot_run": counts["skipped"],
        "checked": len(ran),
        **{k: counts[k] for k in OUTCOMES},
        "passed_through": sum(1 for r in ran if r.get("passed_through")),
        "not_ok": [
            {"name": r["name"], "outcome": r["outcome"], "detail": r["detail"]}
            for r in ran
            if r["outcome"] != "ok"
        ],
    }


def table(summary: dict[str, Any], seconds: float) -> str:
    lines = [
        f"node tests generated        {summary['generated']:>6}",
        f"skipped (ort cannot run)    {summary['skipped_ort_cannot_run']:>6}",
        f"checked                     {summary['checked']:>6}",
    ]
    for key in OUTCOMES:
        lines.append(f"  {key:<25} {summary[key]:>6}")
        if key == "ok" and summary["passed_through"]:
            lines.append(f"    {'of which passed through':<23} {summary['passed_through']:>6}")
    lines.append(f"total time                  {seconds:>6.1f} s")
    for r in summary["not_ok"]:
        lines.append(f"{r['outcome']:<11} {r['name']}: {r['detail']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.nodetests", description=__doc__)
    parser.add_argument("--filter", metavar="REGEX", help="only the tests whose name matches")
    parser.add_argument("--json", metavar="OUT", help="write the summary and every record here")
    parser.add_argument(
        "--jobs", type=int, default=1, help="child processes working side by side (default 1)"
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds per test before it counts as crashed"
    )
    publish.add_publish_argument(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    items = collect(args.filter)
    if not items:
        print(f"no node test matches {args.filter!r}", file=sys.stderr)
        return 2
    log.info("checking %d node tests with %d process(es)", len(items), args.jobs)
    records = sweep(items, jobs=args.jobs, timeout=args.timeout)
    seconds = time.perf_counter() - start
    summary = summarize(records)
    print(table(summary, seconds))
    if args.json or args.publish:
        payload = {
            "onnx": _version("onnx"),
            "onnxruntime": _version("onnxruntime"),
            "seconds": round(seconds, 1),
            "jobs": args.jobs,
            **summary,
            "records": records,
        }
        out = Path(args.json) if args.json else ROOT / "results-nodetests" / "results.json"
        summary_only = {k: v for k, v in payload.items() if k != "records"}
        publish.write(out, "nodetests", payload, args, publish=args.publish, public=summary_only)
    bad = sum(summary[k] for k in OUTCOMES if k != "ok")
    return 0 if bad == 0 else 1


def _version(package: str) -> str:
    from importlib import metadata

    return metadata.version(package)


if __name__ == "__main__":
    sys.exit(main())
