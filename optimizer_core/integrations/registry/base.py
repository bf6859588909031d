"""The registry's names (tags, errors, ``models:/`` URIs) and :class:`RegistryBase`: one
tracking URI's client and the one-line errors every call of it raises."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from graphtrim.errors import GraphtrimError, transient
from graphtrim.integrations.registry.client import mlflow_client
from graphtrim.redact import redact

if TYPE_CHECKING:
    from graphtrim.integrations.artifacts import S3Auth
    from graphtrim.integrations.registry.client import MlflowAuth

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


def _quote(value: str) -> str:
    return str(value).replace("'", "\\'")


class RegistryBase:
    """One tracking URI's ``MlflowClient``, and its calls with one-line errors."""

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

    def alias_version(self, name: str, alias: str) -> str | None:
        """The version ``alias`` points at; None when the model or the alias does not exist.
        A registry that cannot answer is an error (worth a retry), never "no alias"."""
        try:
            found = self._call(
                f"alias '{alias}' of registered model '{name}'",
                self.client.get_model_version_by_alias,
                name,
                alias,
            )
        except RegistryError as exc:
            if exc.transient:
                raise
            return None
        return str(found.version)

    def version_tags(self, name: str, version: str) -> dict[str, str]:
        mv = self._call(
            f"version {version} of registered model '{name}'",
            self.client.get_model_version,
            name,
            str(version),
        )
        return dict(mv.tags or {})
