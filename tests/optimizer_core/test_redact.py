"""Credentials never reach a message, a log line or a tag: a tracking URI or S3 endpoint with
``user:password@``, bearer tokens and signed-URL parameters are masked in the CLI's error line
and in the ``graphtrim.error`` tag of a pipeline run on a real MLflow server."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import BUCKET
from tests.helpers import tiny_onnx
from tests.servers import free_port, register_onnx

SECRET = "s3cr3t-pw"


@pytest.mark.parametrize(
    ("text", "gone", "kept"),
    [
        pytest.param(
            f"cannot reach http://alice:{SECRET}@127.0.0.1:5000/api",
            [SECRET, "alice"],
            ["http://***@127.0.0.1:5000/api"],
            id="userinfo",
        ),
        pytest.param(
            f"postgresql://mlflow:{SECRET}@db/mlflow failed",
            [SECRET],
            ["postgresql://***@db/mlflow"],
            id="database-uri",
        ),
        pytest.param(
            "Authorization: Bearer tok.en-123", ["tok.en-123"], ["Bearer ***"], id="bearer"
        ),
        pytest.param(
            "{'Authorization': 'Basic YWxpY2U6c2VjcmV0'}",
            ["YWxpY2U6c2VjcmV0"],
            ["Basic ***"],
            id="basic-header",
        ),
        pytest.param(
            "https://b.s3.amazonaws.com/k?AWSAccessKeyId=AKIAIOSFODNN7EXAMPLE"
            "&Signature=abc%2Fdef&Expires=1",
            ["AKIAIOSFODNN7EXAMPLE", "abc%2Fdef"],
            ["Expires=1", "https://b.s3.amazonaws.com/k?"],
            id="presigned-v2",
        ),
        pytest.param(
            "GET /k?X-Amz-Credential=AKIA/2026&X-Amz-Signature=0123abcd&X-Amz-Security-Token=zz9",
            ["0123abcd", "zz9"],
            ["X-Amz-Signature=***"],
            id="presigned-v4",
        ),
        pytest.param(
            f"retry with token={SECRET}&password={SECRET}x",
            [SECRET],
            ["token=***", "password=***"],
            id="query-params",
        ),
        pytest.param(
            "key AKIAIOSFODNN7EXAMPLE refused", ["AKIAIOSFODNN7EXAMPLE"], ["refused"], id="key-id"
        ),
        pytest.param(
            "models:/resnet@champion s3://bucket/prefix/model.onnx file:///tmp/x",
            [],
            ["models:/resnet@champion", "s3://bucket/prefix/model.onnx", "file:///tmp/x"],
            id="no-secret-unchanged",
        ),
    ],
)
def test_redact_masks_credentials_and_keeps_the_rest(
    text: str, gone: list[str], kept: list[str]
) -> None:
    from graphtrim.redact import redact

    out = redact(text)
    for g in gone:
        assert g not in out, out
    for k in kept:
        assert k in out, out


def test_redact_masks_known_secret_values() -> None:
    from graphtrim.integrations.registry import MlflowAuth
    from graphtrim.redact import redact

    assert redact("sent token-of-team-A to B", ["token-of-team-A"]) == "sent *** to B"
    MlflowAuth(token="a-registered-token-value")  # a connection's secrets are registered
    assert "a-registered-token-value" not in redact("echo a-registered-token-value")
    assert "a-registered-token-value" not in repr(MlflowAuth(token="a-registered-token-value"))


def test_log_filter_masks_messages_and_tracebacks() -> None:
    from graphtrim.redact import install_log_filter

    logger = logging.getLogger("graphtrim.test_redact")
    logger.propagate = False
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logger.addHandler(handler)
    try:
        install_log_filter(logger)
        install_log_filter(logger)  # once is enough: no second filter
        assert len(handler.filters) == 1
        logger.warning("polling %s", f"http://alice:{SECRET}@mlflow:5000")
        try:
            raise RuntimeError(f"401 for https://h/x?token={SECRET}")
        except RuntimeError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    text = out.getvalue()
    assert SECRET not in text
    assert "http://***@mlflow:5000" in text and "token=***" in text


def test_cli_error_line_masks_the_tracking_uri_password(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "graphtrim.cli",
            "pipeline",
            "run",
            "--model",
            "models:/m/1",
            "--tracking-uri",
            f"http://alice:{SECRET}@127.0.0.1:{port}",
            "--artifacts",
            str(tmp_path / "artifacts"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**_env(), "MLFLOW_TRACKING_URI": ""},
    )
    assert proc.returncode == 2, proc.stderr
    assert SECRET not in proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("graphtrim: error:"), proc.stderr
    assert f"http://***@127.0.0.1:{port}" in lines[-1]
    assert "Traceback" not in proc.stderr


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}


def _runs(tracking: str, name: str) -> list[dict[str, str]]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking, tracking)
    exp = client.get_experiment_by_name("graphtrim")
    assert exp is not None
    runs = client.search_runs(
        [exp.experiment_id], f"tags.`graphtrim.source.name` = '{name}'", max_results=10
    )
    return [dict(r.data.tags) for r in runs]


@pytest.mark.slow
def test_a_failed_stage_tags_its_run_with_the_error_masked(
    servers: dict[str, str], tmp_path: Path
) -> None:
    """A real export stage on a real MLflow server whose artifact store's endpoint carries a
    password: the stage fails on the store, and the run's ``graphtrim.error`` tag (and the
    error raised) say where, without the password."""
    from graphtrim.integrations.artifacts import ArtifactStoreError
    from graphtrim.stages import pipeline
    from graphtrim.stages.context import PipelineConfig, StageContext

    pytest.importorskip("mlflow")
    name = "redact-export"
    version = register_onnx(
        servers["mlflow"], tiny_onnx(tmp_path / "tiny.onnx"), name, artifact_dir=None
    )
    endpoint = f"http://alice:{SECRET}@127.0.0.1:{free_port()}"
    ctx = StageContext(
        servers["mlflow"],
        f"s3://{BUCKET}/redact",
        workdir=str(tmp_path / "work"),
        s3_endpoint_url=endpoint,
    )
    with pytest.raises(ArtifactStoreError) as raised:
        pipeline.export(ctx, PipelineConfig(variants=("graph",)), f"models:/{name}/{version}")
    assert SECRET not in str(raised.value)
    (tags,) = _runs(servers["mlflow"], name)
    assert tags["graphtrim.failed_stage"] == "export"
    assert "ArtifactStoreError" in tags["graphtrim.error"]
    assert "http://***@127.0.0.1" in tags["graphtrim.error"]
    assert SECRET not in tags["graphtrim.error"]


@pytest.mark.slow
def test_any_stage_error_is_masked_in_the_tag(servers: dict[str, str]) -> None:
    """Whatever a stage raises (here a library's message with a signed URL and a token) is
    masked before it becomes the run's tag."""
    from mlflow import MlflowClient

    from graphtrim.stages import tracking
    from graphtrim.stages.context import StageContext

    client = MlflowClient(servers["mlflow"], servers["mlflow"])
    exp = tracking.experiment_id(client, "redact-stage")
    run_id = client.create_run(exp).info.run_id
    ctx = StageContext(servers["mlflow"], "unused")
    message = (
        f"403 for https://b.s3.amazonaws.com/k?X-Amz-Signature={SECRET}"
        f" (Authorization: Bearer {SECRET}x) via http://bob:{SECRET}@proxy:3128"
    )
    with pytest.raises(RuntimeError), tracking.stage_run(ctx, run_id, "optimize"):
        raise RuntimeError(message)
    tags = client.get_run(run_id).data.tags
    assert tags["graphtrim.failed_stage"] == "optimize"
    assert tags["graphtrim.error"].startswith("RuntimeError: 403 for https://b.s3.amazonaws.com")
    assert SECRET not in tags["graphtrim.error"]
    assert client.get_run(run_id).info.status == "FAILED"
