"""Stage scratch folders that outlive nothing: each is named after the process that owns it
(``graphtrim-<stage>-<pid>@<host>~<random>``), and a new one first removes those of this host
whose process is gone (a task killed by the orchestrator, a worker lost to SIGKILL or the
kernel's OOM killer never ran its clean-up). Folders of live processes, of other hosts sharing
the folder and of other users are left alone."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

_NAME = re.compile(r"^graphtrim-.+-(?P<pid>\d+)@(?P<host>.+)~[^~]+$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def sweep(folder: Path) -> list[Path]:
    """Remove the scratch folders in ``folder`` left by dead processes of this host and user;
    returns them."""
    host = socket.gethostname()
    removed = []
    with contextlib.suppress(OSError):
        for entry in folder.iterdir():
            m = _NAME.match(entry.name)
            if m is None or m["host"] != host or not entry.is_dir():
                continue
            with contextlib.suppress(OSError):
                if entry.stat().st_uid != os.getuid() or _alive(int(m["pid"])):
                    continue
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


@contextlib.contextmanager
def scratch(stage: str, workdir: str | None = None) -> Iterator[Path]:
    """A fresh folder for one stage's local files in ``workdir`` (default: the system's
    temporary folder), removed afterwards; the folders dead processes left there go first."""
    base = Path(workdir or tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    sweep(base)
    prefix = f"graphtrim-{stage}-{os.getpid()}@{socket.gethostname()}~"
    with tempfile.TemporaryDirectory(prefix=prefix, dir=base) as d:
        yield Path(d)
