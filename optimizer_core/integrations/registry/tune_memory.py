"""The settings search's memory kept on a registered model."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from graphtrim.integrations.registry.base import TUNE_TAG
from graphtrim.integrations.registry.versions import Registry


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
