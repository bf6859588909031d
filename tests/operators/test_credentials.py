"""Credentials stay with the connection they belong to.

Two teams, two MLflow tracking servers, two Airflow connections with different tokens, one
process (as in Airflow's triggerer, which runs every DAG's triggers in one process, or a worker
that runs one team's task after another's). Each server sits behind a small reverse proxy that
records the ``Authorization`` header of every request it forwards: server B must never see team
A's token, each server must see its own token on every request (tracking, registry and the
artifact uploads and downloads the server proxies), and the process environment must hold no
token afterwards. The same for two S3 endpoints (moto) and two ``aws`` connections with
different key pairs: each endpoint sees only its own access key id.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.helpers import tiny_onnx
from tests.servers import mlflow_server, moto_server

pytestmark = [pytest.mark.slow]

pytest.importorskip("airflow")
pytest.importorskip("mlflow")

TOKENS = {"a": "token-of-team-A", "b": "token-of-team-B"}
KEYS = {
    "a": ("AKIDTEAMAAAAAAAAAAAA", "secret-of-team-A"),
    "b": ("AKIDTEAMBBBBBBBBBBBB", "secret-of-team-B"),
}
SECRETS_IN_ENV = (
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
)
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host"}


class RecordingProxy:
    """A reverse proxy on 127.0.0.1 in a thread: forwards every request to ``upstream`` and
    records (method, path, Authorization header) of each."""

    def __init__(self, upstream: str):
        target = urlsplit(upstream)
        self.upstream = upstream
        self.records: list[tuple[str, str, str | None]] = []
        lock = threading.Lock()
        records = self.records

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                with lock:
                    records.append((self.command, self.path, self.headers.get("Authorization")))
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    body = self._read_chunked()
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                if body is not None:
                    headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=120)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP and k.lower() != "content-length":
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _read_chunked(self) -> bytes:
                out = b""
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        self.rfile.readline()
                        return out
                    out += self.rfile.read(size)
                    self.rfile.readline()

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _forward

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> RecordingProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)

    def auth_headers(self) -> list[str | None]:
        """The Authorization header of every recorded request but the health probe."""
        return [auth for _, path, auth in self.records if not path.startswith("/health")]


@pytest.fixture(scope="module")
def two_mlflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RecordingProxy]]:
    root = tmp_path_factory.mktemp("two-mlflow")
    with (
        mlflow_server(root / "a") as url_a,
        mlflow_server(root / "b") as url_b,
        RecordingProxy(url_a) as proxy_a,
        RecordingProxy(url_b) as proxy_b,
    ):
        yield {"a": proxy_a, "b": proxy_b}


@pytest.fixture
def no_secrets_in_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for key in SECRETS_IN_ENV:
        monkeypatch.delenv(key, raising=False)
    yield
    # what the code under test left behind, checked before monkeypatch restores anything
    leaked = {k: os.environ[k] for k in SECRETS_IN_ENV if k in os.environ}
    secrets = [*TOKENS.values(), *(s for pair in KEYS.values() for s in pair)]
    leaked.update({k: v for k, v in os.environ.items() if v in secrets})
    assert not leaked, f"credentials left in the process environment: {sorted(leaked)}"


def _connections(monkeypatch: pytest.MonkeyPatch, **docs: dict[str, Any]) -> None:
    for conn_id, doc in docs.items():
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(doc))


def _operator(team: str, artifacts: str, **kw: Any) -> Any:
    from graphtrim.airflow.operators import GraphtrimStageOperator

    return GraphtrimStageOperator(
        task_id=f"stage_{team}",
        artifacts=artifacts,
        mlflow_conn_id=f"mlflow_{team}",
        aws_conn_id=f"aws_{team}",
        **kw,
    )


def _use_registry(ctx: Any, team: str, onnx_path: Path, scratch: Path) -> str:
    """What the stages do with a tracking server, through the context an operator built: a
    run with params and an artifact, a logged model with its files (uploaded through the
    server's artifact proxy), a registered version, and that version downloaded again."""
    from mlflow.entities import Param

    from graphtrim.stages import register, tracking

    client = tracking.client(ctx)
    experiment = tracking.experiment_id(client, f"team-{team}")
    run_id = client.create_run(experiment).info.run_id
    client.log_batch(run_id, params=[Param("team", team)])
    client.log_dict(run_id, {"team": team}, "graphtrim/config.json")
    model_uri = register.log_onnx(
        client, experiment, run_id, f"model-{team}", onnx_path, {"team": team}, scratch
    )
    registry = ctx.registry()
    version, created = registry.register(
        model_uri, f"model-{team}", tags={"team": team}, key=f"key-{team}", run_id=run_id
    )
    assert created
    source = registry.resolve(f"models:/model-{team}/{version}")
    folder = Path(registry.download(source, str(scratch / "download")))
    assert any(p.name == "model.onnx" for p in folder.rglob("*.onnx"))
    return str(version)


def test_two_mlflow_connections_in_one_process_each_send_only_their_own_token(
    two_mlflow: dict[str, RecordingProxy],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    no_secrets_in_env: None,
) -> None:
    from graphtrim.airflow.sensors import MlflowModelVersionSensor
    from graphtrim.airflow.triggers import MlflowModelVersionTrigger

    _connections(
        monkeypatch,
        **{
            f"mlflow_{t}": {
                "conn_type": "graphtrim_mlflow",
                "host": two_mlflow[t].url,
                "password": TOKENS[t],
            }
            for t in TOKENS
        },
    )
    onnx_path = tiny_onnx(tmp_path / "tiny.onnx")
    # both teams' contexts exist before either talks to its server: two tasks (or triggers)
    # of one process, one set up after the other
    contexts = {t: _operator(t, str(tmp_path / f"artifacts-{t}")).stage_context({}) for t in TOKENS}
    versions = {}
    for team in ("a", "b", "a"):  # A, then B, then A again
        scratch = tmp_path / f"scratch-{team}-{len(versions)}"
        scratch.mkdir()
        if team not in versions:
            versions[team] = _use_registry(contexts[team], team, onnx_path, scratch)
        else:
            assert contexts[team].registry().alias_version(f"model-{team}", "none") is None

    # the triggerer: both teams' triggers polling side by side in one event loop
    async def first_events() -> list[Any]:
        triggers = [
            MlflowModelVersionTrigger(
                name=f"model-{t}",
                version=versions[t],
                mlflow_conn_id=f"mlflow_{t}",
                poll_interval=0.05,
                timeout=120,
            )
            for t in ("a", "b")
        ]
        return list(await asyncio.gather(*(anext(tr.run()) for tr in triggers)))

    events = asyncio.run(first_events())
    assert [e.payload["status"] for e in events] == ["found", "found"]

    # the sensor's own check (the worker), A after B
    for team in ("b", "a"):
        sensor = MlflowModelVersionSensor(
            task_id=f"wait_{team}",
            model_name=f"model-{team}",
            version=versions[team],
            mlflow_conn_id=f"mlflow_{team}",
            deferrable=False,
        )
        assert sensor.poke({}).is_done

    for team, proxy in two_mlflow.items():
        other = "b" if team == "a" else "a"
        seen = proxy.auth_headers()
        paths = {path.split("?")[0] for _, path, _ in proxy.records}
        assert any("/mlflow-artifacts/" in p for p in paths), "no artifact went through the proxy"
        assert any("/registered-models/" in p or "/model-versions/" in p for p in paths)
        assert not [a for a in seen if a and TOKENS[other] in a], (
            f"server {team.upper()} received team {other.upper()}'s token"
        )
        assert seen and set(seen) == {f"Bearer {TOKENS[team]}"}, (
            f"server {team.upper()}: requests without this connection's token: "
            f"{sorted({str(a) for a in seen} - {f'Bearer {TOKENS[team]}'})}"
        )


def test_the_deferred_sensor_hands_its_trigger_the_connection_not_a_token(
    monkeypatch: pytest.MonkeyPatch, no_secrets_in_env: None
) -> None:
    from airflow.sdk.exceptions import TaskDeferred

    from graphtrim.airflow.sensors import MlflowModelVersionSensor

    _connections(
        monkeypatch,
        mlflow_a={
            "conn_type": "graphtrim_mlflow",
            "host": "http://127.0.0.1:9",
            "password": TOKENS["a"],
        },
    )
    sensor = MlflowModelVersionSensor(
        task_id="wait", model_name="m", version="1", mlflow_conn_id="mlflow_a"
    )
    monkeypatch.setattr(sensor, "_check", lambda: None)
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    _, kwargs = deferred.value.trigger.serialize()
    assert kwargs["mlflow_conn_id"] == "mlflow_a"
    assert TOKENS["a"] not in json.dumps(kwargs)


@pytest.fixture(scope="module")
def two_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RecordingProxy]]:
    root = tmp_path_factory.mktemp("two-s3")
    with (
        moto_server(root / "a") as url_a,
        moto_server(root / "b") as url_b,
        RecordingProxy(url_a) as proxy_a,
        RecordingProxy(url_b) as proxy_b,
    ):
        yield {"a": proxy_a, "b": proxy_b}


