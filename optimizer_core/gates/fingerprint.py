"""The hardware and software a measurement was taken on, recorded with every result."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from collections.abc import Sequence
from typing import Any


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; else what ``platform`` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cpus() -> int:
    """The CPUs this process may run on (every CPU where affinity is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 0


def _gpus() -> list[dict[str, str]]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2:
            gpus.append(
                {"name": parts[0], "driver": parts[1], "memory": parts[2] if len(parts) > 2 else ""}
            )
    return gpus


def fingerprint(
    *,
    providers: Sequence[str] = (),
    threads: int | None = None,
    data_digest: str | None = None,
    device: str | None = None,
) -> dict[str, Any]:
    import numpy
    import onnx
    import onnxruntime as ort

    from graphtrim import __version__

    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_usable": usable_cpus(),
        "machine": platform.machine(),
        "system": f"{platform.system()} {platform.release()}",
        "gpus": _gpus(),
        "python": platform.python_version(),
        "onnxruntime": ort.__version__,
        "onnx": onnx.__version__,
        "numpy": numpy.__version__,
        "graphtrim": __version__,
        "device": device,
        "execution_providers": list(providers),
        "available_providers": ort.get_available_providers(),
        "intra_op_threads": threads,
        "inter_op_threads": 1,
        "execution_mode": "sequential",
        "eval_data_sha256": data_digest,
    }


def fingerprint_digest(fp: dict[str, Any]) -> str:
    """A short digest of the hardware and software a measurement ran on: two latency numbers
    are comparable only when their digests agree. The evaluation data does not enter it."""
    import hashlib
    import json

    body = {k: v for k, v in fp.items() if k != "eval_data_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]
