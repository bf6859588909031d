"""The MLflow webhook endpoint's input checks: headers judged before the body is read, the body
capped and hashed as it streams, and every refused request answered 400, 401 or 413 with nothing
triggered. In-process through the ASGI interface, then against a real ``airflow api-server``."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SECRET = "s3cret"
EVENT = {
    "entity": "model_version",
    "action": "created",
    "timestamp": 0,
    "data": {"name": "digits", "version": "7", "source": "models:/m-1", "run_id": "r", "tags": {}},
}
MIB = 1024 * 1024


def _app(monkeypatch: pytest.MonkeyPatch, **kw: Any) -> tuple[Any, list[Any]]:
    """The webhook app with a trigger that records its calls instead of creating DAG runs."""
    from graphtrim.airflow.plugin import create_app

    monkeypatch.delenv("GRAPHTRIM_ALLOW_VARIANT_SOURCE", raising=False)
    calls: list[Any] = []

    def trigger(dag: str, run_id: str, conf: dict[str, Any]) -> str:
        calls.append((dag, run_id, conf))
        return run_id

    kw.setdefault("secret", SECRET)
    # the version's run as the registry events would compute it, without a registry
    kw.setdefault(
        "run_for",
        lambda name, version: {
            "conf": {"model_name": name, "version": version},
            "run_id": f"graphtrim__{name}__v{version}",
        },
    )
    return create_app(trigger=trigger, **kw), calls


def _headers(body: bytes, **over: Any) -> dict[str, Any]:
    """MLflow's headers for ``body``, signed with ``SECRET`` over the (possibly overridden)
    delivery id and timestamp; ``signature`` replaces the signature."""
    from graphtrim.airflow.plugin import sign

    delivery = over.pop("delivery", uuid.uuid4().hex)
    stamp = over.pop("timestamp", str(int(time.time())))
    headers = {
        "X-MLflow-Delivery-Id": delivery,
        "X-MLflow-Timestamp": stamp,
        "X-MLflow-Signature": sign(SECRET, delivery, stamp, body),
        "Content-Type": "application/json",
    }
    if "signature" in over:
        headers["X-MLflow-Signature"] = over.pop("signature")
    assert not over, over
    return headers


def _event() -> bytes:
    return json.dumps({**EVENT, "timestamp": int(time.time())}).encode()


def _asgi_post(app: Any, headers: dict[str, Any], chunks: int, size: int = MIB) -> tuple[int, int]:
    """POST a body of ``chunks`` chunks of ``size`` bytes (no Content-Length: chunked) to the
    ASGI app; returns the status and how many body chunks the app pulled."""
    raw = [
        (k.lower().encode(), v if isinstance(v, bytes) else v.encode("latin-1"))
        for k, v in headers.items()
    ]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/mlflow-webhook",
        "raw_path": b"/mlflow-webhook",
        "query_string": b"",
        "root_path": "",
        "headers": raw,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    pulled = 0
    sent: list[dict[str, Any]] = []
    chunk = b"x" * size

    async def receive() -> dict[str, Any]:
        nonlocal pulled
        if pulled < chunks:
            pulled += 1
            return {"type": "http.request", "body": chunk, "more_body": pulled < chunks}
        await asyncio.sleep(3600)  # the client has nothing more: the app must not wait on it
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(asyncio.wait_for(app(scope, receive, send), timeout=600))
    start = next(m for m in sent if m["type"] == "http.response.start")
    return int(start["status"]), pulled


# ---------------------------------------------------------------------------- headers first


@pytest.mark.parametrize(
    "over",
    [
        pytest.param({"signature": None}, id="unsigned"),
        pytest.param({"signature": "v1,AAAA"}, id="malformed-signature"),
        pytest.param({"signature": "v1,\u00e9".encode("latin-1")}, id="non-ascii-signature"),
        pytest.param({"timestamp": "nan"}, id="nan-timestamp"),
        pytest.param({"delivery": "../../etc"}, id="path-like-delivery"),
    ],
)
def test_a_large_refused_body_is_never_read(
    over: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """200 MiB offered, refused on its headers: not one chunk of the body is pulled."""
    app, calls = _app(monkeypatch)
    headers = _headers(b"", **over)
    if headers["X-MLflow-Signature"] is None:
        del headers["X-MLflow-Signature"]
    status, pulled = _asgi_post(app, headers, chunks=200)
    assert status in (400, 401)
    assert pulled == 0
    assert calls == []


def test_a_signed_body_over_the_limit_stops_being_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunked body (no Content-Length) past ``$GRAPHTRIM_WEBHOOK_MAX_BYTES``: 413 as soon as
    the limit is passed, the rest never pulled."""
    monkeypatch.setenv("GRAPHTRIM_WEBHOOK_MAX_BYTES", str(4 * MIB))
    app, calls = _app(monkeypatch)
    status, pulled = _asgi_post(app, _headers(b"x" * (200 * MIB)), chunks=200)
    assert status == 413
    assert pulled == 5  # the fifth chunk passes 4 MiB
    assert calls == []


