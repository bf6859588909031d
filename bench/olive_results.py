"""Reading what an Olive run left behind: the phases and the error in its log, the output model it
wrote, and its footprint's summary (the metrics, the Pareto frontier and the chain of passes of
the best model)."""

from __future__ import annotations

import contextlib
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")


def _stamp(line: str) -> float | None:
    m = _STAMP.match(line)
    if not m:
        return None
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _phases(lines: list[str], start: float, end: float) -> dict[str, float | None]:
    """Start-up (imports, config) / engine / exit, from Olive's INFO log time stamps."""
    begin = finish = None
    for line in lines:
        if begin is None and "Running workflow" in line:
            begin = _stamp(line)
        if "Saved output model" in line or "Run history for" in line:
            finish = _stamp(line) or finish
    return {
        "startup_seconds": round(begin - start, 3) if begin else None,
        "engine_seconds": round(finish - begin, 3) if begin and finish else None,
        "exit_seconds": round(end - finish, 3) if finish else None,
    }


def _error_of(lines: list[str]) -> str | None:
    """The last exception line of a traceback in Olive's log."""
    pat = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)|AssertionError)\b.*")
    for line in reversed(lines):
        if pat.match(line.strip()):
            return line.strip()
    return None


def _find_output(out: Path) -> Path | None:
    """The final model Olive saved under ``out``: model_config.json's path, else model.onnx, else newest .onnx."""
    cfg = out / "model_config.json"
    if cfg.is_file():
        try:
            c = json.loads(cfg.read_text()).get("config", {})
            p = Path(c.get("model_path") or "")
            if c.get("onnx_file_name") and p.is_dir():
                p = p / c["onnx_file_name"]
            if p.is_dir():
                onnx_files = sorted(p.glob("*.onnx"))
                p = onnx_files[0] if len(onnx_files) == 1 else Path("")
            if p.suffix == ".onnx" and p.is_file():
                return p.resolve()
        except (OSError, ValueError, AttributeError):
            pass
    if (out / "model.onnx").is_file():
        return (out / "model.onnx").resolve()
    found = [p for p in out.rglob("*.onnx") if "olive-cli-tmp" not in str(p)]
    return max(found, key=lambda p: p.stat().st_mtime).resolve() if found else None


def _footprint_summary(out: Path) -> dict[str, Any]:
    """Metrics of the input and of the output model, and the quantization settings it came from."""
    summary: dict[str, Any] = {}
    inp = out / "input_model_metrics.json"
    if inp.is_file():
        with contextlib.suppress(ValueError, AttributeError):
            summary["input_metrics"] = {
                k: v.get("value") for k, v in json.loads(inp.read_text()).items()
            }
    try:
        nodes = json.loads((out / "footprint.json").read_text())  # {model_id: node}
    except (OSError, ValueError):
        return summary
    evaluated = [
        n
        for n in nodes.values()
        if (n.get("metrics") or {}).get("value") and n.get("parent_model_id")
    ]
    frontier = [n for n in evaluated if n.get("is_pareto_frontier")]
    summary["models_evaluated"] = len(evaluated)
    summary["frontier_size"] = len(frontier)

    def rank(node: dict) -> tuple:  # Olive's own order: objectives in priority order, best first
        m = node["metrics"]
        return tuple(m["value"][k]["value"] * d for k, d in (m.get("cmp_direction") or {}).items())

    if frontier:
        best = max(frontier, key=rank)
        summary["output_metrics"] = {k: v.get("value") for k, v in best["metrics"]["value"].items()}
        chain = []
        node = best
        while node and node.get("from_pass"):
            cfg = {
                k: v
                for k, v in (node.get("pass_run_config") or {}).items()
                # a search parameter left in the config is one this sample did not use
                if v is not None
                and k not in ("data_config", "user_script", "script_dir")
                and not (isinstance(v, dict) and "olive_parameter_type" in v)
            }
            chain.append({"pass": node["from_pass"], "config": cfg})
            node = nodes.get(node.get("parent_model_id") or "")
        summary["passes"] = chain[::-1]
        settings = ((best.get("model_config_data") or {}).get("config") or {}).get(
            "inference_settings"
        )
        summary["inference_settings"] = settings
    return summary
