"""What the demo's terminal shows: graphtrim's own progress lines, the table and the links.

Everything else the demo's libraries print (Airflow's task logs and warnings, MLflow's download
bars and database migrations, onnxruntime's and PyTorch's warnings, child processes) goes to a
log file: the console redirects the process's own standard output and error (the file
descriptors, so child processes inherit it) and writes its lines to the terminal it saved.
A step that takes more than a few seconds shows a progress bar on a terminal (redrawn in place,
so it is one line); written to a file or a pipe the console prints only whole lines.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

BAR_AFTER_S = 3.0  # a step shows its progress bar once it has taken this long
BAR_WIDTH = 24


class Console:
    """The demo's terminal while the block runs (``with Console(log) as console``)."""

    def __init__(self, log_path: str | os.PathLike[str], terminal: IO[str] | None = None):
        self.log_path = Path(log_path)
        self._terminal = terminal
        self.out: IO[str] = terminal or sys.stdout
        self.lines = 0  # lines written to the terminal
        self._saved: tuple[int, int] | None = None
        self._log: IO[str] | None = None
        self._lock = threading.Lock()
        self._status = ""  # the progress bar on screen, if any

    @property
    def tty(self) -> bool:
        return bool(getattr(self.out, "isatty", lambda: False)())

    def __enter__(self) -> Console:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "a", buffering=1)  # closed in __exit__
        sys.stdout.flush()
        sys.stderr.flush()
        if self._terminal is None:
            # the terminal is a copy of the original descriptor; 1 and 2 now go to the log
            self.out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
        self._saved = (os.dup(1), os.dup(2))
        os.dup2(self._log.fileno(), 1)
        os.dup2(self._log.fileno(), 2)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._clear_status()
        sys.stdout.flush()
        sys.stderr.flush()
        if self._saved is not None:
            os.dup2(self._saved[0], 1)
            os.dup2(self._saved[1], 2)
            for fd in self._saved:
                os.close(fd)
            self._saved = None
        if self._log is not None:
            self._log.close()
        if self._terminal is None:
            self.out.close()
            self.out = sys.stdout

    def line(self, text: str = "") -> None:
        """``text`` on the terminal (each of its lines), and in the log."""
        with self._lock:
            self._clear_status()
            for one in text.splitlines() or [""]:
                self.out.write(one + "\n")
                self.lines += 1
                if self._log is not None:
                    self._log.write(f"[demo] {one}\n")
            self.out.flush()
            if self._status and self.tty:
                self._draw(self._status)

    def status(self, text: str) -> None:
        """A line that replaces itself (the progress bar); on a terminal only."""
        with self._lock:
            self._status = text
            if self.tty:
                self._draw(text)

    def _draw(self, text: str) -> None:
        self.out.write("\r\033[K" + text)
        self.out.flush()

    def _clear_status(self) -> None:
        if self._status and self.tty:
            self.out.write("\r\033[K")
            self.out.flush()

    def end_status(self) -> None:
        with self._lock:
            self._clear_status()
            self._status = ""

    @contextlib.contextmanager
    def step(
        self, what: str, fraction: Callable[[], tuple[float, str]] | None = None
    ) -> Iterator[dict[str, str]]:
        """``what`` as one line when it is done, with its time (and what the block put in the
        yielded dict under ``"done"``); while it runs for more than :data:`BAR_AFTER_S`, a
        progress bar on a terminal: ``fraction()`` gives (done in [0, 1], a note), else the
        bar shows the time only."""
        result: dict[str, str] = {}
        started = time.perf_counter()
        stop = threading.Event()

        def draw() -> None:
            while not stop.wait(0.5):
                elapsed = time.perf_counter() - started
                if elapsed < BAR_AFTER_S:
                    continue
                done, note = fraction() if fraction is not None else (-1.0, "")
                self.status(progress_bar(what, elapsed, done, note))

        painter = threading.Thread(target=draw, daemon=True)
        painter.start()
        try:
            yield result
        finally:
            stop.set()
            painter.join()
            self.end_status()
        took = time.perf_counter() - started
        self.line(f"{what}: {result.get('done', 'done')} ({took:.1f} s)")


def progress_bar(what: str, elapsed: float, done: float = -1.0, note: str = "") -> str:
    """``what [#####-------] note  12 s``; with ``done`` below 0 (unknown), a bar that moves."""
    if done < 0:
        pos = int(elapsed * 2) % BAR_WIDTH
        bar = "".join("#" if abs(i - pos) < 3 else "-" for i in range(BAR_WIDTH))
    else:
        full = round(min(1.0, done) * BAR_WIDTH)
        bar = "#" * full + "-" * (BAR_WIDTH - full)
    return f"{what} [{bar}] {note}  {elapsed:.0f} s".rstrip()
