"""Scale benchmark: N registered versions through ``graphtrim_registry_scan`` on a real deployment
(tests/deployment.py: PostgreSQL, Redis, Celery workers; or LocalExecutor as the baseline).

    python -m bench.scale [--versions 20] [--executor celery|local|both] [--out bench/results-scale]

Reports versions per hour (first scan start to last optimize run end), per task the time from
its last upstream task's end (the run's start for the first task) to its start, split into the
scheduler's part (ready -> queued, itself split into ready -> scheduled, the scheduler noticing
the upstream's end, and scheduled -> queued, the wait for a free executor slot under
``[core] parallelism``) and the queue's part (queued -> started: the broker and the wait for a
free worker slot), the task wall time, and whether any version was optimized twice (median,
mean, p90, p95 each). The harness's workers take one task at a time (a 2-core machine), so the
waits for a slot grow with the number of runs in flight; ready -> scheduled is the per-task
overhead the scheduler adds whatever the load. Numbers are for this machine only; the
deployment's logs stay in the printed work folder.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import requests

from bench import publish
from bench.deployed import deployment_work


def _ts(value: str | None) -> float | None:
    if not value:
        return None
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _get(api: str, path: str, **params: Any) -> Any:
    r = requests.get(f"{api}{path}", params=params, timeout=30)
    r.raise_for_status()
    return r.json()


def _stats(xs: list[float]) -> dict[str, float | None]:
    """Median, mean and the 90th, 95th and 99th percentiles (nearest rank below), rounded."""
    if not xs:
        return {"median": None, "mean": None, "p90": None, "p95": None, "p99": None}
    ordered = sorted(xs)
    return {
        "median": round(statistics.median(xs), 2),
        "mean": round(statistics.fmean(xs), 2),
        **{f"p{q}": round(ordered[int(q / 100 * (len(xs) - 1))], 2) for q in (90, 95, 99)},
    }


# the stage each task of graphtrim_optimize_model runs (``graphtrim.seconds.<label>`` tags)
_STAGE_OF_TASK = {
    "export": "export",
    "optimize": "optimize",
    "quantize": "quantize",
    "gate": "validate",
    "register": "register",
    "promote": "promote",
}


def _stage_seconds(mlflow_url: str, dag_run_id: str) -> dict[tuple[str, int], float]:
    """(task id, map index) -> seconds the stage itself worked, from the pipeline's MLflow run
    (mapped tasks pair with their stage labels in variant order, as the DAG maps them)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_url)
    exp = client.get_experiment_by_name("graphtrim")
    if exp is None:
        return {}
    key = f"airflow:graphtrim_optimize_model:{dag_run_id}"
    found = client.search_runs(
        [exp.experiment_id], f"tags.`graphtrim.orchestrator_run_id` = '{key}'", max_results=1
    )
    if not found:
        return {}
    tags = found[0].data.tags
    variants = [v for v in found[0].data.params.get("variants", "").split(",") if v]
    out: dict[tuple[str, int], float] = {}
    for task, stage in _STAGE_OF_TASK.items():
        plain = tags.get(f"graphtrim.seconds.{stage}")
        if plain is not None:
            out[(task, -1)] = float(plain)
        for i, v in enumerate(variants):
            # a stage over all the config's variants is labelled by its name alone
            mapped = tags.get(f"graphtrim.seconds.{stage}.{v}")
            if mapped is None and len(variants) == 1:
                mapped = plain
            if mapped is not None:
                out[(task, i)] = float(mapped)
    return out


