"""Connections to the MLflow registry and the S3 artifact store, as ``optimizer_core`` wants them.

- MLflow: a ``graphtrim_mlflow`` connection (default id ``mlflow_default``). The host holds the
  tracking URI (``http://mlflow:5000``; ``sqlite:////path/mlflow.db`` works too), the password an
  optional bearer token. Without the connection, ``$MLFLOW_TRACKING_URI`` is used.
- S3: the standard ``aws`` connection (default id ``aws_default``): login / password are the
  access key pair, ``extra.endpoint_url`` (or ``extra.service_config.s3.endpoint_url``) an
  S3-compatible endpoint, ``extra.region_name`` the region. Without it, boto3's own chain.
"""

from __future__ import annotations

import os
from typing import Any

from airflow.sdk import BaseHook

from optimizer_core.errors import GraphtrimError


def _connection(conn_id: str | None) -> Any | None:
    if not conn_id:
        return None
    try:
        return BaseHook.get_connection(conn_id)
    except Exception:  # AirflowNotFoundException and the task SDK's own variant
        return None


class MlflowRegistryHook(BaseHook):
    """The MLflow tracking server / registry of a connection."""

    conn_name_attr = "mlflow_conn_id"
    default_conn_name = "mlflow_default"
    conn_type = "graphtrim_mlflow"
    hook_name = "MLflow (graphtrim)"

    def __init__(self, mlflow_conn_id: str = default_conn_name, **kwargs: Any):
        super().__init__(**kwargs)
        self.mlflow_conn_id = mlflow_conn_id

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        return {
            "hidden_fields": ["schema", "login", "extra"],
            "relabeling": {"host": "Tracking URI", "password": "Token"},
            "placeholders": {"host": "http://mlflow:5000"},
        }

    def tracking_uri(self) -> str:
        """The tracking URI; a token in the connection is exported for MLflow's client."""
        conn = _connection(self.mlflow_conn_id)
        if conn is None:
            env = os.environ.get("MLFLOW_TRACKING_URI")
            if env:
                return env
            raise GraphtrimError(
                f"no Airflow connection '{self.mlflow_conn_id}' and no $MLFLOW_TRACKING_URI: "
                "add a graphtrim_mlflow connection whose host is the tracking URI"
            )
        host = conn.host or ""
        if "://" not in host:
            scheme = conn.schema or "http"
            host = f"{scheme}://{host}" + (f":{conn.port}" if conn.port else "")
        elif conn.port and host.startswith("http") and host.count(":") == 1:
            host = f"{host}:{conn.port}"
        if conn.password:
            os.environ["MLFLOW_TRACKING_TOKEN"] = conn.password
        return host


class ArtifactStoreHook(BaseHook):
    """S3 credentials and endpoint from a standard ``aws`` connection."""

    conn_name_attr = "aws_conn_id"
    default_conn_name = "aws_default"
    conn_type = "aws"
    hook_name = "Amazon Web Services (graphtrim artifacts)"

    def __init__(self, aws_conn_id: str | None = default_conn_name, **kwargs: Any):
        super().__init__(**kwargs)
        self.aws_conn_id = aws_conn_id

    def endpoint_url(self) -> str | None:
        """Exports the connection's credentials for boto3; returns its endpoint, if any."""
        conn = _connection(self.aws_conn_id)
        if conn is None:
            return os.environ.get("AWS_ENDPOINT_URL_S3")
        extra = conn.extra_dejson or {}
        if conn.login:
            os.environ["AWS_ACCESS_KEY_ID"] = conn.login
        if conn.password:
            os.environ["AWS_SECRET_ACCESS_KEY"] = conn.password
        region = extra.get("region_name")
        if region:
            os.environ.setdefault("AWS_DEFAULT_REGION", region)
        s3 = (extra.get("service_config") or {}).get("s3") or {}
        url = extra.get("endpoint_url") or s3.get("endpoint_url")
        return str(url) if url else None
