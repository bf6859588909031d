"""Fatal signals inside a stage task: the default disposition restored around the stage, so
that a crash of the model's runtime ends the task process (and Airflow records a failure)
instead of a Python handler swallowing it; the stacks go to the task log."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any, TextIO

logger = logging.getLogger(__name__)

FATAL_SIGNALS = ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT")


def _fault_log() -> TextIO | None:
    """Where ``faulthandler`` writes the stacks: stderr (the task log under Airflow) when it is
    a real file descriptor."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            if stream is not None:
                stream.fileno()
                return stream
        except (AttributeError, OSError, ValueError):  # a captured or closed stream
            continue
    return None


@contextlib.contextmanager
def fatal_signals_end_the_process() -> Iterator[None]:
    """Within the block, a fatal signal (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) ends the
    process with that signal after ``faulthandler`` has written every thread's Python stack to
    stderr.

    Airflow's DAG parser installs a Python-level SIGSEGV handler in the task process and leaves
    it there. Python handlers run between bytecodes; after a real fault in native code the
    C-level part of such a handler returns to the faulting instruction, which faults again, for
    ever: the task process spins, still heartbeating, deaf to SIGTERM, and the task never ends
    (its ``execution_timeout`` is a Python-level SIGALRM handler too). With the default
    disposition restored the process dies, Airflow's supervisor sees it die and fails the task.

    The dispositions and ``faulthandler`` are put back as they were when the block ends. Outside
    the main thread (where handlers cannot be changed) the block runs as it is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = [getattr(signal, name) for name in FATAL_SIGNALS if hasattr(signal, name)]
    previous: dict[signal.Signals, Any] = {}
    was_enabled = faulthandler.is_enabled()
    # faulthandler re-raises a fatal signal with the handler it found when enabled: it must
    # find the default one, so it is (re-)enabled only after the defaults are back
    faulthandler.disable()
    for sig in signals:
        try:
            previous[sig] = signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError) as exc:  # not settable on this platform
            logger.debug("cannot reset %s: %s", sig.name, exc)
    out = _fault_log()
    if out is not None:
        faulthandler.enable(file=out, all_threads=True)
    try:
        yield
    finally:
        faulthandler.disable()
        if was_enabled and out is not None:
            faulthandler.enable(file=out, all_threads=True)
        for sig, handler in previous.items():
            if handler is not None:  # None: set outside Python, cannot be put back from here
                with contextlib.suppress(OSError, ValueError):
                    signal.signal(sig, handler)
