"""Stage scratch folders left by a killed process are removed by the next stage on the host."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from graphtrim.scratch import scratch, sweep


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return proc.pid


def test_a_killed_stage_s_folder_goes_with_the_next_stage_and_nothing_else(tmp_path: Path) -> None:
    host = socket.gethostname()
    dead = tmp_path / f"graphtrim-register-{_dead_pid()}@{host}~abc123"
    live = tmp_path / f"graphtrim-register-{os.getpid()}@{host}~def456"
    elsewhere = tmp_path / f"graphtrim-register-{_dead_pid()}@not-{host}~ghi789"
    other = tmp_path / "graphtrim-register-old_style"
    for folder in (dead, live, elsewhere, other):
        (folder / "sub").mkdir(parents=True)
        (folder / "sub" / "model.onnx").write_bytes(b"x")
    with scratch("promote", str(tmp_path)) as mine:
        assert mine.exists() and mine.name.startswith(f"graphtrim-promote-{os.getpid()}@")
        assert not dead.exists()
        assert live.exists() and elsewhere.exists() and other.exists()
    assert not mine.exists()
    assert sweep(tmp_path) == []
