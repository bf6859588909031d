"""Microsoft Olive 0.13 on a local ONNX file, offline, on CPU, in a fresh process.

``python -m bench.olive MODEL.onnx OUT --calibration C.npz [--data D.npz]`` runs both and prints
their results as JSON. Olive is installed into ``bench/.olive`` with ``pip --target --no-deps`` on
first use (its other dependencies are the project's: onnx, onnxruntime, onnxscript, onnx-ir, torch,
transformers, pydantic, pandas, sqlalchemy, alembic...) and runs as ``python -m olive`` with that
folder on ``PYTHONPATH``; every cache (Hugging Face, XDG, Olive's own) goes to a temporary folder
and the hub is switched off.

* :func:`run_auto_opt`: ``olive auto-opt --precision int8`` (CPUExecutionProvider). On an ONNX
  input it runs OnnxPeepholeOptimizer, OrtTransformersOptimization (skipped by Olive for a model
  type it does not know) and OnnxDynamicQuantization; it takes no calibration data for an ONNX
  model (its ``--data_name`` is for Hugging Face datasets and is not used by the command).
  ``olive optimize --precision int8`` is no alternative offline: it calibrates static
  quantization on wikitext-2 from the hub whatever the model.
* :func:`run_workflow`: ``olive run --config`` with a joint search (TPE by default) over
  OnnxQuantization's own space (dynamic or static, QDQ or QOperator, per channel, reduce range,
  calibration method, preprocessing; OnnxDynamicQuantization when no calibration is given),
  followed by OrtSessionParamsTuning, ranked by top-1 agreement with the fp32 model's outputs on
  ``data`` (priority 1, with a goal) and then by average latency. Data comes from ``.npz`` files
  (one array per model input, samples on the first axis) through a generated user script that
  registers an Olive dataset.

Worked around in Olive 0.13 (with pydantic 2.14):

* ``search_strategy.sampler_config`` (hence ``max_samples`` and ``seed``) is lost when the engine
  config is dumped (the field is typed as the base config class), so the search would be
  exhaustive: the sample count is bounded with ``max_iter`` (and ``max_time``) instead;
* a pass output loaded from Olive's cache inside a run fails (``"FootprintNode" object has no
  field "model_config"``), so every searched step after the first fails when a pass without
  searched parameters comes before the searched one: the searched workflow starts with the
  quantization pass (its ``quant_preprocess`` already runs shape inference and onnxruntime's
  optimizer), and each run has a fresh cache;
* a ``custom`` metric cannot be serialized (``backend`` None), and an evaluator without
  ``type`` breaks resource discovery: the fidelity metric is a ``torch_metrics`` accuracy on
  argmax labels and the evaluator is typed ``OnnxEvaluator``;
* ``--disable_telemetry`` and ``OLIVE_DISABLE_TELEMETRY`` act after the start-up heartbeat is
  queued, and without a network its flush holds the exit for about 10 s: ``CI=1`` (Olive's own
  CI detection) turns telemetry off before it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.olive_install import (
    _env,
    ensure_installed,
)
from bench.olive_results import _error_of, _find_output, _footprint_summary, _phases
from bench.olive_workflow import (
    _USER_SCRIPT,
    _USER_SCRIPT_TEXT,
    _random_inputs,
    _reference_labels,
    workflow_config,
)

LOG_TAIL = 40
_MARKER = ".bench-olive"


# ----------------------------------------------------------------------------- process


def _prepare_out(out: Path) -> Path:
    """An empty output folder; one left by an earlier call (it has our marker) is emptied."""
    out = Path(out).resolve()
    if out.exists():
        if not out.is_dir():
            raise ValueError(f"{out} is not a folder")
        if any(out.iterdir()):
            if not (out / _MARKER).exists():
                raise ValueError(
                    f"{out} is not empty and was not written by bench.olive; give an empty folder"
                )
            shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / _MARKER).write_text("written by bench/olive.py; emptied on the next run\n")
    return out


def _run(cmd: list[str], out: Path, tmp: Path, timeout: float) -> dict[str, Any]:
    log_path = out / "olive.log"
    work = tmp / "work"  # the CLI puts .olive-cache in its working folder
    work.mkdir(parents=True, exist_ok=True)
    error = None
    start = time.time()
    t0 = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=work,
            env=_env(tmp),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
            error = f"timed out after {timeout:g} s"
    seconds = time.perf_counter() - t0
    end = time.time()
    lines = log_path.read_text(errors="replace").splitlines()
    output = _find_output(out) if rc == 0 else None
    if rc is not None and rc != 0:
        error = _error_of(lines) or f"olive exited with {rc}"
    elif rc == 0 and output is None:
        warn = [ln for ln in lines if "no expected candidates" in ln or "No output model" in ln]
        error = "Olive produced no output model" + (f": {warn[-1].strip()}" if warn else "")
    return {
        "ok": rc == 0 and output is not None,
        "seconds": round(seconds, 3),
        "output": str(output) if output else None,
        "error": error,
        "command": cmd,
        "log_tail": lines[-LOG_TAIL:],
        "returncode": rc,
        "log": str(log_path),
        **_phases(lines, start, end),
    }


def _existing(path: Path | None, what: str) -> Path | None:
    if path is None:
        return None
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    return path


# ----------------------------------------------------------------------------- auto-opt


def run_auto_opt(
    model: Path,
    out: Path,
    *,
    calibration: Path | None = None,
    timeout: float = 600.0,
    precision: str = "int8",
) -> dict:
    """``olive auto-opt`` on an ONNX file for CPUExecutionProvider, output under ``out``.

    ``calibration`` is accepted for symmetry but not used: auto-opt on an ONNX model quantizes
    dynamically (OnnxDynamicQuantization) and has no way to take local calibration data.
    """
    model = _existing(model, "model")
    ensure_installed()
    out = _prepare_out(out)
    with tempfile.TemporaryDirectory(prefix="bench-olive-") as tmp:
        cmd = [
            sys.executable, "-m", "olive", "auto-opt",
            "-m", str(model), "-o", str(out),
            "--device", "cpu", "--provider", "CPUExecutionProvider",
            "--precision", precision, "--log_level", "1", "--disable_telemetry",
        ]  # fmt: skip
        res = _run(cmd, out, Path(tmp), timeout)
    res["calibration_used"] = False
    if calibration is not None:
        res["note"] = (
            "auto-opt takes no local calibration data for an ONNX model; it quantizes dynamically"
        )
    return res


# ----------------------------------------------------------------------------- workflow


def run_workflow(
    model: Path,
    out: Path,
    *,
    calibration: Path | None = None,
    data: Path | None = None,
    max_samples: int = 8,
    timeout: float = 600.0,
    sampler: str = "tpe",
    accuracy_drop: float = 0.05,
) -> dict:
    """``olive run --config`` with a joint search of at most ``max_samples`` quantization settings.

    ``calibration``: .npz for static quantization (without it only dynamic quantization is
    searched). ``data``: .npz for the fidelity metric, top-1 agreement of the first output with
    the fp32 model (labels computed here before the clock starts); ``calibration`` is used when
    it is None, and with neither the search ranks by latency alone on random inputs.
    ``accuracy_drop``: the agreement goal (max-degradation), below which Olive keeps no model.
    """
    model = _existing(model, "model")
    calibration = _existing(calibration, "calibration data")
    data = _existing(data, "data") or calibration
    ensure_installed()
    out = _prepare_out(out)
    with tempfile.TemporaryDirectory(prefix="bench-olive-") as tmp_name:
        tmp = Path(tmp_name)
        (out / _USER_SCRIPT).write_text(_USER_SCRIPT_TEXT)
        t0 = time.perf_counter()
        labels = num_classes = None
        if data is not None:
            labels = out / "labels.npz"
            num_classes = _reference_labels(model, data, labels)
        if calibration is None and data is None:
            _random_inputs(model, out / "random_inputs.npz")
        prep = time.perf_counter() - t0
        cfg = workflow_config(
            model, out, tmp / "cache",
            calibration=calibration, data=data, labels=labels, num_classes=num_classes or 2,
            max_samples=max_samples, sampler=sampler, accuracy_drop=accuracy_drop,
            max_time=max(1, int(timeout * 0.6)),
        )  # fmt: skip
        cfg_path = out / "olive_config.json"
        cfg_path.write_text(json.dumps(cfg, indent=2))
        cmd = [
            sys.executable,
            "-m",
            "olive",
            "run",
            "--config",
            str(cfg_path),
            "--disable_telemetry",
        ]
        res = _run(cmd, out, tmp, timeout)
    lines = Path(res["log"]).read_text(errors="replace").splitlines()
    res["samples"] = sum("with search point" in ln for ln in lines)
    res["failed_samples"] = sum(ln.rstrip().endswith("... FAILED.") for ln in lines)
    res["prep_seconds"] = round(prep, 3)
    res["config"] = str(cfg_path)
    res["accuracy_data"] = str(data) if data else None
    res.update(_footprint_summary(out))
    return res


# ----------------------------------------------------------------------------- checks, CLI


def loads_in_onnxruntime(path: str | Path | None) -> bool | str:
    """True when onnxruntime opens the model on CPU, else the error's first line."""
    if not path:
        return "no model"
    try:
        import onnxruntime as ort

        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return True
    except Exception as exc:  # reported, not handled
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.olive", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument(
        "out", type=Path, help="folder for the two runs (auto-opt/ and workflow/ under it)"
    )
    ap.add_argument("--calibration", type=Path)
    ap.add_argument("--data", type=Path)
    ap.add_argument("--max-samples", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--sampler", default="tpe", choices=["tpe", "random", "sequential"])
    ap.add_argument("--only", choices=["auto-opt", "workflow"])
    args = ap.parse_args(argv)
    results: dict[str, Any] = {}
    if args.only in (None, "auto-opt"):
        r = run_auto_opt(
            args.model, args.out / "auto-opt", calibration=args.calibration, timeout=args.timeout
        )
        r["loads_in_onnxruntime"] = loads_in_onnxruntime(r["output"])
        results["auto_opt"] = r
    if args.only in (None, "workflow"):
        r = run_workflow(
            args.model, args.out / "workflow",
            calibration=args.calibration, data=args.data, max_samples=args.max_samples,
            timeout=args.timeout, sampler=args.sampler,
        )  # fmt: skip
        r["loads_in_onnxruntime"] = loads_in_onnxruntime(r["output"])
        results["workflow"] = r
    print(json.dumps(results, indent=2, default=str))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
