"""The pipeline under real conditions: a runtime crash fails one variant, promotion that noise
cannot move, holds that re-runs respect, the full history of moves, no feedback loop, runs
that never stay RUNNING for a dead process. Against a real MLflow server and S3 (moto)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from graphtrim.cli import main
from graphtrim.examples.digits import DigitsTask
from graphtrim.gates.policy import PromotionPolicy
from graphtrim.integrations.registry import Registry
from graphtrim.isolation import ChildFailed, map_isolated
from graphtrim.promotion import apply_policy, promote_version
from graphtrim.stages import tracking, validate
from graphtrim.stages.context import PipelineConfig, StageContext
from tests.conftest import BUCKET, REPO
from tests.servers import register_onnx

pytestmark = [pytest.mark.slow]

mlflow = pytest.importorskip("mlflow")

ABORT_ENV = {
    "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "ort_abort"), str(REPO)]),
    "GRAPHTRIM_TEST_ABORT_FP16": "1",
}


def _ctx(servers: dict[str, str], tmp_path: Path, **kw: Any) -> StageContext:
    return StageContext(
        servers["mlflow"],
        f"s3://{BUCKET}/conditions",
        workdir=str(tmp_path / "work"),
        s3_endpoint_url=servers["s3"],
        **kw,
    )


RELAXED = {
    "variants": {
        v: {"latency": {"min_speedup": None, "runs": 40, "warmup": 5}}
        for v in ("graph", "int8-static", "int8-dynamic", "fp16")
    }
}


# ---------------------------------------------------------------------------- 1: crashes


@pytest.fixture(scope="module")
def fp16_model(digits_task: DigitsTask, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from graphtrim.quantize.build import build_variant

    out = tmp_path_factory.mktemp("fp16") / "digits.fp16.onnx"
    build_variant(digits_task.model, out, "fp16", probe=False)
    return out


def test_a_runtime_crash_in_the_gates_fails_that_variant_alone(
    servers: dict[str, str],
    digits_task: DigitsTask,
    fp16_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in ABORT_ENV.items():
        monkeypatch.setenv(key, value)
    # the serving probe: the child dies of SIGABRT while loading; the graph model is served
    probes = map_isolated(
        "graphtrim.integrations.serving:serving_probe",
        [str(fp16_model), str(digits_task.model)],
    )
    assert isinstance(probes[0], ChildFailed) and probes[0].signal_name == "SIGABRT"
    assert "mlflow.pyfunc.load_model" in str(probes[0])
    assert probes[1]["flavor"] == "mlflow.onnx"
    # the gates: measured together, the crash takes the child down; each variant is then
    # measured alone and only fp16 fails, with the signal
    from graphtrim.data import input_specs, load_npz

    data = load_npz(digits_task.eval, input_specs(digits_task.model))
    config = PipelineConfig(variants=("graph", "fp16"), policy=RELAXED)
    evaluation = validate.evaluate_isolated(
        _ctx(servers, tmp_path),
        config,
        digits_task.model,
        {"graph": digits_task.model, "fp16": fp16_model},
        data,
    )
    by_name = {v.name: v for v in evaluation.variants}
    assert by_name["fp16"].gates[0].gate == "runtime"
    assert "SIGABRT" in by_name["fp16"].gates[0].reasons[0]
    assert by_name["graph"].gate("accuracy") is not None
    assert by_name["graph"].gate("accuracy").passed  # type: ignore[union-attr]


def test_variants_too_large_to_hold_together_are_measured_beside_the_reference_one_at_a_time(
    servers: dict[str, str], digits_task: DigitsTask, fp16_model: Path, tmp_path: Path
) -> None:
    """Below the size bound the variants share one child and one interleaved run. Above it
    (made small here) each variant gets its own child with the reference: one variant's session
    at a time, so the peak memory is the reference and the largest variant, not their sum.
    Where the reference and one variant are above it too, that child opens one session at a
    time and the latency runs take turns block by block."""
    from graphtrim.data import input_specs, load_npz
    from graphtrim.gates.verdicts import ModelInfo

    data = load_npz(digits_task.eval, input_specs(digits_task.model))
    config = PipelineConfig(variants=("graph", "fp16"), policy=RELAXED)
    paths = {"graph": digits_task.model, "fp16": fp16_model}
    sizes = {n: ModelInfo.file_bytes(p) for n, p in paths.items()}
    pair = ModelInfo.file_bytes(digits_task.model) + max(sizes.values())
    timed: dict[int, dict[str, tuple[int, str]]] = {}
    for bound in (1 << 40, pair, 1):
        lines: list[str] = []
        ctx = _ctx(servers, tmp_path / str(bound), progress=lines.append)
        evaluation = validate.evaluate_isolated(
            ctx, config, digits_task.model, paths, data, together_max_bytes=bound
        )
        timed[bound] = {}
        for result in evaluation.variants:
            latency = result.gate("latency")
            assert latency is not None and result.gate("accuracy") is not None, result
            settings = latency.measured["settings"]
            timed[bound][result.name] = (settings["models"], settings["interleaved"])
        alone = [line for line in lines if "measured beside the reference alone" in line]
        assert bool(alone) == (bound < 1 << 40), lines
    # the reference and both variants, run by run
    assert timed[1 << 40] == {"graph": (3, "runs"), "fp16": (3, "runs")}
    # the reference and one variant, run by run
    assert timed[pair] == {"graph": (2, "runs"), "fp16": (2, "runs")}
    # the reference and one variant, block by block, one session open at a time
    assert timed[1] == {"graph": (2, "blocks"), "fp16": (2, "blocks")}


def test_quantize_never_writes_a_model_that_crashes_the_runtime(
    digits_task: DigitsTask, tmp_path: Path
) -> None:
    out = tmp_path / "out.onnx"
    env = {**os.environ, **ABORT_ENV}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "graphtrim.cli",
            "quantize",
            str(digits_task.model),
            "-o",
            str(out),
            "--variant",
            "fp16",
            "--no-tune",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode not in (0, -6), proc.stderr  # refused, and the CLI itself lives
    assert "SIGABRT" in proc.stderr and "cannot be served" in proc.stderr
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # nothing half-written beside it


def test_a_variant_that_crashes_the_runtime_fails_alone_and_the_run_ends(
    servers: dict[str, str],
    digits_task: DigitsTask,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for key, value in ABORT_ENV.items():
        monkeypatch.setenv(key, value)
    register_onnx(servers["mlflow"], digits_task.model, "digits-crash")
    args = [
        "pipeline",
        "run",
        "--model",
        "models:/digits-crash/1",
        "--tracking-uri",
        servers["mlflow"],
        "--artifacts",
        f"s3://{BUCKET}/crash",
        "--s3-endpoint-url",
        servers["s3"],
        "--variants",
        "graph,int8-static,fp16",
        "--calibration",
        str(digits_task.calibration),
        "--eval-data",
        str(digits_task.eval),
        "--policy-json",
        json.dumps(RELAXED),
        "--json",
        str(tmp_path / "records.json"),
        "--workdir",
        str(tmp_path / "work"),
    ]
    # fp16 failed (its serving probe crashed): exit 1, the other two registered all the same;
    # --allow-failed-variants: 0, as one passed (a re-run, which registers nothing new)
    assert main(args) == 1
    table = capsys.readouterr().out
    records = json.loads((tmp_path / "records.json").read_text())
    assert "fp16" in records["register"]["failed"]
    reason = " ".join(records["register"]["failed"]["fp16"])
    assert "SIGABRT" in reason and "ORT_ENABLE_ALL" in reason
    assert set(records["register"]["registered"]) == {"graph", "int8-static"}
    assert "fp16" in table and "FAIL" in table
    assert main([*args, "--allow-failed-variants"]) == 0
    assert "failed gates: fp16" in capsys.readouterr().err
    client = mlflow.MlflowClient(servers["mlflow"], servers["mlflow"])
    run = client.get_run(records["export"]["run_id"])
    assert run.info.status == "FINISHED"
    fp16 = [
        v
        for v in client.search_model_versions("name='digits-crash'")
        if v.tags.get("graphtrim.variant") == "fp16"
    ]
    assert fp16 == []


# ---------------------------------------------------------------------------- 3, 4: promotion


def _variant_version(
    servers: dict[str, str], model: Path, name: str, variant: str, sha: str, source: str = "1"
) -> str:
    version = register_onnx(servers["mlflow"], model, name)
    client = mlflow.MlflowClient(servers["mlflow"], servers["mlflow"])
    for key, value in {
        "graphtrim.variant": variant,
        "graphtrim.key": f"{variant}-{version}",
        "graphtrim.sha256": sha,
        "graphtrim.source.name": name,
        "graphtrim.source.version": source,
        "graphtrim.fingerprint": "fp",
        "graphtrim.metrics": json.dumps(
            {"speedup": 1.5, "speedup_lo": 1.4, "speedup_hi": 1.6, "p50_ms": 2.0}
        ),
    }.items():
        client.set_model_version_tag(name, version, key, value)
    return version


def _validated(variant: str, sha: str, speedup: float, lo: float, hi: float) -> dict[str, Any]:
    return {
        "reference": {"bytes": 1000},
        "fingerprint": "fp",
        "variants": {
            variant: {
                "passed": True,
                "metrics": {
                    "speedup": speedup,
                    "speedup_lo": lo,
                    "speedup_hi": hi,
                    "p50_ms": 3.0 / speedup,
                },
                "model": {"sha256": sha},
            }
        },
    }


def _apply(reg: Registry, name: str, validated: dict[str, Any], version: str) -> dict[str, Any]:
    """The pipeline's promotion of ``version`` (int8-static of source v1) under the defaults."""
    result: dict[str, Any] = apply_policy(
        reg,
        PromotionPolicy(),
        target=name,
        source={"name": name, "version": "1"},
        validated=validated,
        registered={"int8-static": {"version": version}},
        why="test",
    )
    return result


