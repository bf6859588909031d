"""The children of :mod:`graphtrim.isolation`, forked from a process that has imported what they
import.

A fresh interpreter spends about a second of CPU importing numpy, onnx, onnxruntime and onnx_ir
before a child does any work, and a pipeline run starts hundreds of children (one per verified
file, per variant built, per gate measured). The fork server pays that once per calling
process: ``python -m graphtrim.isolation --serve`` imports those packages (and each graphtrim
module a child is asked to run) and then only forks. Each child is still a process of its own
that has run nothing but the imports: it starts its own session, writes its output to its
own file, runs in the caller's environment and working folder, and its end (an exit code, or
the signal that killed it) is reaped by the server and written beside the request.

The server runs while the process that started it does: a calling process that forks (an
Airflow worker) or whose environment changes gets a server of its own, so every child sees
the packages imported under the environment it is given. A server that is replaced or closed
still reaps the children it forked (their ends are written) before it exits; one that does not
answer a request within :data:`REPLY_TIMEOUT` is killed, with any child it forked for that
request, and the caller spawns from then on. ``GRAPHTRIM_ISOLATION=spawn`` turns
the server off (a fresh interpreter per child, as without it), and any failure of the server
falls back to that.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

MODE_ENV = "GRAPHTRIM_ISOLATION"  # "forkserver" (the default) or "spawn"
EXIT_FILE = "exit"  # written beside the request when the child has ended
# what every child imports, imported once by the server
PRELOAD = ("numpy", "onnx", "onnxruntime", "onnx_ir")
# set per child, never part of the environment the server is started with
PER_CHILD = ("GRAPHTRIM_ISOLATION_STEP_FILE", "MALLOC_MMAP_THRESHOLD_")
# seconds a caller waits for the server to answer with a child's pid: the server imports the
# child's graphtrim module before forking (the packages were imported when it started), which
# takes a second or two; far beyond that it is stuck, and the caller spawns instead
REPLY_TIMEOUT = 300.0

_lock = threading.Lock()
_server: _Server | None = None
_retired: list[_Server] = []  # replaced servers still reaping children a caller waits on
_broken = False  # a server failed in this process: children are spawned from now on


class Child:
    """A forked child: its pid, and its end as the server writes it."""

    def __init__(self, server: _Server, pid: int, folder: Path) -> None:
        self.server, self.pid, self.exit = server, pid, folder / EXIT_FILE
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = int(self.exit.read_text())
            except (OSError, ValueError):
                if self.server.proc.poll() is not None and not _alive(self.pid):
                    # the server was killed before it could reap the child: its end is lost
                    self.returncode = 1
        return self.returncode

    def kill(self) -> None:
        _kill(self.pid)

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode


def _kill(pid: int) -> None:
    with contextlib.suppress(OSError):  # its session leader, or already gone
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):  # killed before it started its session
        os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _base_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in PER_CHILD}


class _Server:
    def __init__(self, env: dict[str, str]) -> None:
        self.owner = os.getpid()
        self.env = env
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "graphtrim.isolation", "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # not the caller's stderr: a caller reading that until it closes must not wait on
            # the server (a failed server is seen by its caller, which then spawns)
            stderr=subprocess.DEVNULL,
            env=env,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.to: IO[bytes] = self.proc.stdin
        self.back: IO[bytes] = self.proc.stdout

    def fork(
        self, target: str, request: Path, log: Path, env: Mapping[str, str], cwd: str
    ) -> Child:
        line = {"target": target, "request": str(request), "log": str(log), "cwd": cwd}
        line["env"] = dict(env)  # type: ignore[assignment]
        self.to.write(json.dumps(line).encode() + b"\n")
        self.to.flush()
        ready, _, _ = select.select([self.back], [], [], REPLY_TIMEOUT)
        if not ready:
            raise OSError(f"the isolation fork server did not answer in {REPLY_TIMEOUT:g} s")
        answer = self.back.readline().decode().strip()
        if not answer.isdigit():
            raise OSError(f"the isolation fork server answered {answer!r}")
        return Child(self, int(answer), request.parent)

    def retire(self) -> None:
        """No more requests: the server exits once the children it forked have ended."""
        with contextlib.suppress(OSError):
            self.to.close()

    def close(self) -> None:
        self.retire()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def abandon(self) -> None:
        """Kill the server, and the child of an answer it wrote but nobody read."""
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()
        with contextlib.suppress(OSError, ValueError):
            for word in self.back.read().split():
                if word.isdigit():
                    _kill(int(word))


def _close() -> None:
    global _server
    with _lock:
        mine = [s for s in (*_retired, _server) if s is not None and s.owner == os.getpid()]
        for server in mine:
            server.close()
        _retired.clear()
        _server = None


atexit.register(_close)


def fork(target: str, request: Path, log: Path, env: Mapping[str, str]) -> Child | None:
    """A child of the fork server running ``request``, with ``env`` as its environment and
    ``log`` as its stdout and stderr; None where the server is off or failed (the caller then
    spawns the child itself)."""
    global _server, _broken
    if _broken or os.environ.get(MODE_ENV, "forkserver") == "spawn":
        return None
    base = _base_env(env)
    with _lock:
        try:
            server = _server
            _retired[:] = [s for s in _retired if s.proc.poll() is None]
            if server is not None and (
                server.owner != os.getpid() or server.env != base or server.proc.poll() is not None
            ):
                if server.owner == os.getpid():
                    # not waited for: it exits once the children another thread of this
                    # process may be waiting on have ended, their ends written
                    server.retire()
                    _retired.append(server)
                server = _server = None  # (a forked caller leaves its parent's server alone)
            if server is None:
                server = _server = _Server(base)
            return server.fork(target, request, log, env, os.getcwd())
        except (OSError, ValueError):
            _broken = True
            if _server is not None and _server.owner == os.getpid():
                with contextlib.suppress(Exception):
                    _server.abandon()
            _server = None
            return None


# ---------------------------------------------------------------------------- the server


def serve(run_child: Any) -> int:
    """The server's loop: read a request per line, fork a child that runs ``run_child`` on it,
    answer with the child's pid; write each child's end beside its request when it is reaped.
    When the caller closes its side, the server ends once its children have."""
    from graphtrim import lazy_sympy

    lazy_sympy.install()  # onnx_ir without sympy, as in the command line
    for name in PRELOAD:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    children: dict[int, Path] = {}
    stdin = sys.stdin.buffer
    while True:
        ready, _, _ = select.select([stdin], [], [], 0.05 if children else None)
        _reap(children)
        if not ready:
            continue
        line = stdin.readline()
        if not line:
            while children:  # their callers wait for the ends this writes
                time.sleep(0.05)
                _reap(children)
            return 0
        order = json.loads(line)
        module = order["target"].partition(":")[0]
        if module.startswith("graphtrim."):  # graphtrim's own modules import nothing heavy
            with contextlib.suppress(Exception):
                importlib.import_module(module)
        pid = os.fork()
        if pid == 0:
            _in_child(order, run_child)  # never returns
        children[pid] = Path(order["request"]).parent / EXIT_FILE
        sys.stdout.write(f"{pid}\n")
        sys.stdout.flush()


def _reap(children: dict[int, Path]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # none left to reap: their ends cannot be known
            children.clear()
            return
        if pid == 0:
            return
        path = children.pop(pid, None)
        if path is None:
            continue
        tmp = path.with_name(f".{EXIT_FILE}.tmp")
        with contextlib.suppress(OSError):  # its caller removed the folder
            tmp.write_text(str(os.waitstatus_to_exitcode(status)))
            os.replace(tmp, path)


def _in_child(order: dict[str, Any], run_child: Any) -> None:
    code = 1
    try:
        os.setsid()  # a timeout kills the child's whole session, as a spawned one's
        out = os.open(order["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.close(null)
        os.chdir(order["cwd"])
        os.environ.clear()
        os.environ.update(order["env"])
        threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_")
        if threshold:  # glibc reads it at start only: set it as the variable would have
            import ctypes

            m_mmap_threshold = -3
            ctypes.CDLL(None).mallopt(m_mmap_threshold, int(threshold))
        code = run_child(order["request"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
