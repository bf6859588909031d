"""``python -m bench.corpus`` (or ``make corpus``): build the generalization corpus.

Resumable: a model already in the manifest (built, or failed with its reason) is not built again
unless ``--retry-failed`` asks for the failures. Each export runs in its own process in the export
venv with a time limit; a file is written beside its final name and renamed when complete, so an
interrupted build leaves no half-written model. Failures are listed in the manifest with the reason
(the exception's last line), never dropped.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import publish
from bench.corpus import DEFAULT_DIR, EXPORT_ENVS, ROOT, Manifest, Spec, all_specs, describe

log = logging.getLogger("bench.corpus")
REPO = ROOT.parent.parent


def export_python(env: str = "torch") -> Path:
    """The interpreter of export environment ``env`` (:data:`bench.corpus.EXPORT_ENVS`), its
    venv created from its requirements file on first use (and again when the file changes)."""
    folder, requirements = EXPORT_ENVS[env]
    venv = REPO / folder
    req = ROOT / requirements
    python = venv / "bin" / "python"
    stamp = venv / ".installed"
    if stamp.exists() and stamp.read_text() == req.read_text():
        return python
    log.info("creating the export venv %s from %s", venv, req.name)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "-r", str(req)], check=True)
    stamp.write_text(req.read_text())
    return python


def _reason(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    # the exception line: the last line that looks like "SomeError: message"
    for ln in reversed(lines):
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b", ln):
            return ln[:300]
    return (lines[-1] if lines else "failed without a message")[:300]


def export_one(python: Path, sp: Spec, exporter: str, out: Path, timeout: int) -> dict[str, Any]:
    tmp = out.with_name(out.stem + ".part.onnx")
    tmp.unlink(missing_ok=True)
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        PYTHONWARNINGS="ignore",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        YOLO_OFFLINE="1",
        YOLO_CONFIG_DIR=str(out.parent / ".ultralytics"),
        TF_CPP_MIN_LOG_LEVEL="3",
    )
    cmd = [
        str(python),
        "-m",
        "bench.corpus.torch_export",
        sp.build,
        json.dumps(sp.kwargs()),
        exporter,
        str(tmp),
    ]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=out.parent
        )
    except subprocess.TimeoutExpired:
        tmp.unlink(missing_ok=True)
        return {"status": "failed", "reason": f"export took over {timeout} s"}
    if proc.returncode != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        return {"status": "failed", "reason": _reason(proc.stderr or proc.stdout)}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    info = json.loads(lines[-1]) if lines else {}
    os.replace(tmp, out)
    return {"status": "ok", **info}


def main(argv: list[str] | None = None) -> int:
    ap = publish.parser(__doc__, "python -m bench.corpus")
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="corpus directory")
    ap.add_argument("--families", nargs="*", help="only these families")
    ap.add_argument("--match", help="only models whose name matches this regular expression")
    ap.add_argument("--retry-failed", action="store_true", help="build failed models again")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per export")
    ap.add_argument("--list", action="store_true", help="print the specs and exit")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="corpus: %(message)s")

    specs = [
        s
        for s in all_specs()
        if (not args.families or s.family in args.families)
        and (not args.match or re.search(args.match, s.name))
    ]
    if args.list:
        for s in specs:
            print(f"{s.family:12} {s.name:40} {s.source:50} {','.join(s.exporters)}")
        print(f"{len(specs)} models, {sum(len(s.exporters) for s in specs)} exports")
        return 0
    args.dir.mkdir(parents=True, exist_ok=True)
    manifest = Manifest(args.dir)
    for key in manifest.prune({s.key(e) for s in all_specs() for e in s.exporters}):
        log.info("dropped %s: no spec describes it any more", key)
    todo = [(s, e) for s in specs for e in s.exporters]
    pythons: dict[str, Path] = {}
    t_start = time.monotonic()
    for i, (sp, exporter) in enumerate(todo, 1):
        key = sp.key(exporter)
        out = args.dir / f"{key}.onnx"
        old = manifest.entries.get(key)
        if old and old["status"] == "ok" and out.exists():
            continue
        if old and old["status"] == "failed" and not args.retry_failed:
            continue
        t0 = time.monotonic()
        if sp.derive:
            from bench.corpus.derived import derive

            try:
                result = {"status": "ok", **(derive(sp, exporter, manifest, out) or {})}
            except Exception as exc:  # a failed derivation is listed, not fatal
                out.unlink(missing_ok=True)
                result = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:300]}
        else:
            if sp.env not in pythons:
                pythons[sp.env] = export_python(sp.env)
            result = export_one(pythons[sp.env], sp, exporter, out, args.timeout)
        entry: dict[str, Any] = {
            "key": key,
            "name": sp.name,
            "family": sp.family,
            "source": sp.source,
            "exporter": exporter,
            "file": out.name,
            "export_seconds": round(time.monotonic() - t0, 1),
            **result,
        }
        if result["status"] == "ok":
            entry.update(describe(out))
        manifest.put(entry)
        log.info(
            "[%d/%d] %s %s %s (%.0f s, %.0f min in all)",
            i,
            len(todo),
            key,
            result["status"],
            f"{entry.get('nodes')} nodes" if result["status"] == "ok" else result["reason"],
            entry["export_seconds"],
            (time.monotonic() - t_start) / 60,
        )
    ok = sum(1 for _ in manifest.ok())
    failed = [e for e in manifest.entries.values() if e["status"] == "failed"]
    families = sorted({e["family"] for e in manifest.ok()})
    log.info(
        "%d models in %s (%d families: %s); %d exports failed",
        ok,
        manifest.path,
        len(families),
        ", ".join(families),
        len(failed),
    )
    for e in failed:
        log.info("  failed %s: %s", e["key"], e["reason"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
