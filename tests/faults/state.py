"""The registry state a pipeline run leaves, in a form two runs can be compared by: what a run
without a fault leaves must be what a run with one leaves after its retries.

Version numbers, run ids, timestamps and who moved an alias differ between any two runs; they
are replaced by what they stand for (the variant a version holds, the action an audit entry
records).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# tags that name this run, not what it registered
VOLATILE = ("graphtrim.pipeline_run_id", "graphtrim.orchestrator_run_id")
# a gate policy's verdict on a version (``graphtrim.verdict.<policy hash>``): what it decided is
# the state; its run, its time and the timings measured differ from run to run
VERDICT_TAG = "graphtrim.verdict."
VERDICT_STATE = ("passed", "gates", "policy_hash", "measured")


def snapshot(
    tracking: str, target: str, experiment: str, *, s3: str, workdirs: list[Path], tmp: Path
) -> dict[str, Any]:
    """Everything a run leaves in the registry under ``target``, in its MLflow experiment, in
    the artifact store (``s3``: the endpoint, without any proxy) and in ``workdirs``."""
    import boto3
    from mlflow import MlflowClient

    from graphtrim.integrations.artifacts import S3Store, split_s3
    from graphtrim.integrations.model_files import model_files, sha256_files
    from graphtrim.integrations.registry import Registry, SourceVersion

    client = MlflowClient(tracking, tracking)
    versions = sorted(
        client.search_model_versions(f"name='{target}'"), key=lambda v: int(v.version)
    )
    variant_of = {str(v.version): v.tags.get("graphtrim.variant", "?") for v in versions}

    def named(version: Any) -> str:
        return variant_of.get(str(version), f"missing:{version}") if version is not None else "-"

    out: dict[str, Any] = {"versions": [], "problems": []}
    per_variant: dict[str, int] = {}
    registry = Registry(tracking)
    for mv in versions:
        tags = dict(mv.tags or {})
        variant = tags.get("graphtrim.variant", "?")
        per_variant[variant] = per_variant.get(variant, 0) + 1
        audits = {}
        for k in sorted(tags):
            if k.startswith("graphtrim.audit."):
                entries = json.loads(tags.pop(k))
                audits[k] = [(e["action"], named(e["from"]), named(e["to"])) for e in entries]
        for k in VOLATILE:
            tags.pop(k, None)
        for k in [k for k in tags if k.startswith(VERDICT_TAG)]:
            verdict = json.loads(tags[k])
            tags[k] = json.dumps({f: verdict.get(f) for f in VERDICT_STATE}, sort_keys=True)
        out["versions"].append({"variant": variant, "tags": tags, "audit": audits})
        if mv.status != "READY":
            out["problems"].append(f"version {mv.version} is {mv.status}")
        # the artifact the version names, complete, in the store
        uri = tags.get("graphtrim.artifact", "")
        bucket, _ = split_s3(uri)
        store = S3Store(bucket, endpoint_url=s3)
        try:
            got = store.fetch_model(uri, tmp / f"store-{mv.version}")
            if sha256_files(model_files(got)) != tags.get("graphtrim.sha256"):
                out["problems"].append(f"version {mv.version}: stored bytes differ from sha256")
        except Exception as exc:
            out["problems"].append(f"version {mv.version}: artifact {uri}: {exc}")
        # MLflow's copy, the same bytes
        try:
            source = SourceVersion(mv.name, str(mv.version), None, mv.run_id, mv.source, tags)
            got = Path(registry.download(source, str(tmp / f"mlflow-{mv.version}")))
            model = got / "model.onnx" if got.is_dir() else got
            if sha256_files(model_files(model)) != tags.get("graphtrim.sha256"):
                out["problems"].append(f"version {mv.version}: MLflow's copy differs from sha256")
        except Exception as exc:
            out["problems"].append(f"version {mv.version}: MLflow's files: {exc}")
    out["duplicates"] = {v: n for v, n in per_variant.items() if n > 1}
    rm = client.get_registered_model(target) if versions else None
    aliases = dict(getattr(rm, "aliases", None) or {})
    out["aliases"] = {a: named(v) for a, v in sorted(aliases.items())}
    rm_tags = dict(rm.tags or {}) if rm is not None else {}
    moves: dict[str, list[Any]] = {}
    history: dict[str, list[str]] = {}
    for k, v in sorted(rm_tags.items()):
        if k.startswith("graphtrim.moves."):
            alias = k.removeprefix("graphtrim.moves.").rsplit(".", 1)[0]
            e = json.loads(v)
            moves.setdefault(alias, []).append((e["action"], named(e["from"]), named(e["to"])))
        elif k.startswith("graphtrim.alias_history."):
            history[k.removeprefix("graphtrim.alias_history.")] = [named(x) for x in json.loads(v)]
    out["moves"] = moves
    out["history"] = history
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id]) if exp is not None else []
    out["runs"] = sorted(r.info.status for r in runs)
    out["running"] = [r.info.run_id for r in runs if r.info.status == "RUNNING"]
    # what the artifact store holds half-written
    s3c = boto3.client("s3", endpoint_url=s3)
    for bucket in [b["Name"] for b in s3c.list_buckets().get("Buckets", [])]:
        for up in s3c.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
            out["problems"].append(f"unfinished multipart upload s3://{bucket}/{up['Key']}")
    # graphtrim's staging folders (a library's dotfile in the temporary folder is not one)
    left = [str(p) for w in workdirs if w.exists() for p in w.iterdir() if p.name[0] != "."]
    out["staging_left"] = sorted(left)
    return out


def compare(reference: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """What differs between two snapshots, one line each (empty: the same state)."""
    diffs = []
    for key in ("versions", "aliases", "moves", "history", "runs"):
        if reference[key] != got[key]:
            diffs.append(f"{key}: expected {reference[key]!r}, found {got[key]!r}"[:2000])
    if got["duplicates"]:
        diffs.append(f"duplicate versions: {got['duplicates']}")
    if got["running"]:
        diffs.append(f"runs left RUNNING: {got['running']}")
    if got["staging_left"]:
        diffs.append(f"staging left: {got['staging_left']}")
    diffs += got["problems"]
    return diffs
