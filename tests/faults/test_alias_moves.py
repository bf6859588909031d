"""An alias move or a rollback killed half way, at each of its fault points, and run again: the
registry ends as after one move (the alias where it should be, its history, one record of the
move and one audit entry per version). Embedded registry (SQLite); the killed attempt in a
process of its own, the retry in the test's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from graphtrim.integrations.registry import Registry

pytestmark = [pytest.mark.faults]

MOVE = (
    "import sys; from graphtrim.integrations.registry import Registry; "
    "Registry(sys.argv[1]).move_alias('m', 'champion', sys.argv[2], why='test', who='ci')"
)
ROLLBACK = (
    "import sys; from graphtrim.integrations.registry import Registry; "
    "print(Registry(sys.argv[1]).rollback('m', 'champion', why='bad', who='ci'))"
)


def _run(code: str, tracking: str, home: Path, point: str, *args: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHTRIM_FAULT")}
    env.update(HOME=str(home), MLFLOW_DISABLE_TELEMETRY="true")
    env.update(GRAPHTRIM_FAULT_POINT=point, GRAPHTRIM_FAULT_ACTION="kill")
    return subprocess.run(
        [sys.executable, "-c", code, tracking, *args], env=env, capture_output=True, timeout=600
    ).returncode


def _move(tracking: str, version: str, home: Path, point: str) -> int:
    return _run(MOVE, tracking, home, point, version)


def _moves(tags: dict[str, str]) -> list[tuple[str, str | None, str]]:
    found = [json.loads(v) for k, v in sorted(tags.items()) if k.startswith("graphtrim.moves.")]
    return [(m["action"], m["from"], m["to"]) for m in found]


@pytest.mark.parametrize(
    "point", ["promote.alias.before", "promote.alias.after", "promote.history.after"]
)
def test_a_move_killed_half_way_is_finished_once_by_the_retry(point: str, tmp_path: Path) -> None:
    from mlflow import MlflowClient

    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking, tracking)
    client.create_registered_model("m")
    for _ in range(2):
        client.create_model_version("m", (tmp_path / "model").as_uri())
    Registry(tracking).move_alias("m", "champion", "1", why="test", who="ci")
    assert _move(tracking, "2", tmp_path, point) == -9  # killed at the point
    Registry(tracking).move_alias("m", "champion", "2", why="test", who="ci")  # the retry

    rm = client.get_registered_model("m")
    tags = dict(rm.tags)
    assert {a: str(v) for a, v in rm.aliases.items()} == {"champion": "2"}  # int embedded
    assert json.loads(tags["graphtrim.alias_history.champion"]) == ["1"]
    moves = [json.loads(v) for k, v in sorted(tags.items()) if k.startswith("graphtrim.moves.")]
    assert [(m["from"], m["to"]) for m in moves] == [(None, "1"), ("1", "2")]
    assert not any(k.startswith("graphtrim.pending_move.") for k in tags)
    audit = {
        v: [
            (e["from"], e["to"])
            for e in json.loads(client.get_model_version("m", v).tags["graphtrim.audit.champion"])
        ]
        for v in ("1", "2")
    }
    assert audit == {"1": [(None, "1"), ("1", "2")], "2": [("1", "2")]}


@pytest.mark.parametrize(
    "point", ["rollback.alias.before", "rollback.alias.after", "rollback.history.after"]
)
def test_a_rollback_killed_half_way_is_finished_by_the_retry_not_applied_twice(
    point: str, tmp_path: Path
) -> None:
    """Versions 1, 2, 3 promoted in turn, then a rollback killed at ``point`` and run again:
    the alias is on 2 (one step back, not two), its history ["1"], one rollback on record."""
    from mlflow import MlflowClient

    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking, tracking)
    client.create_registered_model("m")
    for v in ("1", "2", "3"):  # the moves before, in this process: only the rollback is killed
        client.create_model_version("m", (tmp_path / "model").as_uri())
        Registry(tracking).move_alias("m", "champion", v, why="test", who="ci")
    assert _run(ROLLBACK, tracking, tmp_path, point) == -9  # killed at the point
    assert Registry(tracking).rollback("m", "champion", why="bad", who="ci") == ("3", "2")

    rm = client.get_registered_model("m")
    tags = dict(rm.tags)
    assert {a: str(v) for a, v in rm.aliases.items()} == {"champion": "2"}
    assert json.loads(tags["graphtrim.alias_history.champion"]) == ["1"]
    assert _moves(tags) == [
        ("promote", None, "1"),
        ("promote", "1", "2"),
        ("promote", "2", "3"),
        ("rollback", "3", "2"),
    ]
    assert not any(k.startswith("graphtrim.pending_move.") for k in tags)
    audit = json.loads(client.get_model_version("m", "3").tags["graphtrim.audit.champion"])
    assert [(e["action"], e["from"], e["to"]) for e in audit] == [
        ("promote", "2", "3"),
        ("rollback", "3", "2"),
    ]
