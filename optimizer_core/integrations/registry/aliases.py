"""Alias moves with an audit trail, their history (for rollback) and the holds a person puts
on an alias."""

from __future__ import annotations

import contextlib
import datetime as dt
import getpass
import json
from typing import Any

from graphtrim.integrations.registry.base import (
    HISTORY_TAG,
    HOLD_TAG,
    MOVES_TAG,
    TAG,
    RegistryBase,
    RegistryError,
    _quote,
    is_graphtrim_output,
)


class Aliases(RegistryBase):
    """Moving a registered model's aliases, with the audit tags and the history kept."""

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
