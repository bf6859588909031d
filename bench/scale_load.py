"""The load mode of ``bench.scale``: new versions arriving over minutes, delivered by the registry
events (``graphtrim_registry_events``, its AssetWatcher polling the registry) and by the MLflow
webhook (a signed ``model_version.created`` per version, POSTed to the API server's plugin)
together, on the Celery deployment of ``tests/deployment.py`` (a triggerer added for the
watcher). Both paths see every version; the run id they share must keep each to one run.

    python -m bench.scale --models 10 --versions 100 --arrival-minutes 4 --via events,webhook

Reported: runs ended of the versions that arrived, versions optimized twice (two or more
optimize runs) and variants registered twice (from the registry itself: the variant versions
per source version and variant), lost events (a version with no optimize run that ended), the
task figures of ``bench.scale``, the scheduler's and the API server's memory (resident bytes of
their process trees, sampled every few seconds: start, peak, end) and the PostgreSQL connections
to the deployment's two databases (peak of ``pg_stat_activity``).
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import requests

SECRET = "bench-load-secret"
TAGS = {"graphtrim.optimize": "true", "graphtrim.variants": "graph"}
ENDED = ("success", "failed")


def run_counts(
    arrived: Iterable[tuple[str, str]], runs: Iterable[Mapping[str, Any]]
) -> dict[str, Any]:
    """How the optimize runs cover the versions that arrived: ``ended`` (versions with a run
    that ended), ``succeeded``, ``duplicates`` (versions with more than one run, whatever their
    state), ``lost`` (versions with no run that ended) and ``strays`` (runs of no arrived
    version), each a count, with the versions behind the last three."""
    wanted = {(str(n), str(v)) for n, v in arrived}
    by_version: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    strays = []
    for r in runs:
        conf = r.get("conf") or {}
        key = (str(conf.get("model_name")), str(conf.get("version")))
        if key in wanted:
            by_version[key].append(str(r.get("state")))
        else:
            strays.append(r.get("dag_run_id"))
    twice = sorted(k for k, states in by_version.items() if len(states) > 1)
    lost = sorted(k for k in wanted if not any(s in ENDED for s in by_version.get(k, [])))
    return {
        "arrived": len(wanted),
        "ended": sum(1 for k in wanted if any(s in ENDED for s in by_version.get(k, []))),
        "succeeded": sum(1 for k in wanted if "success" in by_version.get(k, [])),
        "duplicates": len(twice),
        "lost": len(lost),
        "strays": len(strays),
        "duplicate_versions": [f"{n} v{v}" for n, v in twice],
        "lost_versions": [f"{n} v{v}" for n, v in lost],
    }


def variant_counts(version_tags: Iterable[Mapping[str, str]]) -> dict[str, int]:
    """Registered variant versions per ``source name vN variant``, from the tags of every version
    of the registered models (a source version has no ``graphtrim.source.*`` tags)."""
    out: dict[str, int] = collections.Counter()
    for tags in version_tags:
        name, version = tags.get("graphtrim.source.name"), tags.get("graphtrim.source.version")
        if name and version:
            out[f"{name} v{version} {tags.get('graphtrim.variant', '?')}"] += 1
    return dict(out)


def memory_figures(samples: list[float]) -> dict[str, float | None]:
    """Start, peak and end of a series of resident sizes in bytes, in MiB."""
    if not samples:
        return {"start_mib": None, "peak_mib": None, "end_mib": None}
    mib = [s / 2**20 for s in samples]
    return {
        "start_mib": round(mib[0], 1),
        "peak_mib": round(max(mib), 1),
        "end_mib": round(mib[-1], 1),
    }


def _tree_rss(pid: int) -> float:
    import psutil

    try:
        proc = psutil.Process(pid)
        total = proc.memory_info().rss
        for child in proc.children(recursive=True):
            try:
                total += child.memory_info().rss
            except psutil.Error:
                continue
        return float(total)
    except psutil.Error:
        return 0.0


class Sampler(threading.Thread):
    """Every ``every`` seconds: the resident size of each named process tree and the connections
    to each of ``databases`` (``pg_stat_activity``), until stopped."""

    def __init__(self, pids: dict[str, int], pg: str, databases: list[str], every: float = 3.0):
        super().__init__(daemon=True)
        self.pids, self.pg, self.databases, self.every = pids, pg, databases, every
        self.rss: dict[str, list[float]] = {name: [] for name in pids}
        self.connections: list[dict[str, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        import psycopg2

        db = psycopg2.connect(f"{self.pg}/postgres")
        db.autocommit = True
        try:
            while True:
                for name, pid in self.pids.items():
                    self.rss[name].append(_tree_rss(pid))
                with db.cursor() as cur:
                    cur.execute(
                        "select datname, count(*) from pg_stat_activity "
                        "where datname = any(%s) group by datname",
                        (self.databases,),
                    )
                    self.connections.append({k: int(v) for k, v in cur.fetchall()})
                if self.stop.wait(self.every):
                    break
        finally:
            db.close()

    def figures(self) -> dict[str, Any]:
        totals = [sum(c.values()) for c in self.connections]
        peak = {
            db: max((c.get(db, 0) for c in self.connections), default=0) for db in self.databases
        }
        return {
            "memory": {name: memory_figures(xs) for name, xs in self.rss.items()},
            "pg_connections_peak": max(totals, default=0),
            "pg_connections_peak_per_database": peak,
            "samples": len(self.connections),
            "sample_every_s": self.every,
        }


def post_webhook(api: str, name: str, version: str) -> str:
    """MLflow's signed ``model_version.created`` for a version, POSTed to the plugin; the
    answer's status (``triggered``, ``duplicate``, ...) or ``http <code>``."""
    from graphtrim.airflow.plugin import sign

    body = json.dumps(
        {
            "entity": "model_version",
            "action": "created",
            "timestamp": int(time.time()),
            "data": {"name": name, "version": version, "source": "", "run_id": "", "tags": {}},
        }
    ).encode()
    delivery, stamp = uuid.uuid4().hex, str(int(time.time()))
    headers = {
        "X-MLflow-Delivery-Id": delivery,
        "X-MLflow-Timestamp": stamp,
        "X-MLflow-Signature": sign(SECRET, delivery, stamp, body),
        "Content-Type": "application/json",
    }
    try:
        r = requests.post(f"{api}/graphtrim/mlflow-webhook", data=body, headers=headers, timeout=60)
    except requests.RequestException as exc:
        return f"error {type(exc).__name__}"
    return str(r.json().get("status")) if r.status_code == 200 else f"http {r.status_code}"


