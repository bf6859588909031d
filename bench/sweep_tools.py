"""How the sweep runs the tools: a child's environment and its scratch folder outside the
checkout, a timed fresh process, and the anchors in one long-lived worker (their versions, and
each run on a model with the nodes, bytes, parity and operator domains of its output)."""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.__main__ import count_nodes, model_bytes, parity
from bench.sweep_render import ANCHORS

REPO = Path(__file__).resolve().parent.parent


def _child_env() -> dict[str, str]:
    """The environment of a tool run by the sweep: bench importable from anywhere."""
    path = os.environ.get("PYTHONPATH")
    return dict(
        os.environ,
        PYTHONWARNINGS="ignore",
        PYTHONPATH=f"{REPO}{os.pathsep}{path}" if path else str(REPO),
    )


def _scratch() -> Path:
    """The working directory of the tools run by the sweep: some write scratch files into it
    (onnxruntime's symbolic shape inference leaves ``sym_shape_infer_temp.onnx`` and its
    external data there when it gives up), which must not land in the checkout."""
    import tempfile

    global _SCRATCH
    if _SCRATCH is None or not _SCRATCH.is_dir():
        _SCRATCH = Path(tempfile.mkdtemp(prefix="graphtrim-sweep-"))
    return _SCRATCH


_SCRATCH: Path | None = None


class AnchorWorker:
    """``python -m bench.worker --serve`` in the background; restarted after a crash or a
    timeout (an anchor that hangs or takes the process down fails that model only)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None

    def _start(self) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "bench.worker", "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=_scratch(),
            env=_child_env(),
        )

    def run(self, tool: str, src: Path, dst: Path, timeout: float) -> dict[str, Any]:
        dst.unlink(missing_ok=True)
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps({"tool": tool, "src": str(src), "dst": str(dst)}) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        line = ""
        while not line.startswith("{"):
            ready, _, _ = select.select([self.proc.stdout], [], [], deadline - time.monotonic())
            line = self.proc.stdout.readline() if ready else ""
            if not line:
                break
        if not line:
            crashed = self.proc.poll()
            self.close()
            return {
                "ok": False,
                "error": f"crashed (exit {crashed})"
                if crashed is not None
                else f"timeout after {timeout:.0f} s",
            }
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def _wall(cmd: list[str], timeout: float) -> tuple[float, subprocess.CompletedProcess[str] | None]:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=_child_env(), cwd=_scratch()
        )
    except subprocess.TimeoutExpired:
        return timeout, None
    return time.perf_counter() - t0, proc


def _dim_args(dims: dict[str, int]) -> list[str]:
    return [a for name, size in dims.items() for a in ("--dim", f"{name}={size}")]


def anchor_versions() -> dict[str, str]:
    """The anchors' package versions: their kept results are reused only under the same ones."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("onnxsim", "onnxslim", "onnxoptimizer", "onnxruntime", "onnxscript", "onnx"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


def node_domains(path: Path) -> set[str]:
    """The operator domains the model's nodes use (subgraphs included; '' is the standard one)."""
    import onnx

    from graphtrim.modelio.protos import all_nodes

    graph = onnx.load(str(path), load_external_data=False).graph
    return {node.domain if node.domain != "ai.onnx" else "" for node in all_nodes(graph)}


def run_anchors(
    src: Path,
    work: Path,
    worker: AnchorWorker,
    dims: dict[str, int],
    args: argparse.Namespace,
    key: str,
) -> dict[str, Any]:
    """Each anchor on ``src`` in the worker; nodes, bytes and parity of each output, and the
    operator domains it adds (an output in onnxruntime's contrib ops is no portable model)."""
    anchors: dict[str, Any] = {}
    before = node_domains(src)
    for tool in ANCHORS:
        out = work / f"{key}.{tool}.onnx"
        r = worker.run(tool, src, out, args.timeout)
        if r.get("ok") and out.exists():
            r.update(nodes=count_nodes(out), bytes=model_bytes(out))
            r["domains_added"] = sorted(node_domains(out) - before)
            r.update(parity(src, out, dims))
        anchors[tool] = r
        if not args.keep:
            out.unlink(missing_ok=True)
    return anchors
