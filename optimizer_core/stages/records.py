"""What each stage returns: one record type per stage, small and JSON-serializable.

A record holds URIs, versions, verdicts and small numbers, never a model, so it travels through
any orchestrator: ``to_json`` is the record as the CLI writes it (``--output``), as an Airflow
XCom and as a Kubeflow output parameter; ``from_json`` reads it back. Inside a process a stage
takes and returns the typed records; a record also reads like its JSON document
(``record["run_id"]``, ``{**record}``), so code written against the documents keeps working.

The nested values (the source version, a stored model, a variant's verdict) are the JSON
documents of their owners (``ModelSource.to_json``, ``StoredModel.to_json``) and stay
documents here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

from graphtrim.stages.context import PipelineError, require

R = TypeVar("R", bound="Record")


@dataclasses.dataclass(eq=False)
class Record(Mapping[str, Any]):
    """Base of the stage records. ``STAGE`` is the stage that writes it (the JSON's ``stage``);
    ``OPTIONAL`` names the JSON keys left out when their field is None."""

    STAGE: ClassVar[str] = ""
    OPTIONAL: ClassVar[tuple[str, ...]] = ()

    def to_json(self) -> dict[str, Any]:
        """The record's JSON document: ``stage`` first, then the fields in their order."""
        doc: dict[str, Any] = {"stage": self.STAGE}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in self.OPTIONAL:
                continue
            doc[f.name] = value
        return doc

    @classmethod
    def from_json(cls: type[R], doc: Mapping[str, Any]) -> R:
        """The record of a JSON document (what ``to_json`` wrote). Keys it does not know (a
        newer writer's) are left out; fields the document lacks take their defaults."""
        if isinstance(doc, cls):
            return doc
        if not isinstance(doc, Mapping):
            raise PipelineError(
                f"a {cls.STAGE} record must be a JSON object, not {type(doc).__name__}"
            )
        stage = doc.get("stage")
        if stage is not None and stage != cls.STAGE:
            raise PipelineError(f"expected a {cls.STAGE} record, got a {stage} record")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in doc.items() if k in names})

    @classmethod
    def take(cls: type[R], value: Any, keys: Sequence[str], stage: str) -> R:
        """``value`` (a record or its JSON document) as this record type, for ``stage``: a
        document that lacks ``keys`` is refused with one line naming the stage."""
        if isinstance(value, cls):
            return value
        require(value, keys, stage)
        return cls.from_json(value)

    # read-only document view: record["key"], record.get("key"), {**record}
    def __getitem__(self, key: str) -> Any:
        return self.to_json()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_json())

    def __len__(self) -> int:
        return len(self.to_json())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self.to_json() == dict(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


@dataclasses.dataclass(eq=False)
class ExportRecord(Record):
    """The source version, the resolved config, and the exported ONNX model (``model`` and
    ``export`` are None when every requested variant was judged before: ``reused``)."""

    STAGE: ClassVar[str] = "export"

    worker: dict[str, Any] = dataclasses.field(default_factory=dict)
    source: dict[str, Any] = dataclasses.field(default_factory=dict)
    config_hash: str = ""
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    reused: dict[str, Any] = dataclasses.field(default_factory=dict)
    run_id: str = ""
    model: dict[str, Any] | None = None
    export: dict[str, Any] | None = None


@dataclasses.dataclass(eq=False)
class OptimizeRecord(Record):
    """The optimized model, the passes of its preset and those that changed the graph."""

    STAGE: ClassVar[str] = "optimize"

    worker: dict[str, Any] = dataclasses.field(default_factory=dict)
    run_id: str = ""
    source: dict[str, Any] = dataclasses.field(default_factory=dict)
    model: dict[str, Any] | None = None
    preset: str = ""
    passes: list[str] = dataclasses.field(default_factory=list)
    changed: list[str] = dataclasses.field(default_factory=list)
    nodes_before: int | None = None
    nodes_after: int | None = None


@dataclasses.dataclass(eq=False)
class QuantizeRecord(Record):
    """Per variant built: its stored model and build summary, or its error (``model`` None);
    ``reused``: the variants judged before, not built again."""

    STAGE: ClassVar[str] = "quantize"

    run_id: str = ""
    source: dict[str, Any] = dataclasses.field(default_factory=dict)
    reused: list[str] = dataclasses.field(default_factory=list)
    variants: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    worker: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(eq=False)
class ValidateRecord(Record):
    """Per variant its verdict (gates, metrics, reasons, model), the variants that passed, the
    reference's size, the hardware fingerprint, the policy's digest and the reports' URIs.
    Merged from several mapped tasks (:func:`merge`): ``all_reports`` (each task's reports) and
    ``workers`` (where each variant was judged)."""

    STAGE: ClassVar[str] = "validate"
    OPTIONAL: ClassVar[tuple[str, ...]] = ("all_reports", "workers")

    worker: dict[str, Any] = dataclasses.field(default_factory=dict)
    run_id: str = ""
    source: dict[str, Any] = dataclasses.field(default_factory=dict)
    device: str = ""
    passed: list[str] = dataclasses.field(default_factory=list)
    variants: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    reference: dict[str, Any] | None = None
    fingerprint: str = ""
    policy_hash: str = ""
    reports: dict[str, str] = dataclasses.field(default_factory=dict)
    all_reports: list[dict[str, str]] | None = None
    workers: dict[str, Any] | None = None

    @classmethod
    def merge(cls, records: Sequence[Any]) -> ValidateRecord:
        """One validate record from several (one per mapped variant task) of the same run,
        each a record or its JSON document."""
        if not records:
            raise PipelineError("no validate records to merge")
        recs = [cls.from_json(r) for r in records]
        runs = {r.run_id for r in recs}
        if len(runs) != 1:
            raise PipelineError(
                f"validate records of different pipeline runs: {', '.join(sorted(runs))}"
            )
        first = recs[0]
        merged = dataclasses.replace(
            first,
            # from a task that measured
            reference=next((r.reference for r in recs if r.reference), first.reference),
            fingerprint=next((r.fingerprint for r in recs if r.fingerprint), first.fingerprint),
            policy_hash=next((r.policy_hash for r in recs if r.policy_hash), first.policy_hash),
            variants={},
            reports={},
        )
        all_reports = list(first.all_reports or [])
        workers = dict(first.workers) if first.workers is not None else None
        for r in recs:
            merged.variants.update(r.variants)
            for kind, uri in r.reports.items():
                merged.reports.setdefault(kind, uri)
            all_reports.append(r.reports)
            for name in r.variants:
                workers = {} if workers is None else workers
                workers[name] = r.worker
        merged.all_reports = all_reports
        merged.workers = workers
        merged.passed = [n for n, s in merged.variants.items() if s["passed"]]
        return merged


@dataclasses.dataclass(eq=False)
class RegisterRecord(Record):
    """The registered model the variants went to, the versions registered per variant, the
    variants that failed with their reasons, and the run's comparison report (``json``,
    ``markdown``, ``html`` URIs; absent when this run judged nothing new)."""

    STAGE: ClassVar[str] = "register"
    OPTIONAL: ClassVar[tuple[str, ...]] = ("reports",)

    worker: dict[str, Any] = dataclasses.field(default_factory=dict)
    run_id: str = ""
    source: dict[str, Any] = dataclasses.field(default_factory=dict)
    target: str = ""
    registered: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    failed: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    # variants that are a version already (the same identity) on which this run recorded its
    # policy's verdict: ``{"name", "version", "created": False}``
    existing: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    reports: dict[str, str] | None = None


@dataclasses.dataclass(eq=False)
class PromoteRecord(Record):
    """The aliases moved (candidate aliases per variant) and what became of the champion."""

    STAGE: ClassVar[str] = "promote"

    run_id: str = ""
    aliases: dict[str, Any] = dataclasses.field(default_factory=dict)
    champion: dict[str, Any] = dataclasses.field(default_factory=dict)
    worker: dict[str, Any] = dataclasses.field(default_factory=dict)
