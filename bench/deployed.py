"""What the benchmarks that run a whole deployment (``bench.scale``, ``bench.tune_pool``) share:
setting up their process and the work folder the deployment's logs go to."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path


def deployment_work(prefix: str) -> Path:
    """MLflow's telemetry off, SIGTERM unwinding like Ctrl-C (the deployment's processes
    stopped, its databases dropped), and a fresh work folder, named on stderr."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix=prefix))
    print(f"work folder (deployment logs): {work}", file=sys.stderr, flush=True)
    return work