def run_once(executor: str, versions: int, model: Path, root: Path) -> dict[str, Any]:
    import boto3

    from tests.deployment import deployment
    from tests.servers import moto_server, register_onnx

    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    with moto_server(root / "s3") as s3:
        boto3.client("s3", endpoint_url=s3, region_name="us-east-1").create_bucket(Bucket="bench")
        kind = "CeleryExecutor" if executor == "celery" else "LocalExecutor"
        with deployment(root, s3=s3, bucket="bench", executor=kind) as d:
            api = d["api"]
            tags = {"graphtrim.optimize": "true", "graphtrim.variants": "graph"}
            for i in range(versions):
                register_onnx(d["mlflow"], model, f"bench-{i:03d}", **tags)
            for dag in ("graphtrim_registry_scan", "graphtrim_optimize_model"):
                while requests.get(f"{api}/api/v2/dags/{dag}", timeout=10).status_code != 200:
                    time.sleep(2)
                requests.patch(f"{api}/api/v2/dags/{dag}", json={"is_paused": False}, timeout=10)
            t0 = time.time()
            for _ in range(2):  # two scans at once: duplicates would show here
                requests.post(
                    f"{api}/api/v2/dags/graphtrim_registry_scan/dagRuns",
                    json={"logical_date": None, "conf": {"max_runs": versions}},
                    timeout=10,
                ).raise_for_status()
            deadline = time.time() + 3600
            runs: list[dict[str, Any]] = []
            while time.time() < deadline:
                d["procs"].check()
                runs = _get(api, "/api/v2/dags/graphtrim_optimize_model/dagRuns", limit=1000)[
                    "dag_runs"
                ]
                done = [r for r in runs if r["state"] in ("success", "failed")]
                if len(runs) >= versions and len(done) == len(runs):
                    break
                print(f"[{executor}] {len(done)}/{versions} runs done", file=sys.stderr, flush=True)
                time.sleep(10)
            end = max((_ts(r["end_date"]) or 0) for r in runs) if runs else time.time()
            models = {(r.get("conf") or {}).get("model_name") for r in runs}
            return {
                "executor": kind,
                "versions": versions,
                "runs": len(runs),
                "succeeded": sum(1 for r in runs if r["state"] == "success"),
                "duplicates": len(runs) - len(models),
                "seconds": round(end - t0, 1),
                "versions_per_hour": round(versions / max(end - t0, 1e-9) * 3600, 1),
                **task_figures(api, d["mlflow"], runs),
            }


