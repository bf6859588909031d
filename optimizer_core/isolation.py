"""Run work that loads a candidate model into a runtime in a child process, with a timeout.

A runtime can crash on a model it accepts (onnxruntime's CPU provider has segfaulted on fp16
graphs at its default optimization level) or hang. In the caller's process that takes every
other result down with it: a pipeline run that loses three good variants to the fourth, an
Airflow task that never ends. Here such work runs in a process of its own; a crash or a hang
becomes a :class:`ChildFailed` error naming the signal (or the timeout) and the step the child
had reached, and the caller goes on with the next item.

The child is forked from a server that has imported numpy, onnx, onnxruntime and onnx_ir
once for the calling process (:mod:`graphtrim.forkserver`; ``GRAPHTRIM_ISOLATION=spawn`` starts
a fresh ``python -m graphtrim.isolation REQUEST`` instead). It imports ``module:function``
by name, calls it on each item in turn and writes each result as soon as it has it, so a crash
on item *k* keeps the results of the items before it; :func:`map_isolated` then starts a new
child for the items after it. Work inside the child reports what it is doing with
:func:`step` (a no-op in the parent), which is how a crash is attributed to "opening an
onnxruntime session" rather than to the whole item.

Requests and results travel as pickles through files that only this process and its child
write (a private temporary folder): nothing from outside is ever unpickled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from graphtrim import forkserver
from graphtrim.errors import GraphtrimError

_STEP_ENV = "GRAPHTRIM_ISOLATION_STEP_FILE"
DEFAULT_TIMEOUT = 1800.0  # seconds per item


class ChildFailed(GraphtrimError):
    """The child process died of a signal, exited without a result, or ran past its timeout."""

    def __init__(
        self,
        message: str,
        *,
        signal_name: str | None = None,
        step: str | None = None,
        timed_out: bool = False,
    ):
        super().__init__(message)
        self.signal_name = signal_name
        self.step = step
        self.timed_out = timed_out


@dataclasses.dataclass(frozen=True)
class _Raised:
    """An exception raised by the function in the child, carried back by value."""

    module: str
    name: str
    message: str
    transient: bool
    trace: str


def step(text: str) -> None:
    """Record what the child is doing now (a crash is reported as "while <text>"). Outside a
    child this does nothing."""
    path = os.environ.get(_STEP_ENV)
    if not path:
        return
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except OSError:
        pass


def in_child() -> bool:
    return bool(os.environ.get(_STEP_ENV))


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _rebuild(raised: _Raised) -> BaseException:
    """The child's exception as the same class where it is a graphtrim error that takes a
    message (so the caller's handling stays the same), else a :class:`GraphtrimError`."""
    try:
        cls = getattr(importlib.import_module(raised.module), raised.name)
        if isinstance(cls, type) and issubclass(cls, GraphtrimError):
            exc = cls(raised.message)
            exc.transient = raised.transient
            return exc
    except Exception:
        pass
    return GraphtrimError(f"{raised.name}: {raised.message}")


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError:
        return ""


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        data = path.read_bytes()[-limit:]
    except OSError:
        return ""
    return data.decode("utf-8", "replace")


def _reason(text: str) -> str:
    """The most telling line of a child's stderr: a fatal-error line, else the last one."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("Fatal Python error") or "Assertion" in ln or "terminate called" in ln:
            return ln[:300]
    return lines[-1][:300] if lines else ""


class _Spawned:
    """A child in a fresh interpreter (the fork server off or failed)."""

    def __init__(self, request: Path, log: Path, env: Mapping[str, str]) -> None:
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "graphtrim.isolation", str(request)],
                stdin=subprocess.DEVNULL,
                stdout=err,
                stderr=err,
                env=env,
                start_new_session=True,  # a timeout kills the child and what it started
            )
        self.pid = self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        with contextlib.suppress(OSError):  # already gone
            os.killpg(self.proc.pid, signal.SIGKILL)

    def wait(self) -> int:
        return self.proc.wait()


def map_isolated(
    target: str,
    items: Sequence[Any],
    *,
    common: Mapping[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    what: Callable[[Any], str] | None = None,
    on_result: Callable[[int, Any], None] | None = None,
    on_step: Callable[[str], None] | None = None,
    fresh: bool = False,
) -> list[Any]:
    """Call ``target`` (``"module:function"``) as ``fn(item, **common)`` for every item, in
    child processes, and return, per item, its result or the exception it ended with (a
    :class:`ChildFailed` for a crash or a timeout, else what the function raised).

    One child works through the items in order; when it dies, the item it was on gets the
    error and a new child takes the items after it. With ``fresh`` every item gets a child of
    its own, whose memory goes back to the system when it ends (a process's heap rarely
    shrinks: one that built a large model first would hold that much for every item after
    it), and large allocations are mapped one by one, so that memory freed between the steps
    of an item is returned too. ``timeout`` bounds each item.
    ``on_step`` receives each step the child reports (:func:`step`): progress on long work.
    """
    if ":" not in target:
        raise ValueError(f"target must be 'module:function', not {target!r}")
    label = what or (lambda item: str(item))
    results: list[Any] = [None] * len(items)
    done = [False] * len(items)
    start = 0
    with tempfile.TemporaryDirectory(prefix="graphtrim-isolation-") as folder:
        root = Path(folder)
        while start < len(items):
            end = start + 1 if fresh else len(items)
            run = root / f"child{start}"
            run.mkdir()
            request = run / "request.pkl"
            with open(request, "wb") as fh:
                pickle.dump(
                    {
                        "target": target,
                        "items": list(items[start:end]),
                        "first": start,
                        "common": dict(common or {}),
                        "path": list(sys.path),
                    },
                    fh,
                )
            stderr_path = run / "stderr.txt"
            step_path = run / "step.txt"
            env = {**os.environ, _STEP_ENV: str(step_path)}
            if fresh:
                # glibc: allocations from 1 MiB up get their own mapping, unmapped on free
                # (its default threshold rises to 32 MiB as large blocks are freed, and the
                # blocks below it stay in the heap); an explicit setting wins
                env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
            proc = forkserver.fork(target, request, stderr_path, env) or _Spawned(
                request, stderr_path, env
            )
            current = start
            began = time.monotonic()
            timed_out = False
            seen = ""
            while proc.poll() is None:
                time.sleep(0.05)
                if on_step is not None:
                    now = _read(step_path)
                    if now and now != seen and now != "starting":
                        on_step(now)
                    seen = now
                # results appear one file per item: the item in flight is the first
                # without one
                while current < end and (run / f"{current}.pkl").exists():
                    current += 1
                    began = time.monotonic()
                if time.monotonic() - began > timeout:
                    timed_out = True
                    proc.kill()
                    proc.wait()
                    break
            for i in range(start, end):
                out = run / f"{i}.pkl"
                if not out.exists():
                    break
                with open(out, "rb") as fh:
                    ok, value = pickle.load(fh)
                results[i] = value if ok else _rebuild(value)
                done[i] = True
                if on_result is not None:
                    on_result(i, results[i])
            failed = next((i for i in range(start, end) if not done[i]), None)
            if failed is None:
                start = end
                continue
            where = _read(step_path)
            detail = _reason(_tail(stderr_path))
            code = proc.returncode
            subject = label(items[failed])
            if timed_out:
                exc = ChildFailed(
                    f"{subject}: no result after {timeout:g} s"
                    + (f" while {where}" if where else "")
                    + ": stopped",
                    step=where or None,
                    timed_out=True,
                )
            elif code is not None and code < 0:
                name = _signal_name(code)
                exc = ChildFailed(
                    f"{subject}: the process died of {name}"
                    + (f" while {where}" if where else "")
                    + (f" ({detail})" if detail else ""),
                    signal_name=name,
                    step=where or None,
                )
            else:
                exc = ChildFailed(
                    f"{subject}: the process exited with status {code} without a result"
                    + (f" while {where}" if where else "")
                    + (f" ({detail})" if detail else ""),
                    step=where or None,
                )
            results[failed] = exc
            done[failed] = True
            if on_result is not None:
                on_result(failed, exc)
            start = failed + 1
    return results


def call_isolated(
    target: str,
    item: Any,
    *,
    common: Mapping[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    what: str | None = None,
) -> Any:
    """``target(item, **common)`` in a child process; its result, or its error raised here."""
    (result,) = map_isolated(
        target,
        [item],
        common=common,
        timeout=timeout,
        what=(lambda _item: what) if what else None,
    )
    if isinstance(result, BaseException):
        raise result
    return result


def _child(request_path: str) -> int:
    import faulthandler

    faulthandler.enable()  # a fatal signal prints the Python stack to stderr, then kills
    with open(request_path, "rb") as fh:
        request = pickle.load(fh)
    for entry in request["path"]:
        if entry not in sys.path:
            sys.path.append(entry)
    module, _, name = request["target"].partition(":")
    fn = getattr(importlib.import_module(module), name)
    folder = Path(request_path).parent
    for offset, item in enumerate(request["items"]):
        index = request["first"] + offset
        step("starting")
        try:
            value: tuple[bool, Any] = (True, fn(item, **request["common"]))
            payload = pickle.dumps(value)
        except Exception as exc:
            payload = pickle.dumps(
                (
                    False,
                    _Raised(
                        type(exc).__module__,
                        type(exc).__qualname__,
                        str(exc),
                        bool(getattr(exc, "transient", False)),
                        traceback.format_exc()[-4000:],
                    ),
                )
            )
        tmp = folder / f".{index}.pkl.tmp"
        tmp.write_bytes(payload)
        os.replace(tmp, folder / f"{index}.pkl")
    return 0


if __name__ == "__main__":
    # the importable module, not ``__main__``: what it pickles must unpickle in the parent
    from graphtrim import lazy_sympy
    from graphtrim.isolation import _child as child

    lazy_sympy.install()  # onnx_ir without sympy, as in the command line
    if sys.argv[1:] == ["--serve"]:
        from graphtrim import forkserver

        sys.exit(forkserver.serve(child))
    sys.exit(child(sys.argv[1]))