def test_identical_content_or_a_win_inside_the_noise_never_moves_the_champion(
    servers: dict[str, str], digits_task: DigitsTask
) -> None:
    name = "noise"
    register_onnx(servers["mlflow"], digits_task.model, name)  # v1: the source
    held = _variant_version(servers, digits_task.model, name, "int8-static", "a" * 64)
    same = _variant_version(servers, digits_task.model, name, "int8-static", "a" * 64)
    reg = Registry(servers["mlflow"])
    reg.client.set_registered_model_alias(name, "champion", held)
    # byte-identical file, "faster" by noise: stays
    result = _apply(reg, name, _validated("int8-static", "a" * 64, 3.0, 2.5, 3.5), same)
    assert result["champion"]["moved"] is False
    assert "same content" in result["champion"]["reason"]
    # another file whose median is faster but whose blocks overlap the holder's: stays
    other = _variant_version(servers, digits_task.model, name, "int8-static", "b" * 64)
    result = _apply(reg, name, _validated("int8-static", "b" * 64, 1.62, 1.55, 1.70), other)
    assert result["champion"]["moved"] is False
    assert "not better by the margin" in result["champion"]["reason"]
    assert reg.alias_version(name, "champion") == held
    # a win outside the noise moves it
    result = _apply(reg, name, _validated("int8-static", "b" * 64, 2.0, 1.9, 2.1), other)
    assert result["champion"]["moved"] is True
    assert reg.alias_version(name, "champion") == other


