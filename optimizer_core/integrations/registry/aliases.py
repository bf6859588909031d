"""Alias moves with an audit trail, their history (for rollback) and the holds a person puts
on an alias."""

from __future__ import annotations

import datetime as dt
import getpass
import json
from collections.abc import Mapping
from typing import Any

from graphtrim import faults
from graphtrim.integrations.registry.base import (
    HISTORY_TAG,
    HOLD_TAG,
    MOVES_TAG,
    PENDING_TAG,
    TAG,
    RegistryBase,
    RegistryError,
    _quote,
    is_graphtrim_output,
)


class Aliases(RegistryBase):
    """Moving a registered model's aliases, with the audit tags and the history kept."""

    def _history(self, name: str, alias: str) -> list[str]:
        rm = self._call(f"registered model '{name}'", self.client.get_registered_model, name)
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
        self._move(name, alias, str(version), pending, "promote")
        return previous

    def _move(
        self, name: str, alias: str, version: str, pending: dict[str, Any], kind: str
    ) -> None:
        """Point ``alias`` at ``version`` as ``pending`` records: the intent first (what the
        rest of the move writes, so that a retry writes the same), then the alias, then its
        history and audit (:meth:`_finish_move`)."""
        self._set_tag(name, PENDING_TAG + alias, json.dumps(pending))
        faults.point(f"{kind}.alias.before")
        self._call(
            f"setting alias '{alias}' of '{name}'",
            self.client.set_registered_model_alias,
            name,
            alias,
            version,
        )
        faults.point(f"{kind}.alias.after")
        self._finish_move(name, alias, pending)

    def _set_tag(self, name: str, key: str, value: str) -> None:
        self._call(
            f"tag '{key}' of '{name}'", self.client.set_registered_model_tag, name, key, value
        )

    def _delete_tag(self, name: str, key: str) -> None:
        try:
            self._call(
                f"tag '{key}' of '{name}'", self.client.delete_registered_model_tag, name, key
            )
        except RegistryError as exc:
            if exc.transient:
                raise  # gone already otherwise: what a retry of a delete finds

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
            self._delete_tag(name, PENDING_TAG + alias)
            return None
        self._finish_move(name, alias, pending)
        return entry

    def _finish_move(self, name: str, alias: str, pending: dict[str, Any]) -> None:
        """The writes after an alias moved: its history, the move's record and audit tags
        (none twice), then the pending-move tag removed."""
        entry = pending["audit"]
        self._set_tag(name, HISTORY_TAG + alias, json.dumps(pending["history"]))
        faults.point(
            ("rollback" if entry.get("action") == "rollback" else "promote") + ".history.after"
        )
        versions = [str(entry["to"]), *([str(entry["from"])] if entry["from"] else [])]
        self._record_move(name, alias, json.dumps(entry), versions)
        self._delete_tag(name, PENDING_TAG + alias)

    def _record_move(self, name: str, alias: str, audit: str, versions: list[str]) -> None:
        """Keep the move: a numbered registered-model tag per move (the full history), and on
        each version involved the list of moves that touched it."""
        rm = self._call(f"registered model '{name}'", self.client.get_registered_model, name)
        prefix = f"{MOVES_TAG}{alias}."
        entry = json.loads(audit)
        recorded = [k for k, v in (rm.tags or {}).items() if k.startswith(prefix)]
        if not any(_same_move(rm.tags[k], entry) for k in recorded):  # not a retry's
            n = 1 + len(recorded)
            self._set_tag(name, f"{prefix}{n:05d}", audit)
        for version in versions:
            key = f"{TAG}audit.{alias}"
            try:
                raw = self.version_tags(name, version).get(key)
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
            self._call(
                f"tag '{key}' of version {version} of '{name}'",
                self.client.set_model_version_tag,
                name,
                version,
                key,
                text,
            )

    def moves(self, name: str, alias: str) -> list[dict[str, Any]]:
        """Every recorded move of ``alias``, oldest first."""
        rm = self._call(f"registered model '{name}'", self.client.get_registered_model, name)
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
        found = self._call(
            f"versions of '{name}'",
            self.client.search_model_versions,
            f"name='{_quote(name)}'",
        )
        sources = [int(v.version) for v in found if not is_graphtrim_output(dict(v.tags or {}))]
        tags = self.version_tags(name, version)
        of = tags.get(TAG + "source.version")
        newest = max([*sources, *([int(of)] if of and of.isdigit() else [])], default=None)
        doc = json.loads(_audit("hold", alias, None, str(version), why, who))
        doc.update(
            version=str(version),
            source_name=tags.get(TAG + "source.name") or name,
            since_source=str(newest) if newest is not None else None,
        )
        self._set_tag(name, HOLD_TAG + alias, json.dumps(doc))
        return doc

    def release_hold(self, name: str, alias: str) -> None:
        self._delete_tag(name, HOLD_TAG + alias)

    def rollback(
        self, name: str, alias: str, *, why: str, who: str | None = None
    ) -> tuple[str, str]:
        """Move ``alias`` back to the version it pointed at before; returns (from, to). A
        rollback stopped half way is finished by the next call, not applied a second time (the
        next call returns it)."""
        done = self.complete_move(name, alias)
        if done is not None and done.get("action") == "rollback":
            return str(done["from"]), str(done["to"])
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
        audit = _audit("rollback", alias, current, target, why, who)
        self._move(
            name, alias, target, {"audit": json.loads(audit), "history": history}, "rollback"
        )
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
