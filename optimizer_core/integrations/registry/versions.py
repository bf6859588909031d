"""Versions: resolve and download a source, find a variant again by its key, read its
lineage, register it (its ``models:/`` source resolved through this registry's own URI)."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Mapping
from typing import Any

from graphtrim import faults
from graphtrim.integrations.registry.aliases import Aliases
from graphtrim.integrations.registry.base import (
    _INTEGER_METRICS,
    GATES_TAG,
    KEY_TAG,
    LEGACY_METRICS_TAG,
    TAG,
    VARIANT_TAG,
    RegistryError,
    SourceVersion,
    _quote,
    logged_model_id,
    parse_gates,
    parse_models_uri,
)
from graphtrim.redact import redact

_GLOBAL_URI_LOCK = threading.Lock()  # MLflow's process-wide tracking URI, set for one call


class Registry(Aliases):
    """A thin, typed wrapper over ``MlflowClient`` for one tracking URI."""

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
        with self._own_tracking_uri():
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
        if model_id is not None:
            self._link_logged_model(model_id, name, str(mv.version))
        return str(mv.version), True

    @contextlib.contextmanager
    def _own_tracking_uri(self) -> Any:
        """MLflow's database registry store resolves a ``models:/<model_id>`` source through
        the process's tracking URI (a fresh ``MlflowClient()``), not this client's: without
        ``MLFLOW_TRACKING_URI`` that is ``./mlflow.db`` in the working folder. For the call
        inside, the process's URI is this registry's (a tracking server resolves sources
        itself)."""
        if self.tracking_uri.startswith(("http://", "https://")):
            yield
            return
        from mlflow.tracking._tracking_service import utils

        with _GLOBAL_URI_LOCK, utils._use_tracking_uri(self.tracking_uri):
            yield

    def _link_logged_model(self, model_id: str, name: str, version: str) -> None:
        """The logged model's ``mlflow.modelVersions`` tag, MLflow's link from a logged model
        to the versions registered from it (a tracking server sets it itself; a database
        store does not)."""
        from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

        logged = self._call(f"logged model {model_id}", self.client.get_logged_model, model_id)
        raw = dict(logged.tags or {}).get(MLFLOW_MODEL_VERSIONS)
        try:
            links = json.loads(raw) if raw else []
        except ValueError:
            links = []
        links = links if isinstance(links, list) else []
        seen = {(str(e.get("name")), str(e.get("version"))) for e in links if isinstance(e, dict)}
        if (name, version) not in seen:
            links.append({"name": name, "version": version})
            self.client.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(links)})
