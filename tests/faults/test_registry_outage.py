"""The tracking server failing one kind of request in the middle of an alias move or a rollback
(503 from a proxy in front of a real MLflow server): the call fails with a registry error worth
a retry (never "no such alias", never an internal error), the registry is left as before or as
a retry completes it, and the retry ends as a run without the fault does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.faults.harness import Proxy, Rule
from tests.servers import mlflow_server

pytestmark = [pytest.mark.faults, pytest.mark.server]

ALIAS_GET = "GET /api/2.0/mlflow/registered-models/alias"
ALIAS_SET = "POST /api/2.0/mlflow/registered-models/alias"
TAG_SET = "POST /api/2.0/mlflow/registered-models/set-tag"


@pytest.fixture(scope="module")
def tracking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Proxy]]:
    """A tracking server and the proxy in front of it (what the code under test talks to)."""
    with (
        mlflow_server(tmp_path_factory.mktemp("outage")) as url,
        Proxy(url).running() as proxy,
    ):
        yield url, proxy


@pytest.fixture(autouse=True)
def _no_client_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    # MLflow's client would retry a 503 with backoff for minutes: one answer is the outage here
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")


def _failing(proxy: Proxy, request: str) -> None:
    method, path = request.split(" ", 1)
    proxy.clear()
    proxy.rules.append(
        Rule(lambda m, p: m == method and p.split("?")[0] == path, "503", times=10_000)
    )


def _refused(proxy: Proxy, request: str, call: Callable[[], Any]) -> Any:
    """The registry error ``call`` raises while the tracking server answers ``request`` 503."""
    from graphtrim.integrations.registry import RegistryError

    _failing(proxy, request)
    try:
        with pytest.raises(RegistryError) as raised:
            call()
        assert any(a == "503" for _, _, a in proxy.log), proxy.log  # the fault was met
    finally:
        proxy.clear()
    return raised.value


def _name(kind: str, request: str) -> str:
    method, path = request.split(" ", 1)
    return f"{kind}-{path.rsplit('/', 1)[-1]}-{method.lower()}"


def _model(url: str, name: str, versions: int, promoted: int) -> Any:
    """``name`` with ``versions`` versions, the champion alias moved to 1 .. ``promoted``."""
    from mlflow import MlflowClient

    from graphtrim.integrations.registry import Registry

    client = MlflowClient(url, url)
    client.create_registered_model(name)
    for _ in range(versions):
        client.create_model_version(name, "s3://graphtrim-test/model")  # never read
    for v in range(1, promoted + 1):
        Registry(url).move_alias(name, "champion", str(v), why="setup", who="ci")
    return client


def _state(client: Any, name: str) -> dict[str, Any]:
    rm = client.get_registered_model(name)
    tags = dict(rm.tags)
    moves = [json.loads(v) for k, v in sorted(tags.items()) if k.startswith("graphtrim.moves.")]
    return {
        "alias": {a: str(v) for a, v in rm.aliases.items()},
        "history": json.loads(tags.get("graphtrim.alias_history.champion", "[]")),
        "moves": [(m["action"], m["from"], m["to"]) for m in moves],
        "pending": sorted(k for k in tags if k.startswith("graphtrim.pending_move.")),
    }


@pytest.mark.parametrize("request_", [ALIAS_GET, TAG_SET, ALIAS_SET], ids=["get", "tag", "set"])
def test_a_promotion_meeting_an_outage_fails_for_a_retry_and_the_retry_completes_it(
    tracking: tuple[str, Proxy], request_: str
) -> None:
    from graphtrim.integrations.registry import Registry

    url, proxy = tracking
    name = _name("promote", request_)
    client = _model(url, name, versions=2, promoted=1)
    error = _refused(
        proxy,
        request_,
        lambda: Registry(proxy.url).move_alias(name, "champion", "2", why="new", who="ci"),
    )
    assert error.transient, error  # the orchestrator retries it
    assert _state(client, name)["alias"] == {"champion": "1"}  # not moved yet
    assert Registry(proxy.url).move_alias(name, "champion", "2", why="new", who="ci") == "1"
    assert _state(client, name) == {
        "alias": {"champion": "2"},
        "history": ["1"],
        "moves": [("promote", None, "1"), ("promote", "1", "2")],
        "pending": [],
    }


@pytest.mark.parametrize("request_", [ALIAS_GET, TAG_SET, ALIAS_SET], ids=["get", "tag", "set"])
def test_a_rollback_meeting_an_outage_fails_for_a_retry_and_rolls_back_once(
    tracking: tuple[str, Proxy], request_: str
) -> None:
    from graphtrim.integrations.registry import Registry

    url, proxy = tracking
    name = _name("rollback", request_)
    client = _model(url, name, versions=3, promoted=3)
    error = _refused(
        proxy, request_, lambda: Registry(proxy.url).rollback(name, "champion", why="bad", who="ci")
    )
    assert error.transient, error
    assert "no alias" not in str(error)
    assert Registry(proxy.url).rollback(name, "champion", why="bad", who="ci") == ("3", "2")
    assert _state(client, name) == {
        "alias": {"champion": "2"},
        "history": ["1"],
        "moves": [
            ("promote", None, "1"),
            ("promote", "1", "2"),
            ("promote", "2", "3"),
            ("rollback", "3", "2"),
        ],
        "pending": [],
    }


def test_the_cli_names_an_unreachable_registry_in_one_line_not_an_internal_error(
    tracking: tuple[str, Proxy], tmp_path: Path
) -> None:
    url, proxy = tracking
    client = _model(url, "cli", versions=2, promoted=1)
    _failing(proxy, TAG_SET)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHTRIM_FAULT")}
    env.update(HOME=str(tmp_path))
    try:
        proc = subprocess.run(
            [
                *(sys.executable, "-m", "graphtrim.cli", "promote", "models:/cli/2"),
                *("--alias", "champion", "--why", "new", "--tracking-uri", proxy.url),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
    finally:
        proxy.clear()
    assert proc.returncode == 2, proc.stderr  # the exit-code contract: not 3, a defect
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("graphtrim: error: "), proc.stderr
    assert "503" in lines[0], lines[0]
    assert _state(client, "cli")["alias"] == {"champion": "1"}