def _say(text: str) -> None:
    print(f"[load] {text}", file=sys.stderr, flush=True)


def _dag_runs(api: str, dag: str) -> list[dict[str, Any]]:
    from bench.scale import _get

    return list(_get(api, f"/api/v2/dags/{dag}/dagRuns", limit=1000)["dag_runs"])


def _watermarked(client: Any, names: list[str]) -> bool:
    """Whether the watcher has seen every model (its watermark tag is set on it)."""
    from graphtrim.airflow.triggers import WATERMARK

    key = WATERMARK + "graphtrim_registry_events"
    return all(key in (client.get_registered_model(n).tags or {}) for n in names)


def run_load(args: Any, model: Path, root: Path) -> dict[str, Any]:
    import boto3
    from mlflow import MlflowClient

    from bench.scale import _ts, task_figures
    from tests.deployment import PG, _bin, deployment
    from tests.servers import moto_server, register_onnx

    via = set(args.via.split(","))
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        GRAPHTRIM_WATCH_INTERVAL=str(args.watch_interval),
        GRAPHTRIM_WEBHOOK_SECRET=SECRET,
    )
    with moto_server(root / "s3") as s3:
        boto3.client("s3", endpoint_url=s3, region_name="us-east-1").create_bucket(Bucket="bench")
        with deployment(root, s3=s3, bucket="bench") as d:
            api, procs = d["api"], d["procs"]
            procs.start("triggerer", [_bin("airflow"), "triggerer", "--skip-serve-logs"], d["env"])
            client = MlflowClient(d["mlflow"], d["mlflow"])
            names = [f"load-{m:02d}" for m in range(args.models)]
            for name in names:  # watched before their first version: every version is new
                client.create_registered_model(name, tags=TAGS)
            dags = ["graphtrim_optimize_model"]
            dags += ["graphtrim_registry_events"] if "events" in via else []
            for dag in dags:
                while requests.get(f"{api}/api/v2/dags/{dag}", timeout=10).status_code != 200:
                    procs.check()
                    time.sleep(2)
                requests.patch(f"{api}/api/v2/dags/{dag}", json={"is_paused": False}, timeout=10)
            deadline = time.time() + 600
            while "events" in via and not _watermarked(client, names):
                procs.check()
                if time.time() > deadline:
                    raise RuntimeError("the registry watcher never saw the models")
                time.sleep(2)
            databases = [
                d["airflow_db"].rsplit("/", 1)[1],
                next(a for a in procs.procs["mlflow"].args if "postgresql" in a).rsplit("/", 1)[1],
            ]
            pids = {
                "scheduler": procs.procs["scheduler"].pid,
                "api_server": procs.procs["api-server"].pid,
            }
            sampler = Sampler(pids, PG, databases, every=args.sample_every)
            sampler.start()
            arrived: list[tuple[str, str]] = []
            answers: collections.Counter[str] = collections.Counter()
            spacing = args.arrival_minutes * 60 / max(args.versions, 1)
            t0 = time.time()
            for i in range(args.versions):
                time.sleep(max(0.0, t0 + i * spacing - time.time()))
                name = names[i % len(names)]
                version = register_onnx(d["mlflow"], model, name)
                arrived.append((name, version))
                if "webhook" in via:
                    answers[post_webhook(api, name, version)] += 1
                if i % 10 == 9:
                    _say(f"{i + 1}/{args.versions} versions arrived ({time.time() - t0:.0f} s)")
            arrival_s = time.time() - t0
            deadline = time.time() + args.timeout_minutes * 60
            quiet_since = None
            while time.time() < deadline:
                procs.check()
                runs = _dag_runs(api, "graphtrim_optimize_model")
                events = _dag_runs(api, "graphtrim_registry_events") if "events" in via else []
                counts = run_counts(arrived, runs)
                busy = [r for r in runs + events if r["state"] not in ENDED]
                _say(f"{counts['ended']}/{len(arrived)} versions ended, {len(busy)} runs busy")
                if counts["ended"] == len(arrived) and not busy:
                    # both paths had their chance: a late second run would show here
                    quiet_since = quiet_since or time.time()
                    if time.time() - quiet_since > 3 * args.watch_interval + 20:
                        break
                else:
                    quiet_since = None
                time.sleep(10)
            sampler.stop.set()
            sampler.join()
            runs = _dag_runs(api, "graphtrim_optimize_model")
            events = _dag_runs(api, "graphtrim_registry_events") if "events" in via else []
            counts = run_counts(arrived, runs)
            registered = [
                dict(v.tags or {})
                for name in names
                for v in client.search_model_versions(f"name='{name}'")
            ]
            variants = variant_counts(registered)
            per_source = dict.fromkeys((f"{n} v{v}" for n, v in arrived), 0)
            for key, count in variants.items():  # "name vN variant"
                source = key.rsplit(" ", 1)[0]
                per_source[source] = per_source.get(source, 0) + count
            end = max((_ts(r.get("end_date")) or 0.0) for r in runs) if runs else time.time()
            return {
                "mode": "load",
                "executor": "CeleryExecutor",
                "via": sorted(via),
                "models": args.models,
                "versions": args.versions,
                "arrival_s": round(arrival_s, 1),
                "watch_interval_s": args.watch_interval,
                **counts,
                "runs": len(runs),
                "events_runs": len(events),
                "webhook_answers": dict(answers),
                "variants_registered": sum(variants.values()),
                "variants_registered_twice": sum(1 for n in variants.values() if n > 1),
                "variant_versions_per_source_max": max(per_source.values(), default=0),
                "sources_with_several_variant_versions": sum(
                    1 for n in per_source.values() if n > 1
                ),
                "seconds": round(end - t0, 1),
                "versions_per_hour": round(len(arrived) / max(end - t0, 1e-9) * 3600, 1),
                **sampler.figures(),
                **task_figures(api, d["mlflow"], runs),
            }