# ---------------------------------------------------------------------------- header checks


@pytest.mark.parametrize(
    ("over", "status"),
    [
        pytest.param({"timestamp": "nan"}, 400, id="nan"),
        pytest.param({"timestamp": "inf"}, 400, id="inf"),
        pytest.param({"timestamp": "-inf"}, 400, id="minus-inf"),
        pytest.param({"timestamp": "1e9"}, 400, id="exponent"),
        pytest.param({"timestamp": "+0"}, 400, id="signed"),
        pytest.param({"timestamp": "yesterday"}, 400, id="words"),
        pytest.param({"timestamp": "\u0661\u0662"}, 400, id="non-ascii-digits"),
        pytest.param({"timestamp": "100"}, 400, id="stale"),
        pytest.param({"delivery": ".."}, 400, id="dotdot"),
        pytest.param({"delivery": "a..b"}, 400, id="inner-dotdot"),
        pytest.param({"delivery": "a/b"}, 400, id="slash"),
        pytest.param({"delivery": "a b"}, 400, id="space"),
        pytest.param({"delivery": "x" * 129}, 400, id="too-long"),
        pytest.param({"delivery": "d\u00e9j\u00e0"}, 400, id="non-ascii-delivery"),
        pytest.param({"signature": "v1,\u00e9".encode("latin-1")}, 401, id="non-ascii-signature"),
        pytest.param({"signature": "v1,\u00e9" + "A" * 42 + "="}, 401, id="non-ascii-in-length"),
        pytest.param({"signature": "v2," + "A" * 43 + "="}, 401, id="other-version"),
        pytest.param({"signature": "v1,AAAA"}, 401, id="short"),
    ],
)
def test_malformed_headers_are_refused_and_trigger_nothing(
    over: dict[str, Any], status: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every case is signed with the right secret over what it sends (but for the signature
    cases), so only the check of that header stands between it and a DAG run."""
    from fastapi.testclient import TestClient

    app, calls = _app(monkeypatch)
    client = TestClient(app, raise_server_exceptions=False)
    body = _event()
    headers = {
        k: v.encode("utf-8") if isinstance(v, str) else v for k, v in _headers(body, **over).items()
    }
    r = client.post("/mlflow-webhook", content=body, headers=headers)
    assert r.status_code == status, r.text
    assert calls == []


@pytest.mark.parametrize(("skew", "side"), [(600, "ahead of"), (-600, "behind")])
def test_a_sender_whose_clock_is_off_by_more_than_the_window_is_told_which_clock(
    skew: int, side: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow's server 10 minutes ahead of (or behind) the API server: every delivery is
    refused (a replay window cannot tell skew from replay) with a line that names the clocks,
    and nothing is triggered; the registry's own watcher still sees the versions."""
    from fastapi.testclient import TestClient

    app, calls = _app(monkeypatch)
    body = _event()
    stamp = str(int(time.time()) + skew)
    r = TestClient(app).post(
        "/mlflow-webhook", content=body, headers=_headers(body, timestamp=stamp)
    )
    assert r.status_code == 400, r.text
    detail = r.json()["detail"]
    assert f"s {side} this server's clock" in detail and "NTP" in detail, detail
    assert calls == []


@pytest.mark.parametrize("body_mib", [1, 64])
def test_declared_length_over_the_limit_is_413_before_reading(
    body_mib: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastapi.testclient import TestClient

    monkeypatch.setenv("GRAPHTRIM_WEBHOOK_MAX_BYTES", "1000")
    app, calls = _app(monkeypatch)
    body = json.dumps({**EVENT, "pad": "x" * (body_mib * MIB)}).encode()
    r = TestClient(app).post("/mlflow-webhook", content=body, headers=_headers(body))
    assert r.status_code == 413, r.text
    assert "GRAPHTRIM_WEBHOOK_MAX_BYTES" in r.json()["detail"]
    assert calls == []


def test_signed_events_still_trigger_in_any_chunking(monkeypatch: pytest.MonkeyPatch) -> None:
    """The HMAC fed chunk by chunk equals MLflow's over the whole body; a body of exactly the
    limit is accepted."""
    from fastapi.testclient import TestClient

    body = _event()
    monkeypatch.setenv("GRAPHTRIM_WEBHOOK_MAX_BYTES", str(len(body)))
    app, calls = _app(monkeypatch)
    client = TestClient(app)
    r = client.post("/mlflow-webhook", content=body, headers=_headers(body))
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "triggered"

    def pieces() -> Iterator[bytes]:  # sent chunked, without Content-Length
        for i in range(0, len(body), 7):
            yield body[i : i + 7]

    headers = _headers(body)
    r = client.post("/mlflow-webhook", content=pieces(), headers=headers)
    assert r.status_code == 200, r.text
    assert [c[1] for c in calls][-1] == "graphtrim__digits__v7"
    assert len(calls) == 2
    # one byte more than signed: the signature no longer matches
    r = client.post("/mlflow-webhook", content=body[:-1] + b" ", headers=_headers(body))
    assert r.status_code == 401
    assert len(calls) == 2


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("GRAPHTRIM_WEBHOOK_MAX_BYTES", "1e6"),
        ("GRAPHTRIM_WEBHOOK_MAX_BYTES", "0"),
        ("GRAPHTRIM_WEBHOOK_MAX_AGE", "nan"),
        ("GRAPHTRIM_WEBHOOK_MAX_AGE", "-5"),
    ],
)
def test_bad_limits_in_the_environment_are_refused(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A window of ``nan`` would let every timestamp through; a limit of 0 refuses everything."""
    from graphtrim.airflow.plugin import create_app

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name} must be a positive"):
        create_app(secret=SECRET, trigger=lambda *a: "x")


# ---------------------------------------------------------------------------- real API server


@pytest.fixture(scope="module")
def api_server(
    airflow_db: str, servers: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """``airflow api-server`` (one worker) on 127.0.0.1 with this process's Airflow database,
    the repository's DAGs serialized and the webhook secret set, reading the registry of the
    session's MLflow server through the connection ``mlflow_webhook`` alone (a tracking URI
    that other tests leave in this process's environment is not passed on); stopped by PID."""
    from tests.servers import airflow_api_server

    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MLFLOW_TRACKING_") and k != "AIRFLOW_CONN_MLFLOW_DEFAULT"
    }
    env.update(
        GRAPHTRIM_WEBHOOK_SECRET=SECRET,
        GRAPHTRIM_ALLOW_VARIANT_SOURCE="",
        GRAPHTRIM_WEBHOOK_MLFLOW_CONN="mlflow_webhook",
        AIRFLOW_CONN_MLFLOW_WEBHOOK=json.dumps(
            {"conn_type": "graphtrim_mlflow", "host": servers["mlflow"]}
        ),
    )
    log = tmp_path_factory.mktemp("api-server") / "api-server.log"
    with airflow_api_server(env, log, deadline=180) as url:
        yield url


