"""Credentials per client: an ``MlflowClient`` whose tracking store, registry store and
artifact repositories all use the credentials it was given, never the process environment."""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import threading
from typing import TYPE_CHECKING, Any

from graphtrim.redact import register_secret

if TYPE_CHECKING:
    from graphtrim.integrations.artifacts import S3Auth


# ------------------------------------------------------------------ credentials per client


@dataclasses.dataclass(frozen=True)
class MlflowAuth:
    """How one client authenticates to its tracking server: a bearer ``token``, or basic
    ``username`` / ``password``. Never printed (``repr`` hides the secrets) and never written to
    the process environment."""

    token: str | None = dataclasses.field(default=None, repr=False)
    username: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        register_secret(self.token)
        register_secret(self.password)

    def __bool__(self) -> bool:
        return bool(self.token or self.username or self.password)


def split_userinfo(uri: str) -> tuple[str, MlflowAuth | None]:
    """``http://user:pass@host`` -> (``http://host``, basic auth); other URIs unchanged. The
    password is registered for redaction either way."""
    from urllib.parse import unquote, urlsplit, urlunsplit

    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or "@" not in parts.netloc:
        return uri, None
    userinfo, _, host = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    auth = MlflowAuth(username=unquote(user) or None, password=unquote(password) or None)
    return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment)), auth


def _host_creds(uri: str, auth: MlflowAuth) -> Any:
    """MLflow's host credentials for ``uri`` with this client's secrets. TLS settings (CA
    bundle, client certificate) still come from MLflow's configuration: they are not secrets
    and belong to the machine, not to a connection."""
    from mlflow.utils.credentials import get_default_host_creds

    creds = get_default_host_creds(uri)
    creds.token = auth.token
    creds.username = auth.username
    creds.password = auth.password
    return creds


# the credentials of the artifact repository whose method runs in this context: MLflow's HTTP
# artifact repository looks up credentials with a module-level function in a few methods
# (listing, multipart uploads), which :func:`_install_creds_lookup` routes through here
_REPO_CREDS: contextvars.ContextVar[Any] = contextvars.ContextVar("graphtrim_repo_creds")
_install_lock = threading.Lock()
_installed = False


def _install_creds_lookup() -> None:
    """Route the module-level credential look-ups of MLflow's HTTP artifact repositories
    through :data:`_REPO_CREDS`; with nothing set there (every client but graphtrim's
    authenticated ones) they behave exactly as before."""
    global _installed
    with _install_lock:
        if _installed:
            return
        from mlflow.store.artifact import http_artifact_repo, mlflow_artifacts_repo

        for module in (http_artifact_repo, mlflow_artifacts_repo):
            original = module.get_default_host_creds

            def lookup(uri: str, _original: Any = original) -> Any:
                creds_for = _REPO_CREDS.get(None)
                return creds_for(uri) if creds_for is not None else _original(uri)

            module.get_default_host_creds = lookup  # type: ignore[attr-defined]
        _installed = True


# the methods of MLflow's HTTP artifact repository that look credentials up themselves
_LOOKUP_METHODS = (
    "list_artifacts",
    "create_multipart_upload",
    "complete_multipart_upload",
    "abort_multipart_upload",
    "_get_presigned_download_url",
)