def task_figures(api: str, mlflow_url: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the time of the optimize runs' tasks went (seconds, :func:`_stats` each)."""
    # the REST API lists each task's downstream tasks only: invert that for upstream
    upstream: dict[str, list[str]] = {}
    for u in _get(api, "/api/v2/dags/graphtrim_optimize_model/tasks")["tasks"]:
        upstream.setdefault(u["task_id"], [])
        for down in u.get("downstream_task_ids") or []:
            upstream.setdefault(down, []).append(u["task_id"])
    gaps, decide, slot, sched, waits, walls = [], [], [], [], [], []
    added, stage_cost = [], []  # per stage task: wall minus its own work; + the gap
    for r in runs:
        tis = _get(
            api,
            f"/api/v2/dags/graphtrim_optimize_model/dagRuns/{r['dag_run_id']}/taskInstances",
        )["task_instances"]
        compute = _stage_seconds(mlflow_url, r["dag_run_id"])
        ends: dict[str, float] = {}
        for t in tis:
            e = _ts(t.get("end_date"))
            if e is not None:
                ends[t["task_id"]] = max(ends.get(t["task_id"], 0.0), e)
        for t in tis:
            start, stop = _ts(t.get("start_date")), _ts(t.get("end_date"))
            if start is None or stop is None:
                continue
            walls.append(stop - start)
            before = [ends[u] for u in upstream.get(t["task_id"], []) if u in ends]
            ready = max(before) if before else _ts(r.get("start_date"))
            scheduled, queued = _ts(t.get("scheduled_when")), _ts(t.get("queued_when"))
            if ready is not None:
                gaps.append(start - ready)
                if queued is not None:
                    sched.append(max(0.0, queued - ready))  # the scheduler's part
                if scheduled is not None:
                    decide.append(max(0.0, scheduled - ready))  # its decision
            if scheduled is not None and queued is not None:
                slot.append(max(0.0, queued - scheduled))  # a free executor slot
            if queued is not None:
                waits.append(start - queued)  # broker + waiting for a free slot
            work = compute.get((t["task_id"], t.get("map_index", -1)))
            if work is not None:
                added.append(max(0.0, stop - start - work))
                if ready is not None:
                    stage_cost.append(added[-1] + start - ready)
    return {
        "ready_to_start_s": _stats(gaps),
        "ready_to_queued_s": _stats(sched),
        "ready_to_scheduled_s": _stats(decide),
        "scheduled_to_queued_s": _stats(slot),
        "queued_to_start_s": _stats(waits),
        "task_wall_s": _stats(walls),
        # what the orchestrator adds to a stage inside its task (process start, DAG
        # parse, imports not preloaded, XCom) and before it (ready -> start)
        "stage_task_added_s": _stats(added),
        "stage_overhead_s": _stats(stage_cost),
        "stage_tasks": len(added),
        "tasks": len(walls),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__)
    p.add_argument("--versions", type=int, default=20, help="registered versions (tiny models)")
    p.add_argument("--executor", choices=("celery", "local", "both"), default="both")
    p.add_argument("--out", default="bench/results-scale", help="folder for the JSON results")
    load = p.add_argument_group("load mode (bench.scale_load; Celery)")
    load.add_argument(
        "--models", type=int, help="load mode: the versions arrive as new versions of N models"
    )
    load.add_argument("--arrival-minutes", type=float, default=4.0, help="spread of the arrivals")
    load.add_argument(
        "--via", default="events,webhook", help="delivery paths: events, webhook or both"
    )
    load.add_argument("--watch-interval", type=float, default=5.0, help="registry poll, seconds")
    load.add_argument("--sample-every", type=float, default=3.0, help="memory / PG samples, s")
    load.add_argument("--timeout-minutes", type=float, default=60.0, help="give up after")
    publish.add_publish_argument(p)
    args = p.parse_args(argv)
    if args.models is not None and not set(args.via.split(",")) <= {"events", "webhook"}:
        p.error("--via takes events, webhook or events,webhook")
    work = deployment_work("graphtrim-scale-")
    from graphtrim.examples.digits import make_digits_task

    task = make_digits_task(work / "digits", epochs=2)
    if args.models is not None:
        from bench.scale_load import render_load, run_load

        res = run_load(args, task.model, work / "load")
        print(json.dumps(res, indent=2))
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        publish.write(
            Path(args.out) / f"scale-load-{stamp}.json",
            "scale-load",
            res,
            args,
            publish=args.publish,
        )
        print(render_load(res))
        return 0
    results = []
    for executor in ("celery", "local") if args.executor == "both" else (args.executor,):
        res = run_once(executor, args.versions, task.model, work / executor)
        print(json.dumps(res, indent=2))
        results.append(res)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    publish.write(
        Path(args.out) / f"scale-{stamp}.json", "scale", results, args, publish=args.publish
    )
    print(render(results))
    return 0


def _pair(stats: dict[str, Any]) -> str:
    median, p90 = stats.get("median"), stats.get("p90")
    return "-" if median is None else f"{median:.2f} / {p90:.2f}"


def render(results: list[dict[str, Any]]) -> str:
    """The Markdown table of a run, one row per executor (seconds: median / p90)."""
    lines = [
        "| executor | versions | duplicates | versions/h | ready -> scheduled "
        "| scheduled -> queued | queued -> started | task wall | added in a stage's task |",
        "|---|---:|---:|---:|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['executor']} | {r['versions']} | {r['duplicates']} | {r['versions_per_hour']} "
        f"| {_pair(r['ready_to_scheduled_s'])} | {_pair(r['scheduled_to_queued_s'])} "
        f"| {_pair(r['queued_to_start_s'])} | {_pair(r['task_wall_s'])} "
        f"| {_pair(r['stage_task_added_s'])} |"
        for r in results
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
