"""Settings search over a worker pool: the same search with one worker and with two.

On a real deployment (tests/deployment.py: PostgreSQL, Redis, CeleryExecutor), the GPU DAG
(its GPU path routed to the CPU, as in the tests) runs a ``tune`` search of the digits CNN's
int8 variants, first with one gpu worker and the ``graphtrim_gpu`` pool at one slot, then with
a second worker and two slots, then once more with one (a drift check). Each run uses a
registered model of its own, so none starts from another's memory. Reported per run: the
search's wall time (the ``tune`` group's plan start to its last select's end), its trials,
trials per second of it, the sum of the trial tasks' wall times, the most trial tasks running
at once, and the whole run's wall time. The budget is large enough for each search to converge
on its own, so the searches need not build the same trials: the rate compares them.

    python -m bench.tune_pool [--budget 10m] [--out bench/results-tune-pool]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import requests

from bench import publish
from bench.deployed import deployment_work


def _ts(value: str | None) -> float | None:
    return dt.datetime.fromisoformat(value).timestamp() if value else None


def _most_at_once(spans: list[tuple[float, float]]) -> int:
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    most = running = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


def _run(d: dict[str, Any], name: str, task: Any, budget: str) -> dict[str, Any]:
    from tests.servers import register_onnx

    api, dag = d["api"], "graphtrim_optimize_model_gpu"
    version = register_onnx(d["mlflow"], task.model, name)
    variants = ["int8-dynamic", "int8-static"]
    conf = {
        "model_name": name,
        "version": version,
        "variants": variants,
        "calibration": str(task.calibration),
        "eval_data": str(task.eval),
        "policy": {
            "variants": {
                v: {"latency": {"min_speedup": 0.05, "runs": 60, "warmup": 10}} for v in variants
            }
        },
        "tune": budget,
    }
    r = requests.post(
        f"{api}/api/v2/dags/{dag}/dagRuns", json={"logical_date": None, "conf": conf}, timeout=30
    )
    r.raise_for_status()
    run_id = r.json()["dag_run_id"]
    while True:
        d["procs"].check()
        run = requests.get(f"{api}/api/v2/dags/{dag}/dagRuns/{run_id}", timeout=30).json()
        if run["state"] in ("success", "failed"):
            break
        time.sleep(5)
    tis = requests.get(
        f"{api}/api/v2/dags/{dag}/dagRuns/{run_id}/taskInstances",
        params={"limit": 1000},
        timeout=30,
    ).json()["task_instances"]
    spans = {
        (t["task_id"], t["map_index"]): (_ts(t["start_date"]), _ts(t["end_date"]))
        for t in tis
        if t["state"] == "success"
    }
    trials = [v for (task_id, _), v in spans.items() if task_id.startswith("tune.trial_")]
    selects = [v[1] for (task_id, _), v in spans.items() if task_id.startswith("tune.select_")]
    plan = spans[("tune.plan", -1)]
    search_s = max(s for s in selects if s) - plan[0]  # type: ignore[operator]
    return {
        "state": run["state"],
        "search_s": round(search_s, 1),
        "trials": len(trials),
        "trials_per_s": round(len(trials) / search_s, 3),
        "trial_task_s": round(sum(b - a for a, b in trials), 1),
        "most_at_once": _most_at_once(trials),  # type: ignore[arg-type]
        "run_s": round(_ts(run["end_date"]) - _ts(run["start_date"]), 1),  # type: ignore[operator]
    }


def _pool(d: dict[str, Any], slots: int) -> None:
    requests.patch(
        f"{d['api']}/api/v2/pools/graphtrim_gpu",
        params={"update_mask": "slots"},
        json={"pool": "graphtrim_gpu", "slots": slots, "include_deferred": False},
        timeout=30,
    ).raise_for_status()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tune_pool", description=__doc__)
    p.add_argument("--budget", default="10m", help="each search's budget (default 10m)")
    p.add_argument("--out", default="bench/results-tune-pool", help="folder for the JSON results")
    publish.add_publish_argument(p)
    args = p.parse_args(argv)
    work = deployment_work("graphtrim-bench-tune-pool-")
    import boto3

    from graphtrim.examples.digits import make_digits_task
    from tests.deployment import deployment
    from tests.servers import moto_server

    task = make_digits_task(work / "digits")
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    rows = []
    with moto_server(work / "s3") as s3:
        boto3.client("s3", endpoint_url=s3, region_name="us-east-1").create_bucket(Bucket="bench")
        with deployment(work / "deployment", s3=s3, bucket="bench") as d:
            dag = f"{d['api']}/api/v2/dags/graphtrim_optimize_model_gpu"
            while requests.get(dag, timeout=30).status_code != 200:
                time.sleep(2)
            requests.patch(dag, json={"is_paused": False}, timeout=30)
            for i, workers in enumerate((1, 2, 1)):
                if workers == 2:
                    d["start_worker"]("gpu-worker-2")
                if workers == 1 and i:
                    d["procs"].kill("gpu-worker-2", signal.SIGTERM)
                    time.sleep(10)  # its warm shutdown
                _pool(d, workers)
                row = {"workers": workers, **_run(d, f"pool-{i}", task, args.budget)}
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
    publish.write(Path(args.out) / "results.json", "tune-pool", rows, args, publish=args.publish)
    print(render(rows))
    return 0


def render(rows: list[dict[str, Any]]) -> str:
    """The Markdown table of the runs, one row per pool size."""
    lines = [
        "| workers (pool slots) | search s | trials | trials / s | trial task s (sum) "
        "| most at once | run s |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['workers']} | {r['search_s']} | {r['trials']} | {r['trials_per_s']} "
        f"| {r['trial_task_s']} | {r['most_at_once']} | {r['run_s']} |"
        for r in rows
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
