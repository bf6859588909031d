"""Named fault points: places in the stages where a fault test stops the real process.

A stage calls :func:`point` with a name (``register.create_version.after``, ...) just before or
after a write that a failure could split. In production nothing is set and the call is one
dictionary look-up. A fault test names one point in ``$GRAPHTRIM_FAULT_POINT`` for the stage
process it starts (read once per process) and what happens there in
``$GRAPHTRIM_FAULT_ACTION``:

- ``pause:<folder>``: write ``<folder>/hit`` (the point's name), then wait until
  ``<folder>/go`` exists: the test injects its fault (restarts the database, kills the tracking
  server, fills the disk) while the stage stands at the point, then lets it go on;
- ``kill``: the process ends at once with SIGKILL, as a worker killed there would.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path

POINT_ENV = "GRAPHTRIM_FAULT_POINT"
ACTION_ENV = "GRAPHTRIM_FAULT_ACTION"
PAUSE_LIMIT = 900.0  # seconds a paused point waits for its go before going on alone


@functools.cache
def _armed() -> tuple[str, str] | None:
    name = os.environ.get(POINT_ENV, "").strip()
    if not name:
        return None
    return name, os.environ.get(ACTION_ENV, "kill").strip()


def point(name: str) -> None:
    """Fault point ``name``: nothing unless this process was started with it armed."""
    armed = _armed()
    if armed is None or armed[0] != name:
        return
    action = armed[1]
    if action.startswith("pause:"):
        folder = Path(action.removeprefix("pause:"))
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hit").write_text(name)
        end = time.monotonic() + PAUSE_LIMIT
        while not (folder / "go").exists() and time.monotonic() < end:
            time.sleep(0.1)
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise ValueError(f"${ACTION_ENV}: unknown action '{action}' (pause:<folder> or kill)")
