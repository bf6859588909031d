"""The components the fault suite starts and breaks: a PostgreSQL cluster of its own (so it can
be restarted), the MLflow tracking server on it (so it can be killed and started again on the
same port), moto's S3 server, and a small HTTP proxy in front of MLflow and of S3 that answers
503 SlowDown, drops a connection before forwarding a request, or forwards it and drops the
answer (the write happened, the client never heard).

Every process is started in a session of its own and stopped by PID.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import requests

from tests.servers import _env, _wait, free_port, stop_process_group


def _pg_bin(name: str) -> str:
    found = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))
    if found:
        return str(found[-1])
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"PostgreSQL's {name} is not installed (looked in /usr/lib/postgresql)")
    return path


class PgCluster:
    """A PostgreSQL cluster in a temporary folder of its own on a free port, trust auth, TCP on
    127.0.0.1 only. As root the server runs as the ``postgres`` user (PostgreSQL refuses root),
    so the folder is directly under the system's temporary folder, where that user can reach
    it; :meth:`stop` removes it."""

    def __init__(self) -> None:
        import tempfile

        self.folder = Path(tempfile.mkdtemp(prefix="graphtrim-faults-pg-"))
        self.data = self.folder / "data"
        self.port = free_port()
        self.log = self.folder / "postgres.log"
        self._user: str | None = None
        if os.geteuid() == 0:
            self._user = "postgres"
            pwd.getpwnam(self._user)  # KeyError: no such user

    def _run(self, *args: str) -> None:
        cmd = list(args)
        if self._user is not None:
            cmd = ["runuser", "-u", self._user, "--", *cmd]
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)

    @property
    def _options(self) -> str:
        return (
            f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c max_connections=200"
        )

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        if self._user is not None:
            shutil.chown(self.folder, self._user)
        if not self.data.exists():
            self._run(
                _pg_bin("initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E",
                "UTF8", "--no-sync",
            )  # fmt: skip
        self._run(
            _pg_bin("pg_ctl"), "-D", str(self.data), "-o", self._options, "-l", str(self.log),
            "-w", "-t", "120", "start",
        )  # fmt: skip

    def restart(self) -> None:
        """``pg_ctl restart -m fast``: every open connection is cut."""
        self._run(
            _pg_bin("pg_ctl"), "-D", str(self.data), "-o", self._options, "-l", str(self.log),
            "-m", "fast", "-w", "-t", "120", "restart",
        )  # fmt: skip

    def stop_fast(self) -> None:
        """``pg_ctl stop -m fast`` (a restart that takes a while: :meth:`start` again)."""
        self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def stop(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
            self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.folder, ignore_errors=True)

    def create_database(self, name: str) -> str:
        subprocess.run(
            ["psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-d", "postgres",
             "-v", "ON_ERROR_STOP=1", "-c", f"CREATE DATABASE {name}"],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/{name}"


class MlflowProcess:
    """``mlflow server`` on ``backend`` with local proxied artifacts, on a fixed port so that it
    can be killed (SIGKILL) and started again where its clients look for it."""

    def __init__(self, folder: Path, backend: str) -> None:
        self.folder = folder
        self.backend = backend
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        log = self.folder / f"mlflow-server-{self.starts}.log"
        cmd = [
            str(Path(sys.executable).with_name("mlflow")), "server",
            "--backend-store-uri", self.backend,
            "--artifacts-destination", str(self.folder / "artifacts"),
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
        ]  # fmt: skip
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=_env(self.folder),
                start_new_session=True,
            )
        _wait(self.url + "/health", self.proc, log, timeout=600)

    def kill(self) -> None:
        """SIGKILL to the server and its workers, as a node lost under it."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=60)
        # the port is free again once the kernel let go of the listening socket
        end = time.monotonic() + 60
        while time.monotonic() < end:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", self.port))
                    return
                except OSError:
                    time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc)


# ---------------------------------------------------------------------------------- the proxy


@dataclass
class Rule:
    """What the proxy does to requests that ``match`` (method, path with query): ``action`` is
    ``"503"`` (S3's SlowDown, nothing forwarded), ``"drop"`` (the connection closed before
    forwarding, after reading half the body), ``"lose"`` (forwarded, the answer dropped) or
    ``"hold"`` (the request read and held, nothing forwarded, until :meth:`Proxy.release`: the
    test kills the client meanwhile; :attr:`Proxy.holding` is set while one is held);
    ``times`` requests at most (then the rule is spent)."""

    match: Callable[[str, str], bool]
    action: str
    times: int = 1
    hits: int = 0

    def take(self, method: str, path: str) -> bool:
        if self.hits >= self.times or not self.match(method, path):
            return False
        self.hits += 1
        return True


SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


@dataclass
class Proxy:
    """An HTTP/1.1 proxy on 127.0.0.1 in front of ``upstream`` that applies its :class:`Rule`s
    and logs every request (method, path, what it did)."""

    upstream: str
    rules: list[Rule] = field(default_factory=list)
    log: list[tuple[str, str, str]] = field(default_factory=list)
    port: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self.holding = threading.Event()
        self._released = threading.Event()
        host, _, port = self.upstream.removeprefix("http://").partition(":")
        self._up = (host, int(port))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def decide(self, method: str, path: str) -> str:
        with self._lock:
            for rule in self.rules:
                if rule.take(method, path):
                    self.log.append((method, path, rule.action))
                    return rule.action
            self.log.append((method, path, "pass"))
            return "pass"

    def clear(self) -> None:
        self.release()
        with self._lock:
            self.rules.clear()
            self.log.clear()

    def release(self) -> None:
        """Let held requests go (their connections are closed, nothing forwarded)."""
        self._released.set()
        self.holding.clear()

    @contextlib.contextmanager
    def running(self) -> Iterator[Proxy]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    parts = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            break
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                    return b"".join(parts)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _any(self) -> None:
                action = proxy.decide(self.command, self.path)
                if action == "drop":
                    n = int(self.headers.get("Content-Length") or 0)
                    self.rfile.read(n // 2)
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                    return
                body = self._body()
                if action == "hold":
                    proxy._released.clear()
                    proxy.holding.set()
                    proxy._released.wait(300)  # a guard against a hang only
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if action == "503":
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOWDOWN)))
                    self.end_headers()
                    self.wfile.write(SLOWDOWN)
                    return
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() not in ("transfer-encoding", "connection", "content-length")
                }
                headers["Content-Length"] = str(len(body))
                try:
                    conn = http.client.HTTPConnection(*proxy._up, timeout=300)
                    conn.request(self.command, self.path, body=body, headers=headers)
                    answer = conn.getresponse()
                    data = answer.read()
                    conn.close()
                except OSError:
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if action == "lose":
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.send_response_only(answer.status, answer.reason)
                for k, v in answer.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _any

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            server.shutdown()
            server.server_close()


def healthy(url: str, *, timeout: float = 300) -> None:
    """Wait until the server at ``url`` answers its health check (a guard against a hang)."""
    end = time.monotonic() + timeout
    while True:
        try:
            if requests.get(url + "/health", timeout=10).ok:
                return
        except requests.RequestException:
            pass
        if time.monotonic() > end:
            raise RuntimeError(f"{url} not healthy after {timeout} s")
        time.sleep(0.3)