def _server_rss(url: str) -> int:
    """Resident bytes of the process listening on ``url``'s port and its children."""
    import psutil

    port = int(url.rsplit(":", 1)[1])
    for conn in psutil.net_connections("tcp"):
        if conn.status == "LISTEN" and conn.laddr.port == port and conn.pid:
            proc = psutil.Process(conn.pid)
            return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
    raise AssertionError(f"nothing listens on {url}")


def _raw_post(url: str, headers: dict[str, str], length: int, out: dict[str, Any]) -> None:
    """POST ``length`` bytes with a declared Content-Length over a plain socket, sending while
    the server reads; records the status line and how many bytes the server took in."""
    host, port = url.removeprefix("http://").split(":")
    lines = ["POST /graphtrim/mlflow-webhook HTTP/1.1", f"Host: {host}:{port}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines += [f"Content-Length: {length}", "Connection: close", "", ""]
    sock = socket.create_connection((host, int(port)), timeout=120)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    out["sent"] = 0
    answer = bytearray()

    def read() -> None:
        try:
            while b"\r\n" not in answer and (data := sock.recv(4096)):
                answer.extend(data)
        except OSError:
            pass

    reader = threading.Thread(target=read)
    reader.start()
    try:
        sock.sendall("\r\n".join(lines).encode())
        chunk = b"x" * (256 * 1024)
        while out["sent"] < length and reader.is_alive():
            out["sent"] += sock.send(chunk[: length - out["sent"]])
    except OSError:  # the server answered and closed: it takes no more
        pass
    reader.join(timeout=120)
    sock.close()
    out["status"] = answer.split(b"\r\n", 1)[0].decode(errors="replace")


@pytest.mark.slow
def test_api_server_refuses_large_unsigned_bodies_unread(api_server: str) -> None:
    """The issue's case: four parallel unsigned 100 MiB POSTs. Each gets 401 while the server
    has taken in a small part of its body, and the server's memory does not grow by the bodies
    (its peak resident size, sampled while the requests run)."""
    length = 100 * MIB
    before = _server_rss(api_server)
    peak = before
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.05):
            peak = max(peak, _server_rss(api_server))

    sampler = threading.Thread(target=sample)
    sampler.start()
    results: list[dict[str, Any]] = [{} for _ in range(4)]
    threads = [
        threading.Thread(target=_raw_post, args=(api_server, {}, length, r)) for r in results
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    done.set()
    sampler.join()
    grown = peak - before
    print(f"server RSS {before / MIB:.0f} MiB, peak +{grown / MIB:.0f} MiB; sent", results)
    for r in results:
        assert r["status"].startswith("HTTP/1.1 401"), r
        # what the socket buffers on both sides hold, never the body
        assert r["sent"] < 16 * MIB, r
    assert grown < 100 * MIB


@pytest.mark.slow
def test_api_server_triggers_signed_events_and_refuses_bad_ones(
    api_server: str, servers: dict[str, str]
) -> None:
    """Through the real API server and its metadata database: a signed event makes one DAG run,
    under the run id the registry events give the version; a ``..`` delivery id, a non-ASCII
    signature and a ``nan`` timestamp (each otherwise signed) get 400/401 and make none."""
    import requests
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from mlflow import MlflowClient
    from sqlalchemy import func, select

    from graphtrim.stages.context import PipelineConfig
    from graphtrim.stages.scan import run_key

    def runs() -> int:
        with create_session() as session:
            return int(session.scalar(select(func.count()).select_from(DagRun)) or 0)

    endpoint = f"{api_server}/graphtrim/mlflow-webhook"
    before = runs()
    refused: list[tuple[dict[str, Any], int]] = [
        ({"delivery": "a..b"}, 400),
        ({"delivery": "../x"}, 400),
        ({"signature": "v1,\u00e9".encode("latin-1")}, 401),
        ({"timestamp": "nan"}, 400),
    ]
    for over, status in refused:
        body = _event()
        r = requests.post(endpoint, data=body, headers=_headers(body, **over), timeout=60)
        assert r.status_code == status, (over, r.status_code, r.text)
    assert runs() == before
    name = f"hooked-{uuid.uuid4().hex[:6]}"
    MlflowClient(servers["mlflow"], servers["mlflow"]).create_registered_model(name)
    event = {**EVENT, "timestamp": int(time.time())}
    body = json.dumps({**event, "data": {**EVENT["data"], "name": name}}).encode()
    r = requests.post(endpoint, data=body, headers=_headers(body), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "triggered"
    assert r.json()["run_id"] == run_key(name, "7", PipelineConfig().config_hash)
    assert runs() == before + 1


def _token(url: str) -> str:
    """A JWT of the simple auth manager's generated user (what the UI's login gets)."""
    import requests

    home = Path(os.environ["AIRFLOW_HOME"])
    passwords = home / "simple_auth_manager_passwords.json.generated"
    user, password = next(iter(json.loads(passwords.read_text()).items()))
    got = requests.post(
        f"{url}/auth/token", json={"username": user, "password": password}, timeout=60
    )
    got.raise_for_status()
    return str(got.json()["access_token"])


@pytest.mark.slow
def test_api_server_serves_the_variants_page_to_signed_in_users_only(api_server: str) -> None:
    """The plugin's page is in the UI's navigation and answers only a signed-in caller (the
    page's content is tested against a real registry in the pipeline tests)."""
    import requests

    page = f"{api_server}/graphtrim/variants"
    assert requests.get(page, timeout=60).status_code == 401
    auth = {"Authorization": f"Bearer {_token(api_server)}"}
    plugins = requests.get(f"{api_server}/api/v2/plugins", headers=auth, timeout=60).json()
    ours = next(p for p in plugins["plugins"] if p["name"] == "graphtrim")
    (view,) = ours["external_views"]
    assert view["href"] == "/graphtrim/variants" and view["destination"] == "nav"
    got = requests.get(page, headers=auth, timeout=60)
    assert got.status_code == 200, got.text
    assert got.headers["content-type"].startswith("text/html")


def test_the_variants_page_says_when_the_registry_cannot_be_read() -> None:
    from fastapi.testclient import TestClient

    from graphtrim.airflow.plugin import AUTHENTICATED, create_app
    from graphtrim.errors import GraphtrimError

    def unreadable() -> str:
        raise GraphtrimError("no MLflow tracking URI (MLFLOW_TRACKING_URI)")

    app = create_app(secret=SECRET, catalog=unreadable)
    app.dependency_overrides[AUTHENTICATED] = lambda: None  # a signed-in caller
    got = TestClient(app).get("/variants")
    assert got.status_code == 503, got.text
    assert "cannot read the MLflow registry" in got.json()["detail"]
    assert "MLFLOW_TRACKING_URI" in got.json()["detail"]
