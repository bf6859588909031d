"""The MLflow model registry as graphtrim uses it: resolve sources, register variants with
lineage, find them again by lineage, and move aliases with an audit trail.

Every call goes through an ``MlflowClient`` bound to one tracking URI. Errors name what is
missing (model, version, alias) or unreachable (the tracking server) in one line, with any
credential in the URI masked.

Credentials travel with the client, never through the process environment: :func:`mlflow_client`
builds an ``MlflowClient`` whose tracking store, registry store and artifact repositories
(``mlflow-artifacts:`` proxied by the server, ``s3://`` written directly) all use the
:class:`MlflowAuth` (and :class:`~graphtrim.integrations.artifacts.S3Auth`) it was given.
Two clients for two servers in one process (Airflow's triggerer runs every DAG's triggers in one)
each send their own token. Without an ``MlflowAuth`` the client is MLflow's own, reading
``$MLFLOW_TRACKING_TOKEN`` and friends as MLflow documents (the CLI's case).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime as dt
import functools
import getpass
import json
import os
import re
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from graphtrim import faults
from graphtrim.errors import GraphtrimError, transient
from graphtrim.redact import redact, register_secret

if TYPE_CHECKING:
    from graphtrim.integrations.artifacts import S3Auth

TAG = "graphtrim."
KEY_TAG = TAG + "key"
VARIANT_TAG = TAG + "variant"
HISTORY_TAG = TAG + "alias_history."  # registered-model tag, one per alias: JSON list of versions
MOVES_TAG = TAG + "moves."  # registered-model tags ``moves.<alias>.<n>``: every move's audit
# registered-model tag per alias while a move is under way: its audit entry and the history
# it writes, so that a retry finishes that move instead of recording another
PENDING_TAG = TAG + "pending_move."
HOLD_TAG = TAG + "hold."  # registered-model tag per alias: set by a person, kept by the pipeline
TUNE_TAG = TAG + "tune."  # registered-model tag per device and variant: the search's champion
GATES_TAG = TAG + "gates"  # ``serving=pass,size=pass,...``
# a JSON object of the variant's numbers: what versions registered before graphtrim 0.1 carry
# (their numbers now are the linked logged model's metrics); read, never written
LEGACY_METRICS_TAG = TAG + "metrics"
_INTEGER_METRICS = ("bytes", "nodes")

_MODELS_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<version>\d+)|@(?P<alias>[\w.-]+))$")


class RegistryError(GraphtrimError):
    """The registry cannot be reached, or lacks the model, version or alias asked for."""


@dataclasses.dataclass(frozen=True)
class SourceVersion:
    name: str
    version: str
    model_id: str | None
    run_id: str | None
    source: str
    tags: dict[str, str]

    @property
    def uri(self) -> str:
        return f"models:/{self.name}/{self.version}"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def is_graphtrim_output(tags: Mapping[str, str] | None) -> bool:
    """Whether a model version with these tags was registered by graphtrim (a variant of
    another version): triggers and scans skip such versions, or every variant would be
    optimized again as a new source (a feedback loop)."""
    return bool(tags) and (VARIANT_TAG in tags or KEY_TAG in tags)  # type: ignore[operator]


def logged_model_id(mv: Any) -> str | None:
    """The logged model a version was registered from: its ``model_id`` where the client
    fills it in, else its source ``models:/<model_id>`` (MLflow's REST answer carries only
    the source)."""
    if getattr(mv, "model_id", None):
        return str(mv.model_id)
    source = str(getattr(mv, "source", "") or "")
    if source.startswith("models:/m-"):
        return source.removeprefix("models:/").split("/")[0]
    return None


def format_gates(gates: Mapping[str, str]) -> str:
    """Gate verdicts as one short, searchable tag value: ``serving=pass,accuracy=pass``."""
    return ",".join(f"{g}={s}" for g, s in gates.items())


def parse_gates(text: str | None) -> dict[str, str] | None:
    """The verdicts of :func:`format_gates`, or of the JSON object older versions carry;
    None when there is nothing readable."""
    if not text:
        return None
    if text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except ValueError:
            return None
        return {str(k): str(v) for k, v in doc.items()} if isinstance(doc, dict) else None
    pairs = [part.partition("=") for part in text.split(",")]
    if not all(sep and g for g, sep, _ in pairs):
        return None
    return {g.strip(): s.strip() for g, _, s in pairs}


def parse_models_uri(uri: str) -> tuple[str, str | None, str | None]:
    """``models:/NAME/VERSION`` or ``models:/NAME@ALIAS`` -> (name, version, alias)."""
    m = _MODELS_URI.match(uri.strip())
    if not m:
        raise RegistryError(
            f"'{uri}' is not a registry model URI: use models:/NAME/VERSION or models:/NAME@ALIAS"
        )
    return m.group("name"), m.group("version"), m.group("alias")


def _check_reachable(tracking_uri: str, timeout: float = 5.0) -> None:
    if not tracking_uri.startswith(("http://", "https://")):
        return
    import requests

    try:
        requests.get(tracking_uri.rstrip("/") + "/health", timeout=timeout)
    except requests.RequestException as exc:
        raise transient(
            RegistryError(
                "cannot reach the MLflow tracking server at "
                f"{redact(tracking_uri)}: {type(exc).__name__}"
            )
        ) from exc


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


class Registry:
    """A thin, typed wrapper over ``MlflowClient`` for one tracking URI."""

    def __init__(
        self,
        tracking_uri: str | None = None,
        *,
        check: bool = True,
        auth: MlflowAuth | None = None,
        s3: S3Auth | None = None,
    ):
        import mlflow

        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        # a dead server should fail in seconds, not after minutes of client retries
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        self.tracking_uri = tracking_uri or mlflow.get_tracking_uri()
        if check:
            _check_reachable(self.tracking_uri)
        self.client = mlflow_client(self.tracking_uri, auth, s3=s3)
        self._auth = auth
        self._s3 = s3

    @property
    def where(self) -> str:
        """The tracking URI as messages show it (credentials masked)."""
        return redact(self.tracking_uri)

    # ------------------------------------------------------------------ reading

    def _call(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        from mlflow.exceptions import MlflowException

        try:
            return fn(*args, **kw)
        except MlflowException as exc:
            code = getattr(exc, "error_code", "")
            if code in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND") or "not found" in str(exc):
                raise RegistryError(f"{what}: not found in the registry at {self.where}") from exc
            raise transient(
                RegistryError(f"{what}: {redact(str(exc).splitlines()[0])[:300]}")
            ) from exc
        except OSError as exc:
            raise transient(
                RegistryError(f"{what}: cannot reach the registry at {self.where} ({redact(exc)})")
            ) from exc

    def resolve(self, uri: str) -> SourceVersion:
        name, version, alias = parse_models_uri(uri)
        self._call(f"registered model '{name}'", self.client.get_registered_model, name)
        if alias is not None:
            mv = self._call(
                f"alias '{alias}' of registered model '{name}'",
                self.client.get_model_version_by_alias,
                name,
                alias,
            )
        else:
            mv = self._call(
                f"version {version} of registered model '{name}'",
                self.client.get_model_version,
                name,
                str(version),
            )
        model_id = getattr(mv, "model_id", None)
        if not model_id and str(mv.source).startswith("models:/m-"):
            model_id = str(mv.source).removeprefix("models:/").split("/")[0]
        return SourceVersion(
            mv.name,
            str(mv.version),
            model_id,
            mv.run_id,
            mv.source,
            dict(mv.tags or {}),
        )

    def download(self, source: SourceVersion, dest: str) -> str:
        """The version's model files, fetched through this registry's own client. (A
        ``models:/`` URI handed to MLflow's download helper would be resolved against the
        process's default registry, which in a fresh worker is a local SQLite file.)"""
        what = f"artifacts of {source.uri}"
        uri = str(
            self._call(
                what, self.client.get_model_version_download_uri, source.name, source.version
            )
        )
        if uri.startswith("models:/"):  # a logged model (MLflow 3): its artifact location
            model_id = uri.removeprefix("models:/").split("/")[0]
            uri = str(self._call(what, self.client.get_logged_model, model_id).artifact_location)
        return str(self._call(what, self._download, uri, dest))

    def _download(self, uri: str, dest: str) -> str:
        """``uri`` (a folder or file of an artifact store) into ``dest``, through a repository
        that carries this registry's credentials."""
        from mlflow.tracking.artifact_utils import _get_root_uri_and_artifact_path

        root, path = _get_root_uri_and_artifact_path(uri)
        repo = getattr(self.client, "graphtrim_artifact_repo", None)
        if repo is None:  # MLflow's own client: its own resolution, its own credentials
            import mlflow

            return str(
                mlflow.artifacts.download_artifacts(
                    artifact_uri=uri, dst_path=dest, tracking_uri=self.tracking_uri
                )
            )
        os.makedirs(dest, exist_ok=True)
        return str(repo(root).download_artifacts(artifact_path=path, dst_path=dest))

    def find_by_key(self, name: str, key: str) -> Any | None:
        """The version of ``name`` carrying idempotency key ``key``, if one exists."""
        try:
            found = self.client.search_model_versions(
                f"name='{_quote(name)}' and tags.`{KEY_TAG}`='{_quote(key)}'"
            )
        except Exception as exc:
            raise RegistryError(f"searching versions of '{name}': {redact(exc)}") from exc
        versions = sorted(found, key=lambda v: int(v.version))
        return versions[0] if versions else None

    def search_lineage(self, name: str, **tags: str) -> list[Any]:
        parts = [f"name='{_quote(name)}'"]
        parts += [f"tags.`{TAG}{k}`='{_quote(v)}'" for k, v in tags.items()]
        return list(self.client.search_model_versions(" and ".join(parts)))

    def alias_version(self, name: str, alias: str) -> str | None:
        from mlflow.exceptions import MlflowException

        try:
            return str(self.client.get_model_version_by_alias(name, alias).version)
        except MlflowException:
            return None

    def version_tags(self, name: str, version: str) -> dict[str, str]:
        mv = self._call(
            f"version {version} of registered model '{name}'",
            self.client.get_model_version,
            name,
            str(version),
        )
        return dict(mv.tags or {})

    def lineage(self, mv: Any) -> dict[str, Any]:
        """A registered variant's record: its tags, its gate verdicts and its numbers (the
        metrics its logged model carries under ``<variant>.<name>``; for versions registered
        before those existed, the JSON tag they carry instead)."""
        tags = dict(mv.tags or {})
        metrics: dict[str, Any] = {}
        if LEGACY_METRICS_TAG in tags:
            with contextlib.suppress(ValueError):
                doc = json.loads(tags[LEGACY_METRICS_TAG])
                metrics = doc if isinstance(doc, dict) else {}
        elif model_id := logged_model_id(mv):
            try:
                logged = self._call(
                    f"the logged model of version {mv.version} of '{mv.name}'",
                    self.client.get_logged_model,
                    model_id,
                )
            except RegistryError as exc:
                if exc.transient:
                    raise
                logged = None  # deleted: the version has no numbers on record
            prefix = tags.get(VARIANT_TAG, "") + "."
            latest: dict[str, Any] = {}
            for m in getattr(logged, "metrics", None) or []:
                if m.key.startswith(prefix):
                    key = m.key[len(prefix) :]
                    if key not in latest or (m.timestamp, m.step) >= latest[key][0]:
                        latest[key] = ((m.timestamp, m.step), m.value)
            for key, (_, value) in latest.items():
                integral = key in _INTEGER_METRICS and float(value).is_integer()
                metrics[key] = int(value) if integral else float(value)
        return {"tags": tags, "gates": parse_gates(tags.get(GATES_TAG)), "metrics": metrics}

    def version_lineage(self, name: str, version: str) -> dict[str, Any]:
        """:meth:`lineage` of version ``version`` of ``name``."""
        mv = self._call(
            f"version {version} of registered model '{name}'",
            self.client.get_model_version,
            name,
            str(version),
        )
        return self.lineage(mv)

    # ------------------------------------------------------------------ writing

    def ensure_registered_model(self, name: str) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(name)
        except MlflowException:
            try:
                self.client.create_registered_model(name)
            except MlflowException as exc:
                if "already exists" not in str(exc).lower():
                    raise RegistryError(
                        f"creating registered model '{name}': {redact(exc)}"
                    ) from exc

    def register(
        self,
        model_uri: str,
        name: str,
        *,
        tags: Mapping[str, str],
        key: str,
        run_id: str | None = None,
        description: str | None = None,
    ) -> tuple[str, bool]:
        """Register ``model_uri`` (``models:/<model_id>`` of a logged model) as a new version
        of ``name`` unless a version with ``key`` exists; returns (version, created)."""
        existing = self.find_by_key(name, key)
        if existing is not None:
            return str(existing.version), False
        self.ensure_registered_model(name)
        model_id = None
        if model_uri.startswith("models:/m-"):
            model_id = model_uri.removeprefix("models:/").split("/")[0]
        faults.point("register.create_version.before")
        mv = self._call(
            f"registering {model_uri} as '{name}'",
            self.client.create_model_version,
            name,
            model_uri,
            run_id=run_id,
            tags={**tags, KEY_TAG: key},
            model_id=model_id,
            description=description,
            await_creation_for=300,
        )
        faults.point("register.create_version.after")
        # two writers racing past the search both created a version: keep the oldest
        winner = self.find_by_key(name, key)
        if winner is not None and str(winner.version) != str(mv.version):
            self.client.delete_model_version(name, str(mv.version))
            return str(winner.version), False
        return str(mv.version), True

    def _history(self, name: str, alias: str) -> list[str]:
        rm = self.client.get_registered_model(name)
        raw = (rm.tags or {}).get(HISTORY_TAG + alias)
        try:
            return [str(v) for v in json.loads(raw)] if raw else []
        except ValueError:
            return []

    def move_alias(
        self, name: str, alias: str, version: str, *, why: str, who: str | None = None
    ) -> str | None:
        """Point ``alias`` at ``version``; returns the version it left (None if new). The
        registered model keeps the alias's history (for rollback); both versions get audit tags.
        A move stopped half way (the process killed, the server gone after the alias moved) is
        completed by the next call for the alias (:meth:`complete_move`), never recorded twice."""
        done = self.complete_move(name, alias)
        previous = self.alias_version(name, alias)
        if previous == str(version):
            return done["from"] if done is not None and done["to"] == str(version) else previous
        audit = _audit("promote", alias, previous, str(version), why, who)
        history = self._history(name, alias) + ([previous] if previous is not None else [])
        pending = {"audit": json.loads(audit), "history": history[-50:]}
        # the intent first: what the rest of the move writes, so that a retry writes the same
        self.client.set_registered_model_tag(name, PENDING_TAG + alias, json.dumps(pending))
        faults.point("promote.alias.before")
        self._call(
            f"setting alias '{alias}' of '{name}'",
            self.client.set_registered_model_alias,
            name,
            alias,
            str(version),
        )
        faults.point("promote.alias.after")
        self._finish_move(name, alias, pending)
        return previous

    def complete_move(self, name: str, alias: str) -> dict[str, Any] | None:
        """Finish a move of ``alias`` an earlier call left half done (its history and audit
        tags, each written once) and return its audit entry; a move that never reached the
        alias is dropped. None when there was none."""
        try:
            rm = self._call(f"registered model '{name}'", self.client.get_registered_model, name)
        except RegistryError as exc:
            if exc.transient:
                raise
            return None  # no such model yet: nothing was moved
        raw = (rm.tags or {}).get(PENDING_TAG + alias)
        if not raw:
            return None
        try:
            pending = json.loads(raw)
            entry = dict(pending["audit"])
        except (ValueError, KeyError, TypeError):
            pending, entry = None, None
        aliases = dict(getattr(rm, "aliases", None) or {})
        if entry is None or str(aliases.get(alias)) != str(entry.get("to")):
            self.client.delete_registered_model_tag(name, PENDING_TAG + alias)
            return None
        self._finish_move(name, alias, pending)
        return entry

    def _finish_move(self, name: str, alias: str, pending: dict[str, Any]) -> None:
        """The writes after an alias moved: its history, the move's record and audit tags
        (none twice), then the pending-move tag removed."""
        entry = pending["audit"]
        self.client.set_registered_model_tag(
            name, HISTORY_TAG + alias, json.dumps(pending["history"])
        )
        faults.point("promote.history.after")
        versions = [str(entry["to"]), *([str(entry["from"])] if entry["from"] else [])]
        self._record_move(name, alias, json.dumps(entry), versions)
        self.client.delete_registered_model_tag(name, PENDING_TAG + alias)

    def _record_move(self, name: str, alias: str, audit: str, versions: list[str]) -> None:
        """Keep the move: a numbered registered-model tag per move (the full history), and on
        each version involved the list of moves that touched it."""
        rm = self.client.get_registered_model(name)
        prefix = f"{MOVES_TAG}{alias}."
        entry = json.loads(audit)
        recorded = [k for k, v in (rm.tags or {}).items() if k.startswith(prefix)]
        if not any(_same_move(rm.tags[k], entry) for k in recorded):  # not a retry's
            n = 1 + len(recorded)
            self.client.set_registered_model_tag(name, f"{prefix}{n:05d}", audit)
        for version in versions:
            key = f"{TAG}audit.{alias}"
            try:
                raw = dict(self.client.get_model_version(name, version).tags or {}).get(key)
                past = json.loads(raw) if raw else []
            except (ValueError, TypeError):
                past = []
            past = past if isinstance(past, list) else [past]  # one entry before lists
            if entry in past:  # recorded by an attempt that stopped after it
                continue
            past.append(entry)
            text = json.dumps(past)
            while len(text) > 7500 and len(past) > 1:  # the tag's limit; moves.* keeps all
                past.pop(0)
                text = json.dumps(past)
            self.client.set_model_version_tag(name, version, key, text)

    def moves(self, name: str, alias: str) -> list[dict[str, Any]]:
        """Every recorded move of ``alias``, oldest first."""
        rm = self.client.get_registered_model(name)
        prefix = f"{MOVES_TAG}{alias}."
        found = sorted((k, v) for k, v in (rm.tags or {}).items() if k.startswith(prefix))
        return [json.loads(v) for _, v in found]

    # ------------------------------------------------------------------ holds

    def hold(self, name: str, alias: str) -> dict[str, Any] | None:
        """The hold a person put on ``alias`` (by ``promote`` or ``rollback``), if any."""
        rm = self._call(f"registered model '{name}'", self.client.get_registered_model, name)
        raw = (rm.tags or {}).get(HOLD_TAG + alias)
        try:
            doc = json.loads(raw) if raw else None
        except ValueError:
            return None
        return doc if isinstance(doc, dict) else None

    def set_hold(
        self, name: str, alias: str, version: str, *, why: str, who: str | None = None
    ) -> dict[str, Any]:
        """Hold ``alias`` on ``version``: the pipeline leaves it there until a source version
        newer than the newest one registered now arrives (or it is forced)."""
        sources = [
            int(v.version)
            for v in self.client.search_model_versions(f"name='{_quote(name)}'")
            if not is_graphtrim_output(dict(v.tags or {}))
        ]
        tags = self.version_tags(name, version)
        of = tags.get(TAG + "source.version")
        newest = max([*sources, *([int(of)] if of and of.isdigit() else [])], default=None)
        doc = json.loads(_audit("hold", alias, None, str(version), why, who))
        doc.update(
            version=str(version),
            source_name=tags.get(TAG + "source.name") or name,
            since_source=str(newest) if newest is not None else None,
        )
        self.client.set_registered_model_tag(name, HOLD_TAG + alias, json.dumps(doc))
        return doc

    def release_hold(self, name: str, alias: str) -> None:
        from mlflow.exceptions import MlflowException

        with contextlib.suppress(MlflowException):
            self.client.delete_registered_model_tag(name, HOLD_TAG + alias)

    def rollback(
        self, name: str, alias: str, *, why: str, who: str | None = None
    ) -> tuple[str, str]:
        """Move ``alias`` back to the version it pointed at before; returns (from, to)."""
        current = self.alias_version(name, alias)
        if current is None:
            raise RegistryError(f"registered model '{name}' has no alias '{alias}' to roll back")
        history = self._history(name, alias)
        while history and history[-1] == current:
            history.pop()
        if not history:
            raise RegistryError(
                f"alias '{alias}' of '{name}' has no earlier version on record to roll back to"
            )
        target = history.pop()
        self._call(
            f"setting alias '{alias}' of '{name}'",
            self.client.set_registered_model_alias,
            name,
            alias,
            target,
        )
        self.client.set_registered_model_tag(name, HISTORY_TAG + alias, json.dumps(history))
        audit = _audit("rollback", alias, current, target, why, who)
        self._record_move(name, alias, audit, [target, current])
        return current, target


def _audit(action: str, alias: str, old: str | None, new: str, why: str, who: str | None) -> str:
    try:
        user = who or getpass.getuser()
    except Exception:  # no user database entry (containers)
        user = who or "unknown"
    return json.dumps(
        {
            "action": action,
            "alias": alias,
            "from": old,
            "to": new,
            "who": user,
            "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "why": why,
        }
    )


def _same_move(raw: str, entry: Mapping[str, Any]) -> bool:
    try:
        return bool(json.loads(raw) == entry)
    except ValueError:
        return False


def _quote(value: str) -> str:
    return str(value).replace("'", "\\'")


class RegistryTuneMemory:
    """The settings search's memory (:mod:`graphtrim.tune.memory`) on a registered model: a
    tag per device and scope (``graphtrim.tune.cpu.int8-static``: the kinds searched) holding
    the champion of the newest search and the graph signature it was found for. A version with
    another signature starts afresh."""

    LIMIT = 7500  # characters of a tag value kept; the nodes kept in float go first beyond it

    def __init__(self, registry: Registry, name: str, *, scope: str | None = None) -> None:
        self.registry, self.name, self.scope = registry, name, scope

    def _tag(self, device: str) -> str:
        return TUNE_TAG + device + (f".{self.scope}" if self.scope else "")

    def recall(self, signature: str, device: str) -> dict[str, Any] | None:
        rm = self.registry._call(
            f"registered model '{self.name}'", self.registry.client.get_registered_model, self.name
        )
        raw = (rm.tags or {}).get(self._tag(device))
        try:
            doc = json.loads(raw) if raw else None
        except ValueError:
            return None
        if not isinstance(doc, dict) or doc.get("signature") != signature:
            return None
        entry = doc.get("entry")
        return dict(entry) if isinstance(entry, dict) else None

    def remember(self, signature: str, device: str, entry: Mapping[str, Any]) -> None:
        from graphtrim.tune.memory import stamp

        body = stamp(entry)
        text = json.dumps({"signature": signature, "entry": body}, sort_keys=True)
        if len(text) > self.LIMIT:
            body = {**body, "excluded": [], "excluded_dropped": len(body.get("excluded") or [])}
            text = json.dumps({"signature": signature, "entry": body}, sort_keys=True)
        self.registry._call(
            f"registered model '{self.name}'",
            self.registry.client.set_registered_model_tag,
            self.name,
            self._tag(device),
            text,
        )

    def describe(self) -> str:
        return f"tag {self._tag('<device>')} of registered model '{self.name}' at {self.registry.where}"
