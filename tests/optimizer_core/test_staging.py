"""Stage scratch folders left by a killed process are removed by the next stage on the host."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.slow  # imports MLflow
def test_a_serving_probe_killed_at_its_timeout_leaves_its_folder_to_the_next_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The serving check runs in a child that is killed at --child-timeout: its copy of the
    model in the temporary folder is removed by the next probe on the host."""
    import tempfile

    import onnx
    from onnx import TensorProto, helper

    from graphtrim.integrations.serving import serving_probe

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    left = tmp_path / f"graphtrim-serving-{_dead_pid()}@{socket.gethostname()}~abc123"
    (left / "model").mkdir(parents=True)
    (left / "model" / "model.onnx").write_bytes(b"x" * 1024)
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    model = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model)
    checked = serving_probe(model)
    assert checked["outputs"] == {"y": [1, 4]}, checked
    assert not left.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("graphtrim-")] == []