def _artifact_repo(uri: str, tracking_uri: str, auth: MlflowAuth | None, s3: S3Auth | None) -> Any:
    """An artifact repository for ``uri`` that uses this client's credentials: the tracking
    server's (``mlflow-artifacts:``, ``http(s)://``) or the S3 connection's (``s3://``)."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    if auth and uri.startswith(("mlflow-artifacts:", "http://", "https://")):
        from mlflow.store.artifact.http_artifact_repo import HttpArtifactRepository
        from mlflow.store.artifact.mlflow_artifacts_repo import MlflowArtifactsRepository

        _install_creds_lookup()
        base: type = (
            MlflowArtifactsRepository
            if uri.startswith("mlflow-artifacts:")
            else HttpArtifactRepository
        )
        creds_for = functools.partial(_host_creds, auth=auth)

        def with_creds(name: str) -> Any:
            method = getattr(base, name)

            def call(self: Any, *args: Any, **kw: Any) -> Any:
                token = _REPO_CREDS.set(creds_for)
                try:
                    return method(self, *args, **kw)
                finally:
                    _REPO_CREDS.reset(token)

            return call

        body: dict[str, Any] = {n: with_creds(n) for n in _LOOKUP_METHODS if hasattr(base, n)}
        body["_host_creds"] = property(lambda self: creds_for(self.artifact_uri))
        body["_artifact_server_host_creds"] = property(
            lambda self: creds_for(self.artifact_uri.partition("/api/2.0/mlflow-artifacts")[0])
        )
        repo_class = type(f"Authenticated{base.__name__}", (base,), body)
        return repo_class(uri, tracking_uri=tracking_uri)
    if s3 is not None and uri.startswith("s3://"):
        from mlflow.store.artifact.s3_artifact_repo import S3ArtifactRepository, _get_s3_client

        conn = s3

        class _S3Repo(S3ArtifactRepository):  # type: ignore[misc]
            def _get_s3_client(self) -> Any:  # MLflow's own reads the endpoint from the env
                return _get_s3_client(
                    access_key_id=conn.access_key_id,
                    secret_access_key=conn.secret_access_key,
                    session_token=conn.session_token,
                    region_name=conn.region_name,
                    s3_endpoint_url=conn.endpoint_url,
                )

        return _S3Repo(
            uri,
            access_key_id=s3.access_key_id,
            secret_access_key=s3.secret_access_key,
            session_token=s3.session_token,
            tracking_uri=tracking_uri,
        )
    return get_artifact_repository(uri, tracking_uri=tracking_uri)


def mlflow_client(
    tracking_uri: str, auth: MlflowAuth | None = None, *, s3: S3Auth | None = None
) -> Any:
    """An ``MlflowClient`` for ``tracking_uri`` (registry on the same URI) that authenticates
    with ``auth`` and writes S3 artifacts with ``s3``; both stay inside this client. User and
    password in an ``http(s)`` URI become its basic auth (unless ``auth`` is given). With
    neither, MLflow's own client (credentials from MLflow's environment variables)."""
    from mlflow import MlflowClient

    uri, from_uri = split_userinfo(tracking_uri)
    auth = auth or from_uri
    if not auth and s3 is None:
        return MlflowClient(tracking_uri=uri, registry_uri=uri)
    from mlflow.tracking._model_registry.client import ModelRegistryClient
    from mlflow.tracking._tracking_service.client import TrackingServiceClient

    rest = auth is not None and bool(auth) and uri.startswith(("http://", "https://"))
    creds = functools.partial(_host_creds, uri, auth) if rest and auth is not None else None

    class _Tracking(TrackingServiceClient):  # type: ignore[misc]
        def __init__(self) -> None:
            self._repos: dict[str, Any] = {}
            self._rest: Any = None
            if creds is not None:
                from mlflow.store.tracking.rest_store import RestStore

                self._rest = RestStore(creds)
            super().__init__(uri)

        @property
        def store(self) -> Any:
            return self._rest if self._rest is not None else super().store

        def _get_artifact_repo(self, resource_id: str, *, resource: str = "run") -> Any:
            # the repository of a run or logged model: MLflow's process-wide cache of these
            # would hand one client's repository (and its credentials) to another
            if resource_id not in self._repos:
                if resource == "run":
                    location = self.get_run(resource_id).info.artifact_uri
                else:
                    location = self.get_logged_model(resource_id).artifact_location
                self._repos[resource_id] = _artifact_repo(
                    str(location), uri, auth if rest else None, s3
                )
            return self._repos[resource_id]

    class _Registry(ModelRegistryClient):  # type: ignore[misc]
        def __init__(self) -> None:
            self._rest: Any = None
            if creds is not None:
                from mlflow.store.model_registry.rest_store import RestStore

                self._rest = RestStore(creds)
            super().__init__(uri, uri)

        @property
        def store(self) -> Any:
            return self._rest if self._rest is not None else super().store

    client: Any = MlflowClient(tracking_uri=uri, registry_uri=uri)
    client._tracking_client = _Tracking()
    client._registry_client_lazy = _Registry()
    client.graphtrim_artifact_repo = functools.partial(
        _artifact_repo, tracking_uri=uri, auth=auth if rest else None, s3=s3
    )
    return client
