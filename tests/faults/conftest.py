from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import BUCKET
from tests.faults.harness import MlflowProcess, PgCluster, Proxy


@dataclass
class FaultEnv:
    """The components of the fault suite, started once per test module."""

    pg: PgCluster
    mlflow: MlflowProcess
    mlflow_proxy: Proxy  # what the stages talk to
    s3: str  # moto itself (for checks)
    s3_proxy: Proxy  # what the stages talk to
    root: Path
    source: str  # models:/NAME/VERSION of the source model


@pytest.fixture(scope="module")
def fault_env(tmp_path_factory: pytest.TempPathFactory, digits_task: object) -> Iterator[FaultEnv]:
    import boto3

    from tests.servers import fake_aws_credentials, moto_server, register_onnx

    root = tmp_path_factory.mktemp("faults")
    pg = PgCluster()
    pg.start()
    try:
        backend = pg.create_database("mlflow")
        mlflow = MlflowProcess(root / "mlflow", backend)
        try:
            mlflow.start()
            with (
                fake_aws_credentials(),
                moto_server(root / "s3") as s3,
                Proxy(mlflow.url).running() as mlflow_proxy,
                Proxy(s3).running() as s3_proxy,
            ):
                boto3.client("s3", endpoint_url=s3).create_bucket(Bucket=BUCKET)
                register_onnx(mlflow.url, digits_task.model, "digits")  # type: ignore[attr-defined]
                yield FaultEnv(pg, mlflow, mlflow_proxy, s3, s3_proxy, root, "models:/digits/1")
        finally:
            mlflow.stop()
    finally:
        pg.stop()