def test_a_person_holds_the_champion_until_a_new_source_version(
    servers: dict[str, str], digits_task: DigitsTask, capsys: pytest.CaptureFixture[str]
) -> None:
    name = "held"
    register_onnx(servers["mlflow"], digits_task.model, name)  # v1: the source
    v2 = _variant_version(servers, digits_task.model, name, "int8-static", "c" * 64)
    v3 = _variant_version(servers, digits_task.model, name, "int8-static", "d" * 64)
    reg = Registry(servers["mlflow"])
    policy = PromotionPolicy()
    source = {"name": name, "version": "1"}

    def run(version: str, sha: str) -> dict[str, Any]:
        return apply_policy(
            reg,
            policy,
            target=name,
            source=source,
            validated=_validated("int8-static", sha, 5.0, 4.9, 5.1),
            registered={"int8-static": {"version": version}},
            why="pipeline",
        )["champion"]

    assert run(v2, "c" * 64)["moved"] is True
    reg.client.set_model_version_tag(
        name,
        v2,
        "graphtrim.metrics",
        json.dumps({"speedup": 1.2, "speedup_hi": 1.3, "p50_ms": 5.0}),
    )
    assert run(v3, "d" * 64)["moved"] is True
    # a person rolls back: the champion is held on v2 ...
    assert (
        main(
            [
                "rollback",
                name,
                "--alias",
                "champion",
                "--why",
                "canary regression",
                "--tracking-uri",
                servers["mlflow"],
            ]
        )
        == 0
    )
    assert "held there" in capsys.readouterr().out
    assert reg.alias_version(name, "champion") == v2
    # ... and the same pipeline result does not move it forward again
    again = run(v3, "d" * 64)
    assert again["moved"] is False and "held on v" + v2 in again["reason"]
    assert reg.alias_version(name, "champion") == v2
    # a new source version releases the hold
    new_source = register_onnx(servers["mlflow"], digits_task.model, name)
    v5 = _variant_version(servers, digits_task.model, name, "int8-static", "e" * 64, new_source)
    source["version"] = new_source
    assert run(v5, "e" * 64)["moved"] is True
    assert reg.hold(name, "champion") is None
    # every move is on record, not only the latest
    moves = reg.moves(name, "champion")
    assert [(m["action"], m["to"]) for m in moves] == [
        ("promote", v2),
        ("promote", v3),
        ("rollback", v2),
        ("promote", v5),
    ]
    audits = json.loads(reg.version_tags(name, v2)["graphtrim.audit.champion"])
    assert [a["action"] for a in audits] == ["promote", "promote", "rollback", "promote"]
    # a manual promote holds too
    promote_version(reg, name, v3, "champion", why="pin for the release", force=True)
    assert reg.hold(name, "champion")["version"] == v3  # type: ignore[index]


