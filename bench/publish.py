"""Where a benchmark result was measured, and the published copy the documentation reads.

Every benchmark writes its JSON as an envelope::

    {"bench": NAME, "provenance": {machine, date, commit, command}, "args": {...},
     "results": <the bench's own results>}

``provenance`` says what the numbers are of: the machine (CPU model and count, memory, OS,
Python and the runtime versions), the date (UTC) and the commit of the source measured (with
``dirty`` when the measured code, :data:`MEASURED`, differed from that commit). With ``--publish`` the same file is also written to
``docs/benchmarks/data/NAME.json``, which is committed: the benchmark pages of the documentation
are rendered from those files at build time (``bench.pages``), never typed by hand.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "docs" / "benchmarks" / "data"
# what the numbers depend on: a change here (not in the documentation, say) makes a result "dirty"
MEASURED = ("optimizer_core", "operators", "dags", "bench", "pyproject.toml", "constraints.txt")


def parser(doc: str | None, prog: str | None = None) -> argparse.ArgumentParser:
    """A benchmark's parser, whose help shows ``doc`` (its module's docstring) as written."""
    return argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def add_publish_argument(parser: argparse.ArgumentParser) -> None:
    """The ``--publish`` switch every benchmark takes."""
    parser.add_argument(
        "--publish",
        action="store_true",
        help="also write the results, with machine, date and commit, to "
        "docs/benchmarks/data/ (the JSON the documentation's benchmark pages are built from)",
    )


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError):
        pass
    return None


def _versions() -> dict[str, str]:
    from importlib import metadata

    found = {}
    for package in ("graphtrim", "onnx", "onnxruntime", "onnx-ir", "numpy", "torch"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return found


def machine() -> dict[str, Any]:
    """The hardware and software the numbers were measured on."""
    from graphtrim.gates.fingerprint import cpu_model, usable_cpus

    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_usable": usable_cpus(),
        "memory_gib": _memory_gib(),
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "versions": _versions(),
    }


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat()


def _source() -> dict[str, Any]:
    """The commit checked out and whether the measured code differs from it."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no", "--", *MEASURED)
    return {
        "date": _now(),
        "commit": commit,
        "dirty": bool(status) if status is not None else None,
        "load": _load(),
    }


def _load() -> list[float] | None:
    """The machine's load averages (1, 5, 15 minutes): how busy it was besides the benchmark."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# taken when a benchmark starts (it imports this module first): the code that ran is the code
# checked out then, whatever is committed while it runs
_STARTED = _source()


def provenance() -> dict[str, Any]:
    """Machine, date and commit of the measurement this process is taking: the date and commit
    as they were when it started, and when it finished."""
    return {
        "machine": machine(),
        **_STARTED,
        "finished": _now(),
        "load_at_finish": _load(),
        "command": " ".join(["python -m " + _module_name(), *sys.argv[1:]]),
    }


def _module_name() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name.removesuffix(".__main__") if spec is not None else "bench"


def envelope(name: str, results: Any, args: argparse.Namespace | None = None) -> dict[str, Any]:
    """``results`` of benchmark ``name`` with where and how they were measured."""
    given = {k: _in_repo(v) for k, v in vars(args).items() if k != "publish"} if args else {}
    return {
        "bench": name,
        "provenance": provenance(),
        "args": json.loads(json.dumps(given, default=str)),
        "results": results,
    }


def _in_repo(value: Any) -> Any:
    """A path argument inside the checkout, relative to it: the published JSON names no folder
    of the machine it was measured on."""
    if isinstance(value, Path) or (isinstance(value, str) and Path(value).is_absolute()):
        try:
            return Path(value).resolve().relative_to(REPO).as_posix()
        except (ValueError, OSError):
            return str(value)
    return value


def write(
    path: Path,
    name: str,
    results: Any,
    args: argparse.Namespace | None = None,
    *,
    publish: bool = False,
    public: Any = None,
) -> dict[str, Any]:
    """Write ``results`` as an envelope to ``path`` (and with ``publish`` to the documentation's
    data folder as ``NAME.json``: ``public`` there where given, a summary of what a page shows
    in place of every record), each file written whole or not at all."""
    doc = envelope(name, results, args)
    _write_json(Path(path), doc)
    if publish:
        shown = doc if public is None else {**doc, "results": public}
        _write_json(DATA / f"{name}.json", shown)
        print(f"published: {DATA / f'{name}.json'}", file=sys.stderr)
    return doc


def _write_json(target: Path, doc: dict[str, Any]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    os.replace(tmp, target)


def read(path: Path) -> dict[str, Any]:
    """A published result (an envelope)."""
    return dict(json.loads(Path(path).read_text()))
