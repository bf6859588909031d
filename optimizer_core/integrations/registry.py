"""The MLflow model registry as graphtrim uses it: resolve sources, register variants with
lineage, find them again by lineage, and move aliases with an audit trail.

Every call goes through an ``MlflowClient`` bound to one tracking URI. Errors name what is
missing (model, version, alias) or unreachable (the tracking server) in one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import getpass
import json
import os
import re
from collections.abc import Mapping
from typing import Any

from optimizer_core.errors import GraphtrimError, transient

TAG = "graphtrim."
KEY_TAG = TAG + "key"
VARIANT_TAG = TAG + "variant"
HISTORY_TAG = TAG + "alias_history."  # registered-model tag, one per alias: JSON list of versions
MOVES_TAG = TAG + "moves."  # registered-model tags ``moves.<alias>.<n>``: every move's audit
HOLD_TAG = TAG + "hold."  # registered-model tag per alias: set by a person, kept by the pipeline

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
                f"cannot reach the MLflow tracking server at {tracking_uri}: {type(exc).__name__}"
            )
        ) from exc


class Registry:
    """A thin, typed wrapper over ``MlflowClient`` for one tracking URI."""

    def __init__(self, tracking_uri: str | None = None, *, check: bool = True):
        import mlflow
        from mlflow import MlflowClient

        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        # a dead server should fail in seconds, not after minutes of client retries
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        self.tracking_uri = tracking_uri or mlflow.get_tracking_uri()
        if check:
            _check_reachable(self.tracking_uri)
        self.client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)

    # ------------------------------------------------------------------ reading

    def _call(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        from mlflow.exceptions import MlflowException

        try:
            return fn(*args, **kw)
        except MlflowException as exc:
            code = getattr(exc, "error_code", "")
            if code in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND") or "not found" in str(exc):
                raise RegistryError(
                    f"{what}: not found in the registry at {self.tracking_uri}"
                ) from exc
            raise transient(RegistryError(f"{what}: {str(exc).splitlines()[0][:300]}")) from exc
        except OSError as exc:
            raise transient(
                RegistryError(f"{what}: cannot reach the registry at {self.tracking_uri} ({exc})")
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
        import mlflow

        what = f"artifacts of {source.uri}"
        uri = str(
            self._call(
                what, self.client.get_model_version_download_uri, source.name, source.version
            )
        )
        if uri.startswith("models:/"):  # a logged model (MLflow 3): its artifact location
            model_id = uri.removeprefix("models:/").split("/")[0]
            uri = str(self._call(what, self.client.get_logged_model, model_id).artifact_location)
        return str(
            self._call(
                what,
                mlflow.artifacts.download_artifacts,
                artifact_uri=uri,
                dst_path=dest,
                tracking_uri=self.tracking_uri,
            )
        )

    def find_by_key(self, name: str, key: str) -> Any | None:
        """The version of ``name`` carrying idempotency key ``key``, if one exists."""
        try:
            found = self.client.search_model_versions(
                f"name='{_quote(name)}' and tags.`{KEY_TAG}`='{_quote(key)}'"
            )
        except Exception as exc:
            raise RegistryError(f"searching versions of '{name}': {exc}") from exc
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
                    raise RegistryError(f"creating registered model '{name}': {exc}") from exc

    def register(
        self,
        model_uri: str,
        name: str,
        *,
        tags: Mapping[str, str],
        key: str,
        run_id: str | None = None,
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
        mv = self._call(
            f"registering {model_uri} as '{name}'",
            self.client.create_model_version,
            name,
            model_uri,
            run_id=run_id,
            tags={**tags, KEY_TAG: key},
            model_id=model_id,
            await_creation_for=300,
        )
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
        registered model keeps the alias's history (for rollback); both versions get audit tags."""
        previous = self.alias_version(name, alias)
        if previous == str(version):
            return previous
        self._call(
            f"setting alias '{alias}' of '{name}'",
            self.client.set_registered_model_alias,
            name,
            alias,
            str(version),
        )
        history = self._history(name, alias)
        if previous is not None:
            history.append(previous)
        self.client.set_registered_model_tag(name, HISTORY_TAG + alias, json.dumps(history[-50:]))
        audit = _audit("promote", alias, previous, str(version), why, who)
        self._record_move(name, alias, audit, [str(version), *([previous] if previous else [])])
        return previous

    def _record_move(self, name: str, alias: str, audit: str, versions: list[str]) -> None:
        """Keep the move: a numbered registered-model tag per move (the full history), and on
        each version involved the list of moves that touched it."""
        rm = self.client.get_registered_model(name)
        prefix = f"{MOVES_TAG}{alias}."
        n = 1 + sum(1 for k in (rm.tags or {}) if k.startswith(prefix))
        self.client.set_registered_model_tag(name, f"{prefix}{n:05d}", audit)
        entry = json.loads(audit)
        for version in versions:
            key = f"{TAG}audit.{alias}"
            try:
                raw = dict(self.client.get_model_version(name, version).tags or {}).get(key)
                past = json.loads(raw) if raw else []
            except (ValueError, TypeError):
                past = []
            past = past if isinstance(past, list) else [past]  # one entry before lists
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


def _quote(value: str) -> str:
    return str(value).replace("'", "\\'")