def _key_ids(proxy: RecordingProxy) -> set[str]:
    """The access key ids in the SigV4 Authorization headers the proxy saw."""
    out = set()
    for auth in proxy.auth_headers():
        cred = (auth or "").partition("Credential=")[2]
        out.add(cred.split("/")[0] if cred else "")
    return out


def test_two_s3_connections_in_one_process_each_sign_with_their_own_keys(
    two_s3: dict[str, RecordingProxy],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    no_secrets_in_env: None,
) -> None:
    import boto3

    _connections(
        monkeypatch,
        **{
            f"aws_{t}": {
                "conn_type": "aws",
                "login": KEYS[t][0],
                "password": KEYS[t][1],
                "extra": {"endpoint_url": two_s3[t].url, "region_name": "us-east-1"},
            }
            for t in KEYS
        },
    )
    for (
        t,
        proxy,
    ) in two_s3.items():  # buckets made directly on the endpoints, not through the proxies
        boto3.client(
            "s3",
            endpoint_url=proxy.upstream,
            aws_access_key_id=KEYS[t][0],
            aws_secret_access_key=KEYS[t][1],
            region_name="us-east-1",
        ).create_bucket(Bucket=f"team-{t}")
        proxy.records.clear()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'unused.db'}")
    onnx_path = tiny_onnx(tmp_path / "tiny.onnx")
    contexts = {t: _operator(t, f"s3://team-{t}/models").stage_context({}) for t in KEYS}
    for i, team in enumerate(("a", "b", "a")):
        store = contexts[team].store()
        stored = store.put_model(onnx_path, model="tiny", version="1", stage="export")
        fetched = store.fetch_model(stored.uri, tmp_path / f"fetched-{i}")
        assert fetched.read_bytes() == onnx_path.read_bytes()
    for team, proxy in two_s3.items():
        assert _key_ids(proxy) == {KEYS[team][0]}, f"endpoint {team.upper()}: {_key_ids(proxy)}"
        proxy.records.clear()

    # MLflow's own artifacts, written straight to S3 (an embedded tracking URI puts them beside
    # graphtrim's): the run's client uses the context's S3 connection too
    from graphtrim.stages import tracking

    for team in ("a", "b", "a"):
        ctx = contexts[team]
        client = tracking.client(ctx)
        location = tracking.artifact_location(ctx)
        assert location == f"s3://team-{team}/models/mlflow-artifacts"
        experiment = tracking.experiment_id(client, f"s3-team-{team}", location)
        run_id = client.create_run(experiment).info.run_id
        client.log_dict(run_id, {"team": team}, "graphtrim/config.json")
    for team, proxy in two_s3.items():
        assert any(m == "PUT" for m, _, _ in proxy.records), "no MLflow artifact reached S3"
        assert _key_ids(proxy) == {KEYS[team][0]}, f"endpoint {team.upper()}: {_key_ids(proxy)}"


def test_hooks_write_nothing_into_the_environment(
    monkeypatch: pytest.MonkeyPatch, no_secrets_in_env: None
) -> None:
    from graphtrim.airflow.hooks import ArtifactStoreHook, MlflowRegistryHook

    _connections(
        monkeypatch,
        mlflow_a={
            "conn_type": "graphtrim_mlflow",
            "host": "mlflow.internal",
            "port": 5000,
            "password": TOKENS["a"],
        },
        aws_a={
            "conn_type": "aws",
            "login": KEYS["a"][0],
            "password": KEYS["a"][1],
            "extra": {"region_name": "eu-west-1"},
        },
    )
    mlflow_hook = MlflowRegistryHook("mlflow_a")
    assert mlflow_hook.tracking_uri() == "http://mlflow.internal:5000"
    assert ArtifactStoreHook("aws_a").endpoint_url() is None
    # what the hooks offer instead of the environment
    assert mlflow_hook.auth().token == TOKENS["a"]
    s3 = ArtifactStoreHook("aws_a").auth()
    assert (s3.access_key_id, s3.region_name) == (KEYS["a"][0], "eu-west-1")
    assert TOKENS["a"] not in repr(mlflow_hook.auth()) and KEYS["a"][1] not in repr(s3)
