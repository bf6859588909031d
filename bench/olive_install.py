"""Olive's own environment: installing Olive 0.13 and the dependencies the project lacks into
``bench/.olive`` (never into the project's environment), and the environment its processes run
with (offline, no telemetry, caches in the run's scratch folder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

OLIVE_DIR = Path(__file__).parent / ".olive"


# Olive itself and the dependencies the project does not have, at the versions tried here.
OLIVE_PINS = (
    "olive-ai==0.13.0",
    "optuna==5.1.0",
    "questionary==2.1.1",
    "torchmetrics==1.9.0",
    "lightning-utilities==0.15.3",
)


# Modules Olive 0.13 needs to run these commands, and the distribution each comes from.
_REQUIRED = {
    "olive": "olive-ai==0.13.0",
    "optuna": "optuna==5.1.0",
    "questionary": "questionary==2.1.1",
    "torchmetrics": "torchmetrics==1.9.0",
    "lightning_utilities": "lightning-utilities==0.15.3",
    "onnx": "onnx",
    "onnxruntime": "onnxruntime",
    "onnxscript": "onnxscript",
    "onnx_ir": "onnx-ir",
    "torch": "torch",
    "transformers": "transformers",
    "pydantic": "pydantic",
    "pandas": "pandas",
    "yaml": "pyyaml",
    "sqlalchemy": "sqlalchemy",
    "alembic": "alembic",
    "colorlog": "colorlog",
    "prompt_toolkit": "prompt-toolkit",
    "psutil": "psutil",
    "tqdm": "tqdm",
    "hf_xet": "hf-xet",
    "opentelemetry.sdk": "opentelemetry-sdk",
}


# Installed into OLIVE_DIR when missing from both; never into the project's environment.
_INSTALLABLE = {
    "olive",
    "optuna",
    "questionary",
    "torchmetrics",
    "lightning_utilities",
    "colorlog",
    "hf_xet",
}


def _missing_modules() -> list[str]:
    code = (
        "import importlib.util, json, sys\n"
        f"names = {sorted(_REQUIRED)!r}\n"
        "missing = []\n"
        "for n in names:\n"
        "    try:\n"
        "        ok = importlib.util.find_spec(n) is not None\n"
        "    except Exception:\n"
        "        ok = False\n"
        "    if not ok:\n"
        "        missing.append(n)\n"
        "print(json.dumps(missing))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=_env(None), capture_output=True, text=True, timeout=120
    )
    if proc.returncode != 0:
        raise RuntimeError(f"cannot check Olive's modules: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ensure_installed() -> None:
    """Install Olive 0.13 and its missing dependencies into OLIVE_DIR (``pip --target --no-deps``).

    The project's environment is never changed. Raises RuntimeError when a module is still
    missing afterwards, or when one that only the project's environment can provide is absent.
    """
    missing = _missing_modules()
    if not missing:
        return
    not_ours = [m for m in missing if m not in _INSTALLABLE]
    if not_ours:
        raise RuntimeError(
            "Olive 0.13 needs modules that the project's environment lacks: "
            + ", ".join(f"{m} ({_REQUIRED[m]})" for m in not_ours)
        )
    pins = sorted(
        {_REQUIRED[m] for m in missing} | ({"olive-ai==0.13.0"} if "olive" in missing else set())
    )
    cmd = [
        sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade",
        "--target", str(OLIVE_DIR), *pins,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"installing {' '.join(pins)} into {OLIVE_DIR} failed: {proc.stderr.strip()[-1000:]}"
        )
    still = _missing_modules()
    if still:
        raise RuntimeError(
            f"Olive's modules still missing after installing into {OLIVE_DIR}: {', '.join(still)}"
        )


def _env(tmp: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(OLIVE_DIR.resolve()), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        OLIVE_DISABLE_TELEMETRY="1",
        # Olive's telemetry is switched off before its start-up heartbeat only in "CI"
        CI="1",
        PYTHONUNBUFFERED="1",
    )
    if tmp is not None:
        env.update(
            HF_HOME=str(tmp / "hf"),
            XDG_CACHE_HOME=str(tmp / "xdg"),
            OLIVE_TELEMETRY_CACHE_DIR=str(tmp / "telemetry"),
            MPLCONFIGDIR=str(tmp / "matplotlib"),
            TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"),
        )
    return env
