"""Connections to the MLflow registry and the S3 artifact store, as ``optimizer_core`` wants them.

- MLflow: a ``graphtrim_mlflow`` connection (default id ``mlflow_default``). The host holds the
  tracking URI (``http://mlflow:5000``; ``sqlite:////path/mlflow.db`` works too), the password an
  optional bearer token (or login / password: basic auth). Without the connection,
  ``$MLFLOW_TRACKING_URI`` (and MLflow's own ``$MLFLOW_TRACKING_TOKEN``) are used.
- S3: the standard ``aws`` connection (default id ``aws_default``): login / password are the
  access key pair, ``extra.endpoint_url`` (or ``extra.service_config.s3.endpoint_url``) an
  S3-compatible endpoint, ``extra.region_name`` the region. Without it, boto3's own chain.

Credentials go to the clients built from a connection (:meth:`MlflowRegistryHook.get_client`,
:meth:`MlflowRegistryHook.auth`, :meth:`ArtifactStoreHook.auth`), never into ``os.environ``: a
later task or trigger in the same process (the triggerer runs every DAG's triggers in one)
would send them to another connection's server.
"""

from __future__ import annotations

import os
from typing import Any

from airflow.sdk import BaseHook
from graphtrim.errors import GraphtrimError
from graphtrim.integrations.artifacts import S3Auth
from graphtrim.integrations.registry import MlflowAuth, mlflow_client


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
            "hidden_fields": ["schema", "login"],
            "relabeling": {"host": "Tracking URI", "password": "Token"},
            "placeholders": {
                "host": "http://mlflow:5000",
                "extra": '{"ui_url": "https://mlflow.example.com"}',
            },
        }

    def ui_url(self) -> str | None:
        """The address of MLflow's UI that task links point at: the connection's extra
        ``ui_url``, else ``$GRAPHTRIM_MLFLOW_UI_URL``, else the tracking URI of a server."""
        from graphtrim.integrations.links import ui_base

        conn = _connection(self.mlflow_conn_id)
        override = (conn.extra_dejson or {}).get("ui_url") if conn is not None else None
        try:
            tracking = self.tracking_uri()
        except GraphtrimError:
            tracking = None
        return ui_base(tracking, override)

    def tracking_uri(self) -> str:
        """The tracking URI (credentials are in :meth:`auth`)."""
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
        return host

    def auth(self) -> MlflowAuth | None:
        """The connection's credentials: the password is a bearer token, or with a login the
        basic-auth password. None without a connection (MLflow's own environment applies)."""
        conn = _connection(self.mlflow_conn_id)
        if conn is None or not (conn.password or conn.login):
            return None
        if conn.login:
            return MlflowAuth(username=conn.login, password=conn.password or None)
        return MlflowAuth(token=conn.password)

    def get_client(self) -> Any:
        """An ``MlflowClient`` for this connection, with its credentials and no one else's."""
        return mlflow_client(self.tracking_uri(), self.auth())


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
        """The connection's S3 endpoint, if any (credentials are in :meth:`auth`)."""
        conn = _connection(self.aws_conn_id)
        if conn is None:
            return os.environ.get("AWS_ENDPOINT_URL_S3")
        extra = conn.extra_dejson or {}
        s3 = (extra.get("service_config") or {}).get("s3") or {}
        url = extra.get("endpoint_url") or s3.get("endpoint_url")
        return str(url) if url else None

    def auth(self) -> S3Auth | None:
        """The connection's key pair, region and endpoint for a boto3 session of its own;
        None without a connection (boto3's own chain applies)."""
        conn = _connection(self.aws_conn_id)
        if conn is None:
            return None
        extra = conn.extra_dejson or {}
        return S3Auth(
            access_key_id=conn.login or None,
            secret_access_key=conn.password or None,
            session_token=extra.get("aws_session_token") or None,
            region_name=extra.get("region_name") or None,
            endpoint_url=self.endpoint_url(),
        )
