"""What a search remembers: the winning settings per graph signature and device.

The signature of a model is its op histogram (subgraphs included) and its input/output
signature (names, element types, dims): two versions of one architecture that differ in their
weights share it, and a search for the second starts from the first's champion
(:func:`graphtrim.tune.search.tune`). Where it is kept is a backend: a JSON file here
(``graphtrim tune --memory FILE``), tags on the registered model in MLflow
(:class:`graphtrim.integrations.registry.RegistryTuneMemory`).
"""

from __future__ import annotations

import collections
import datetime as dt
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import onnx

from graphtrim.errors import GraphtrimError
from graphtrim.modelio.protos import all_nodes


class TuneMemoryError(GraphtrimError):
    """The memory could not be read or written (a corrupt file, an unwritable folder)."""


def op_histogram(model: onnx.ModelProto) -> collections.Counter[tuple[str, str]]:
    """``(domain, op type) -> count`` over the model's nodes, subgraphs included."""
    return collections.Counter(
        (node.domain or "ai.onnx", node.op_type) for node in all_nodes(model.graph)
    )


def graph_signature(path: str | os.PathLike[str]) -> str:
    """A digest of the model's op histogram and input/output signature (weights not read)."""
    model = onnx.load(str(path), load_external_data=False)
    ops = {f"{domain}::{op}": n for (domain, op), n in op_histogram(model).items()}
    initializers = {t.name for t in model.graph.initializer}

    def io(values: Any) -> list[list[Any]]:
        out = []
        for v in values:
            if v.name in initializers:
                continue
            t = v.type.tensor_type
            dims = (
                [d.dim_param or d.dim_value for d in t.shape.dim] if t.HasField("shape") else None
            )
            out.append([v.name, t.elem_type, dims])
        return out

    doc = {
        "ops": dict(sorted(ops.items())),
        "inputs": io(model.graph.input),
        "outputs": io(model.graph.output),
        "opsets": sorted((o.domain or "ai.onnx", o.version) for o in model.opset_import),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:24]


class TuneMemory(Protocol):
    """Where winning settings are kept between searches."""

    def recall(self, signature: str, device: str) -> dict[str, Any] | None:
        """The entry remembered for ``signature`` on ``device``, or None."""
        ...

    def remember(self, signature: str, device: str, entry: Mapping[str, Any]) -> None:
        """Keep ``entry`` (a champion's candidate, exclusions and numbers)."""
        ...

    def describe(self) -> str:
        """Where it is kept, for messages."""
        ...


def stamp(entry: Mapping[str, Any]) -> dict[str, Any]:
    """``entry`` with the time it was remembered."""
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    return {**entry, "remembered": now}


class FileMemory:
    """A JSON file: ``{"entries": {"<device>:<signature>": entry}}``, replaced at once."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def _read(self) -> dict[str, Any]:
        try:
            doc = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {"entries": {}}
        except (OSError, ValueError) as exc:
            raise TuneMemoryError(f"{self.path}: not a graphtrim tune memory ({exc})") from exc
        if not isinstance(doc, dict) or not isinstance(doc.get("entries"), dict):
            raise TuneMemoryError(f"{self.path}: not a graphtrim tune memory (no 'entries')")
        return doc

    def recall(self, signature: str, device: str) -> dict[str, Any] | None:
        entry = self._read()["entries"].get(f"{device}:{signature}")
        return dict(entry) if isinstance(entry, dict) else None

    def remember(self, signature: str, device: str, entry: Mapping[str, Any]) -> None:
        doc = self._read()
        doc["entries"][f"{device}:{signature}"] = stamp(entry)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(doc, indent=2, sort_keys=True))
        os.replace(tmp, self.path)

    def describe(self) -> str:
        return str(self.path)


class HeldMemory:
    """One entry read elsewhere, carried into a search in another process; what the search
    remembers is kept in :attr:`remembered` for the caller to write where it belongs."""

    def __init__(self, entry: Mapping[str, Any] | None, where: str) -> None:
        self.entry = dict(entry) if entry is not None else None
        self.where = where
        self.remembered: dict[str, Any] | None = None

    def recall(self, signature: str, device: str) -> dict[str, Any] | None:
        return dict(self.entry) if self.entry is not None else None

    def remember(self, signature: str, device: str, entry: Mapping[str, Any]) -> None:
        self.remembered = stamp(entry)

    def describe(self) -> str:
        return self.where