# ---------------------------------------------------------------------------- 6: feedback


def test_a_graphtrim_variant_is_not_optimized_again_unless_asked(
    servers: dict[str, str],
    digits_task: DigitsTask,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    name = "feedback"
    register_onnx(servers["mlflow"], digits_task.model, name)
    variant = _variant_version(servers, digits_task.model, name, "graph", "f" * 64)
    client = mlflow.MlflowClient(servers["mlflow"], servers["mlflow"])
    exp = client.get_experiment_by_name("feedback-runs")
    before = len(client.search_runs([exp.experiment_id])) if exp else 0
    base = [
        "pipeline",
        "run",
        "--tracking-uri",
        servers["mlflow"],
        "--artifacts",
        str(tmp_path / "artifacts"),
        "--experiment",
        "feedback-runs",
        "--variants",
        "graph",
    ]
    capsys.readouterr()
    assert main([*base, "--model", f"models:/{name}/{variant}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    err = [line for line in err if not line.startswith("[graphtrim")]  # progress lines
    assert len(err) == 1 and "is a graphtrim variant (graph of version 1)" in err[0]
    assert "--allow-variant-source" in err[0]
    exp = client.get_experiment_by_name("feedback-runs")
    assert (len(client.search_runs([exp.experiment_id])) if exp else 0) == before
    # asked for explicitly, it runs
    code = main([*base, "--model", f"models:/{name}/{variant}", "--allow-variant-source", "-q"])
    assert code in (0, 1)
    out = capsys.readouterr()
    assert "graph" in out.out
    assert "View run" not in out.out and "[graphtrim" not in out.err  # -q is quiet


# ---------------------------------------------------------------------------- 7: bad data


def test_bad_data_fails_in_seconds_before_export_and_leaves_no_run(
    servers: dict[str, str],
    digits_task: DigitsTask,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    name = "baddata"
    register_onnx(servers["mlflow"], digits_task.model, name)
    with np.load(digits_task.eval) as npz:
        arrays = {k: npz[k] for k in npz.files}
    wrong_key = tmp_path / "wrong_key.npz"
    np.savez(wrong_key, pixels=arrays["image"], labels=arrays["labels"])
    pickled = tmp_path / "pickled.npz"
    np.save(pickled.with_suffix(".npy"), np.array([{"a": 1}], dtype=object), allow_pickle=True)
    pickled.with_suffix(".npy").rename(pickled)
    nan = tmp_path / "nan.npz"
    bad = arrays["image"].copy()
    bad[3, 0, 0, 0] = np.nan
    np.savez(nan, image=bad, labels=arrays["labels"])
    client = mlflow.MlflowClient(servers["mlflow"], servers["mlflow"])
    capsys.readouterr()
    for path, expect in (
        (wrong_key, "image"),
        (pickled, "not an .npz"),
        (nan, "non-finite"),
    ):
        code = main(
            [
                "pipeline",
                "run",
                "--model",
                f"models:/{name}/1",
                "--tracking-uri",
                servers["mlflow"],
                "--artifacts",
                str(tmp_path / "artifacts"),
                "--experiment",
                "baddata-runs",
                "--variants",
                "graph",
                "--eval-data",
                str(path),
            ]
        )
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("graphtrim:")]
        assert code == 2
        assert len(err) == 1, err
        assert expect in err[0] and "allow_pickle" not in err[0]
    exp = client.get_experiment_by_name("baddata-runs")
    assert exp is None or client.search_runs([exp.experiment_id]) == []


# ---------------------------------------------------------------------------- 9: dead runs


def test_a_run_left_running_by_a_dead_process_is_closed_on_the_next_start(
    servers: dict[str, str],
) -> None:
    client = mlflow.MlflowClient(servers["mlflow"], servers["mlflow"])
    exp = tracking.experiment_id(client, "dead-runs")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()

    def run_with(**stages: Any) -> Any:
        tags = {"graphtrim.pipeline": "1"}
        for label, (pid, ended) in stages.items():
            tags[f"graphtrim.worker.{label}"] = json.dumps({"host": host, "pid": pid})
            if ended:
                tags[f"graphtrim.seconds.{label}"] = "1.0"
        return client.create_run(exp, tags=tags)

    killed = run_with(export=(os.getppid(), True), quantize=(dead.pid, False))
    # a stage still running in a live process (another mapped task's died)
    alive = run_with(
        **{"quantize.graph": (dead.pid, False), "quantize.fp16": (os.getppid(), False)}
    )
    # between two stages: the process of the last one is gone, no stage is in progress
    between = run_with(export=(dead.pid, True))
    closed = tracking.close_dead_runs(client, exp)
    assert closed == [killed.info.run_id]
    got = client.get_run(killed.info.run_id)
    assert got.info.status == "KILLED"
    assert f"({dead.pid} on {host}) is gone" in got.data.tags["graphtrim.error"]
    assert client.get_run(alive.info.run_id).info.status == "RUNNING"
    assert client.get_run(between.info.run_id).info.status == "RUNNING"


# ---------------------------------------------------------------------------- 10: the table


def test_the_table_names_each_column_once_and_marks_recorded_verdicts() -> None:
    from graphtrim.stages.summary import table

    summary = {
        "passed": True,
        "gates": {"serving": "pass", "size": "pass", "accuracy": "pass", "latency": "pass"},
        "metrics": {"speedup": 1.5, "size_ratio": 0.27},
    }
    text = table(
        {
            "validate": {
                "variants": {"int8-static": summary, "graph": {**summary, "reused": True}}
            },
            "register": {"registered": {}},
        }
    )
    header = re.split(r"\s{2,}", text.splitlines()[0].strip())
    assert "size gate" in header and "size ratio" in header and "size" not in header
    assert len(header) == len(set(header)) and "serving" in header
    assert "PASS (recorded)" in text and "0.27x" in text


# ---------------------------------------------------------------------------- 10: data files


def test_a_stage_fetches_each_data_file_once(
    servers: dict[str, str],
    digits_task: DigitsTask,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stages run apart, as an orchestrator runs them (records through JSON, a config without
    its data hashes): each stage downloads each S3 data file once, and the copy it hashes for
    the config hash is the copy it checks and loads."""
    import boto3

    from graphtrim.integrations import artifacts
    from graphtrim.stages import pipeline

    s3 = boto3.client("s3", endpoint_url=servers["s3"])
    uris = []
    for role, path in (("calibration", digits_task.calibration), ("eval", digits_task.eval)):
        s3.upload_file(str(path), BUCKET, f"data-once/{role}.npz")
        uris.append(f"s3://{BUCKET}/data-once/{role}.npz")
    fetched: list[str] = []
    real = artifacts.fetch_file

    def counting(uri: str, dest: Any, **kw: Any) -> Path:
        fetched.append(uri)
        return real(uri, dest, **kw)

    monkeypatch.setattr(artifacts, "fetch_file", counting)
    version = register_onnx(servers["mlflow"], digits_task.model, "data-once")
    ctx = _ctx(servers, tmp_path)
    config = PipelineConfig(
        variants=("graph",),
        calibration=uris[0],
        eval_data=uris[1],
        policy={"defaults": {"latency": False}},
    )
    per_stage: dict[str, list[str]] = {}

    def run(stage: str, *args: Any) -> dict[str, Any]:
        fetched.clear()
        record = getattr(pipeline, stage)(ctx, config, *args)
        per_stage[stage] = sorted(fetched)
        return json.loads(json.dumps(dict(record)))  # what an XCom carries

    exported = run("export", f"models:/data-once/{version}")
    optimized = run("optimize", exported)
    quantized = run("quantize", exported, optimized)
    validated = run("validate", exported, quantized)
    assert validated["variants"]["graph"]["passed"], validated["variants"]["graph"]["reasons"]
    assert per_stage == {s: sorted(uris) for s in ("export", "optimize", "quantize", "validate")}


# ------------------------------------------------------------ verification on the config's data


def test_the_optimize_stage_verifies_on_the_configs_data_where_random_inputs_cannot_run(
    servers: dict[str, str], tmp_path: Path
) -> None:
    """A model indexing a table by a code in 16000..16003 cannot run on random codes: with no
    data the optimize stage says it cannot verify (and stores nothing); with evaluation data
    it verifies on that data and stores the optimized model."""
    import onnx

    from graphtrim.errors import VerificationUnavailable
    from graphtrim.stages.export import export
    from graphtrim.stages.optimize import optimize

    proto = onnx.parser.parse_model(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x, int64[N] code) => (float[N, 4] y) {
          base = Constant<value = int64 {16000}>()
          idx = Sub(code, base)
          table = Constant<value = float[4, 4] {1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16}>()
          rows = Gather<axis = 0>(table, idx)
          one = Constant<value = float {1.0}>()
          z = Mul(x, one)
          y = Add(z, rows)
        }
        """
    )
    src = tmp_path / "coded.onnx"
    onnx.save(proto, str(src))
    register_onnx(servers["mlflow"], src, "coded")
    rng = np.random.default_rng(0)
    data = tmp_path / "eval.npz"
    np.savez(
        data,
        x=rng.standard_normal((10, 4)).astype(np.float32),
        code=rng.integers(16000, 16004, size=10).astype(np.int64),
    )
    ctx = _ctx(servers, tmp_path)
    plain = PipelineConfig(variants=["graph"])
    with pytest.raises(VerificationUnavailable, match="reference model fails to run"):
        optimize(ctx, plain, export(ctx, plain, "models:/coded/1"))
    config = PipelineConfig(variants=["graph"], eval_data=str(data))
    record = optimize(ctx, config, export(ctx, config, "models:/coded/1"))
    assert record.model is not None and record.nodes_after < record.nodes_before
    client = mlflow.MlflowClient(servers["mlflow"], servers["mlflow"])
    doc = client.download_artifacts(record.run_id, "graphtrim/optimize.json", str(tmp_path))
    verification = json.loads(Path(doc).read_text())["verification"]
    assert verification["ok"] and verification["trials"] == 3
    assert verification["input_shapes"] == {"x": [4, 4], "code": [4]}
