"""The generalization corpus: real architectures from libraries' own model definitions, built with
random weights and exported offline (``python -m bench.corpus``, or ``make corpus``).

Every model is described by a :class:`Spec` (family, source, how to build it, which exporters to
try, which export environment runs it). Models are built and exported in export-only virtual
environments, one per framework stack (:data:`EXPORT_ENVS`): ``.venv-export`` for torch, timm,
torchvision, transformers, ultralytics and the classical-ML converters (timm and torchvision
need a newer torch than the project's); ``.venv-export-tf`` for TensorFlow, Keras and tf2onnx;
``.venv-export-paddle`` for PaddlePaddle and paddle2onnx (which pins its own onnx);
``.venv-export-sklearn`` for scikit-learn pipelines with skl2onnx, onnxmltools and CatBoost's own
exporter. Each is made from its ``requirements-export*.txt`` on first use and never touches the
project's environment. Models derived from other corpus models (quantized, fp16, other opsets,
external data) are made in the project's own environment. Everything lands in one directory with ``manifest.json``: one entry per model file
with its family, source, exporter, opset, node count, bytes and sha256, or the reason its export
failed. The sweep (``python -m bench.sweep``) reads the manifest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
DEFAULT_DIR = ROOT.parent / "corpus-models"
MANIFEST = "manifest.json"
# export environment -> (its venv under the repository root, its pinned requirements here)
EXPORT_ENVS: dict[str, tuple[str, str]] = {
    "torch": (".venv-export", "requirements-export.txt"),
    "tf": (".venv-export-tf", "requirements-export-tf.txt"),
    "paddle": (".venv-export-paddle", "requirements-export-paddle.txt"),
    "sklearn": (".venv-export-sklearn", "requirements-export-sklearn.txt"),
}


@dataclasses.dataclass(frozen=True)
class Spec:
    """One corpus model before export.

    ``build`` names a function ``module:function`` (in ``bench.corpus``'s family modules) that
    returns what the exporter needs; ``exporters`` are tried one by one, each giving its own file.
    ``args`` are passed to ``build``. ``derive`` marks a model made from another corpus entry
    (its ``source`` names that entry) in the project's environment rather than the export venv.
    ``env`` names the export environment (:data:`EXPORT_ENVS`) the build runs in.
    """

    name: str
    family: str
    source: str
    build: str
    exporters: tuple[str, ...] = ("dynamo", "torchscript")
    args: tuple[tuple[str, Any], ...] = ()
    derive: bool = False
    env: str = "torch"

    def key(self, exporter: str) -> str:
        return f"{self.name}-{exporter}"

    def kwargs(self) -> dict[str, Any]:
        return dict(self.args)


def spec(
    name: str,
    family: str,
    source: str,
    build: str,
    exporters: tuple[str, ...] = ("dynamo", "torchscript"),
    derive: bool = False,
    env: str = "torch",
    **args: Any,
) -> Spec:
    if env not in EXPORT_ENVS:
        raise ValueError(f"{name}: unknown export environment {env!r}")
    return Spec(name, family, source, build, exporters, tuple(sorted(args.items())), derive, env)


def converted_specs(
    prefix: str, module: str, family: str, env: str, sources: dict[str, str]
) -> list[Spec]:
    """The specs of a converter's module of the corpus (``bench.corpus.MODULE``): one per model
    name of ``sources`` (name -> what it is), named ``PREFIX-NAME``, built by the module's
    ``build`` and exported by the converter ``family`` alone, in the export environment ``env``."""
    return [
        spec(
            f"{prefix}-{name}",
            family,
            source,
            f"bench.corpus.{module}:build",
            exporters=(family,),
            env=env,
            model=name,
        )
        for name, source in sources.items()
    ]


def opset_by_name(name: str, opsets: tuple[int, ...]) -> int:
    """One of ``opsets``, the same for a name on every build (spread over them by name)."""
    return opsets[sum(name.encode()) % len(opsets)]


def all_specs() -> list[Spec]:
    """Every corpus spec, in build order (derived models last: they read exported ones)."""
    from bench.corpus import (
        derived,
        hf,
        keras_tf,
        paddle_models,
        scripted,
        sklearn_pipelines,
        tabular,
        timm_models,
        vision,
        yolo,
    )

    specs: list[Spec] = []
    modules = (timm_models, vision, hf, yolo, scripted, tabular, keras_tf, paddle_models)
    for module in (*modules, sklearn_pipelines, derived):
        specs.extend(module.SPECS)
    names = [s.name for s in specs]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise ValueError(f"duplicate corpus names: {sorted(dupes)}")
    return specs


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def describe(path: Path) -> dict[str, Any]:
    """Opset, node count (subgraphs included), bytes (with external data) and sha256 of a file."""
    import onnx

    from bench.__main__ import count_nodes, external_locations

    model = onnx.load(str(path), load_external_data=False)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    size = path.stat().st_size
    digest = hashlib.sha256(path.read_bytes())
    locations = external_locations(model)
    for name in locations:
        data = path.parent / name
        if data.exists():
            size += data.stat().st_size
            digest.update(data.read_bytes())
    domains = sorted({o.domain or "ai.onnx" for o in model.opset_import})
    return {
        "opset": opset,
        "domains": domains,
        "nodes": count_nodes(path),
        "bytes": size,
        "sha256": digest.hexdigest(),
        "external_data": bool(locations),
    }


class Manifest:
    """``manifest.json`` in the corpus directory: key -> entry. Written whole after every change
    (to a temporary file, then renamed) so an interrupted build leaves a valid manifest."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / MANIFEST
        self.entries: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            self.entries = {e["key"]: e for e in json.loads(self.path.read_text())["models"]}

    def put(self, entry: dict[str, Any]) -> None:
        """Add or replace one entry. The file is re-read under a lock first, so builders of
        different families may run at once on one directory without losing each other's work."""
        import fcntl

        self.directory.mkdir(parents=True, exist_ok=True)
        with (self.directory / "manifest.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self.path.exists():
                on_disk = json.loads(self.path.read_text())["models"]
                self.entries = {e["key"]: e for e in on_disk} | {
                    k: v for k, v in self.entries.items() if k not in {e["key"] for e in on_disk}
                }
            self.entries[entry["key"]] = entry
            self.save()

    def prune(self, keys: set[str]) -> list[str]:
        """Drop the entries (and files) of models no spec describes any more."""
        import fcntl

        with (self.directory / "manifest.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self.path.exists():
                self.entries = {e["key"]: e for e in json.loads(self.path.read_text())["models"]}
            stale = sorted(k for k in self.entries if k not in keys)
            for key in stale:
                (self.directory / self.entries.pop(key)["file"]).unlink(missing_ok=True)
            if stale:
                self.save()
        return stale

    def save(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".json.{os.getpid()}.tmp")
        models = sorted(self.entries.values(), key=lambda e: (e["family"], e["key"]))
        tmp.write_text(json.dumps({"models": models}, indent=1) + "\n")
        os.replace(tmp, self.path)

    def ok(self) -> Iterator[dict[str, Any]]:
        for e in self.entries.values():
            if e.get("status") == "ok":
                yield e

    def model_path(self, entry: dict[str, Any]) -> Path:
        return self.directory / entry["file"]