def _three(stats: Mapping[str, Any]) -> str:
    if stats.get("median") is None:
        return "-"
    return f"{stats['median']:.2f} / {stats['p90']:.2f} / {stats.get('p99', stats['p90']):.2f}"


def _mem(m: Mapping[str, Any]) -> str:
    if m.get("peak_mib") is None:
        return "-"
    return f"{m['start_mib']:.0f} / {m['peak_mib']:.0f} / {m['end_mib']:.0f}"


def render_load(r: Mapping[str, Any]) -> str:
    """The Markdown tables of a load run (seconds: median / p90 / p99; MiB: start / peak /
    end)."""
    mem = r.get("memory") or {}
    rows = [
        (
            "delivered by",
            " + ".join(r["via"]) + f" (registry poll every {r['watch_interval_s']:g} s)",
        ),
        ("versions arrived", f"{r['arrived']} ({r['models']} models, over {r['arrival_s']:.0f} s)"),
        ("runs ended", f"{r['ended']} / {r['arrived']} ({r['succeeded']} succeeded)"),
        ("versions optimized twice", str(r["duplicates"])),
        ("variants registered twice", str(r["variants_registered_twice"])),
        (
            "variant versions per source version, max",
            str(r.get("variant_versions_per_source_max", "-")),
        ),
        ("lost events", str(r["lost"])),
        ("optimize runs / events runs", f"{r['runs']} / {r['events_runs']}"),
        (
            "webhook answers",
            ", ".join(f"{k} {v}" for k, v in sorted(r["webhook_answers"].items())) or "-",
        ),
        ("seconds (first arrival -> last run end)", f"{r['seconds']:.0f}"),
        ("versions/h", f"{r['versions_per_hour']:.0f}"),
        ("queued -> started (s)", _three(r["queued_to_start_s"])),
        ("ready -> started (s)", _three(r["ready_to_start_s"])),
        ("added in a stage's task (s)", _three(r["stage_task_added_s"])),
        ("task wall (s)", _three(r["task_wall_s"])),
        ("scheduler RSS (MiB)", _mem(mem.get("scheduler") or {})),
        ("API server RSS (MiB)", _mem(mem.get("api_server") or {})),
        ("PostgreSQL connections, peak", str(r["pg_connections_peak"])),
    ]
    lines = ["| load | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)
