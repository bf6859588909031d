"""The records of an evaluation (:func:`graphtrim.gates.evaluate.evaluate`): one gate's verdict,
the facts of one model, a variant's gates and overall verdict, and the whole evaluation with its
reference, as JSON and back."""

from __future__ import annotations

import collections
import dataclasses
import os
from pathlib import Path
from typing import Any

import onnx

from graphtrim.modelio.protos import all_nodes


@dataclasses.dataclass
class GateResult:
    gate: str
    status: str  # pass | fail | undecided | error
    measured: dict[str, Any]
    thresholds: dict[str, Any]
    reasons: list[str] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class ModelInfo:
    path: str
    bytes: int
    nodes: int
    op_counts: dict[str, int]

    @staticmethod
    def file_bytes(path: str | os.PathLike[str]) -> int:
        """The model file's bytes and its external data's (``<name>.data`` beside it), read from
        the file system alone."""
        p = Path(path)
        data = p.with_name(p.name + ".data")
        return p.stat().st_size + (data.stat().st_size if data.exists() else 0)

    @classmethod
    def of(cls, path: str | os.PathLike[str]) -> ModelInfo:
        p = Path(path)
        model = onnx.load(str(p), load_external_data=False)
        counts = collections.Counter(n.op_type for n in all_nodes(model.graph))
        return cls(str(p), cls.file_bytes(p), sum(counts.values()), dict(counts))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class VariantResult:
    name: str
    model: ModelInfo | None
    gates: list[GateResult]
    build: dict[str, Any] | None = None

    @property
    def passed(self) -> bool:
        return bool(self.gates) and all(g.passed for g in self.gates)

    def gate(self, name: str) -> GateResult | None:
        return next((g for g in self.gates if g.gate == name), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "passed": self.passed,
            "model": self.model.to_json() if self.model else None,
            "gates": [g.to_json() for g in self.gates],
            "build": self.build,
        }


@dataclasses.dataclass
class Evaluation:
    reference: ModelInfo
    device: str
    variants: list[VariantResult]
    fingerprint: dict[str, Any]
    policy: dict[str, Any]
    policy_hash: str
    data_source: str
    latency_samples: dict[str, list[float]]
    started: str
    seconds: float

    @property
    def passed(self) -> list[str]:
        return [v.name for v in self.variants if v.passed]

    def variant(self, name: str) -> VariantResult:
        return next(v for v in self.variants if v.name == name)

    def to_json(self) -> dict[str, Any]:
        return {
            "reference": self.reference.to_json(),
            "device": self.device,
            "started": self.started,
            "seconds": round(self.seconds, 3),
            "passed": self.passed,
            "variants": [v.to_json() for v in self.variants],
            "fingerprint": self.fingerprint,
            "policy": self.policy,
            "policy_hash": self.policy_hash,
            "data_source": self.data_source,
            "latency_samples_ms": {
                k: [round(x, 4) for x in v] for k, v in self.latency_samples.items()
            },
        }

    def write(self, folder: str | os.PathLike[str], *, stem: str = "evaluation") -> dict[str, Path]:
        """Write ``<stem>.json``, ``<stem>.md`` and ``<stem>.html`` into ``folder``."""
        from graphtrim.gates.report import write_reports

        return write_reports(self.to_json(), folder, stem=stem)
