"""The search space of ``graphtrim tune``, as data: one table of knobs per variant kind.

A knob is a :class:`~graphtrim.quantize.QuantizeConfig` field and the values worth trying; its
first value is the fixed recipe's (what ``graphtrim variants`` builds), so every search starts
from the fixed recipes and can only find something at least as good. A candidate is a kind and
one value per knob; its neighbours differ from it in one knob. Extending the space is a line
here: a new value, a new knob (a config field the converters read), or a new kind.

This module imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Knob:
    """A config field and the values tried for it (the first: the fixed recipe's).

    Attributes:
        field: the :class:`~graphtrim.quantize.QuantizeConfig` field.
        values: the values tried; lists are written as tuples.
        help: one line for the report and ``--help``.
        weights: whether its best value can change with the weights alone (scales, ranges,
            calibration: accuracy); a knob that changes which kernels run (types, forms, op
            types) times the same on every version of one graph. A search from memory re-checks
            only these.
    """

    field: str
    values: tuple[Any, ...]
    help: str = ""
    weights: bool = False


SPACE: dict[str, tuple[Knob, ...]] = {
    "graph": (Knob("preset", ("default", "compact"), "graph optimization preset"),),
    "int8-dynamic": (
        Knob("weight_type", ("int8", "uint8"), "weight integer type"),
        Knob("per_channel", (True, False), "a scale per output channel, or per tensor", True),
        # None: the kind's default (7-bit weights on: saturation on CPUs without VNNI)
        Knob("reduce_range", (None, False), "7-bit weights", True),
        Knob(
            "op_types",
            (None, ("MatMul", "Gemm"), ("Conv",)),
            "op types quantized (None: every type onnxruntime quantizes)",
        ),
    ),
    "int8-static": (
        Knob("activation_type", ("int8", "uint8"), "activation integer type"),
        Knob("weight_type", ("int8", "uint8"), "weight integer type"),
        Knob("per_channel", (True, False), "a scale per output channel, or per tensor", True),
        Knob("reduce_range", (None, True), "7-bit weights", True),
        Knob("method", ("minmax", "percentile", "entropy"), "calibration method", True),
        Knob("calibration_batches", (None, 2), "calibration batches read (None: all)", True),
        Knob(
            "op_types",
            (None, ("Conv", "MatMul", "Gemm")),
            "op types quantized (None: every type onnxruntime quantizes)",
        ),
        Knob("quant_format", ("qdq", "qoperator"), "QDQ pairs or onnxruntime's QLinear ops"),
    ),
    "int4-weight": (
        Knob("block_size", (32, 64, 128), "weights per scale", True),
        Knob("weight_symmetric", (True, False), "symmetric, or a zero point per block", True),
        Knob("weight_form", ("portable", "ort"), "DequantizeLinear + MatMul, or MatMulNBits"),
    ),
    "int4-fp16": (
        Knob("block_size", (32, 64, 128), "weights per scale", True),
        Knob("weight_symmetric", (True, False), "symmetric, or a zero point per block", True),
        Knob("weight_form", ("portable", "ort"), "DequantizeLinear + MatMul, or MatMulNBits"),
    ),
    "int8-weight": (
        Knob("block_size", (32, 128), "weights per scale", True),
        Knob("weight_form", ("portable", "ort"), "DequantizeLinear + MatMul, or MatMulNBits"),
    ),
    # the recipe alone: fp16 inputs (keep_io_types off) cannot take the float32 evaluation data
    # the gates feed
    "fp16": (),
}

# settings that cannot be built together: (kind, the settings, why); a candidate holding all of
# one line's settings is never tried
FORBIDDEN: tuple[tuple[str, Mapping[str, Any], str], ...] = (
    (
        "int8-static",
        {"activation_type": "int8", "weight_type": "uint8"},
        "onnxruntime does not quantize int8 activations with uint8 weights",
    ),
)

# kinds a search tries on each device when none are named: fp16 pays off on GPUs only
DEVICE_KINDS: dict[str, tuple[str, ...]] = {
    "cpu": ("graph", "int8-dynamic", "int8-static", "int4-weight", "int8-weight"),
    "gpu": (
        "graph",
        "int8-dynamic",
        "int8-static",
        "fp16",
        "int4-weight",
        "int4-fp16",
        "int8-weight",
    ),
}

# the op types a kind quantizes at all: a model without any is not searched with that kind
KIND_OPS: dict[str, frozenset[str]] = {
    "int8-dynamic": frozenset({"MatMul", "Gemm", "Conv", "Attention", "LSTM", "GRU", "Gather"}),
    "int8-static": frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Add", "Mul"}),
    "int4-weight": frozenset({"MatMul"}),
    "int4-fp16": frozenset({"MatMul"}),
    "int8-weight": frozenset({"MatMul"}),
}


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _frozen(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A variant kind and its settings: the knobs that differ from the fixed recipe."""

    kind: str
    settings: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, kind: str, settings: Mapping[str, Any] | None = None) -> Candidate:
        """The candidate with ``settings`` (values equal to the recipe's are dropped)."""
        if kind not in SPACE:
            raise KeyError(f"no search space for variant '{kind}': use one of {', '.join(SPACE)}")
        knobs = {k.field: k for k in SPACE[kind]}
        kept = []
        for name, value in sorted((settings or {}).items()):
            knob = knobs.get(name)
            if knob is None:
                raise KeyError(f"'{name}' is not a knob of {kind}: {', '.join(knobs)}")
            value = _frozen(value)
            if value != knob.values[0]:
                kept.append((name, value))
        return cls(kind, tuple(kept))

    @property
    def key(self) -> str:
        """``kind`` or ``kind[field=value,...]``: unique, stable, readable."""
        if not self.settings:
            return self.kind
        parts = ",".join(
            f"{k}={json.dumps(_plain(v), separators=(',', ':'))}" for k, v in self.settings
        )
        return f"{self.kind}[{parts}]"

    @property
    def recipe(self) -> bool:
        """Whether this is the fixed recipe of its kind."""
        return not self.settings

    def values(self) -> dict[str, Any]:
        """Every knob of the kind with this candidate's value."""
        own = dict(self.settings)
        return {k.field: own.get(k.field, k.values[0]) for k in SPACE[self.kind]}

    def overrides(self) -> dict[str, Any]:
        """The config fields to set (lists as lists)."""
        return {k: _plain(v) for k, v in self.settings}

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "settings": self.overrides(), "key": self.key}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Candidate:
        return cls.of(str(doc["kind"]), doc.get("settings") or {})


def _usable(knob: Knob, value: Any, ops: frozenset[str] | None) -> bool:
    if ops is None or knob.field != "op_types" or value is None:
        return True
    return bool(set(value) & ops)


def forbidden(candidate: Candidate) -> str | None:
    """Why ``candidate`` cannot be built (:data:`FORBIDDEN`), or None."""
    values = candidate.values()
    for kind, settings, why in FORBIDDEN:
        if kind == candidate.kind and all(values.get(k) == v for k, v in settings.items()):
            return why
    return None


def neighbours(
    candidate: Candidate, ops: frozenset[str] | None = None, *, weights_only: bool = False
) -> list[Candidate]:
    """The candidates that differ from ``candidate`` in one knob (values a model with ``ops``
    can use, combinations that can be built), in the table's order; ``weights_only``: in the
    knobs whose best value can change with the weights (:attr:`Knob.weights`)."""
    current = candidate.values()
    out = []
    for knob in SPACE[candidate.kind]:
        if weights_only and not knob.weights:
            continue
        for value in knob.values:
            if value == current[knob.field] or not _usable(knob, value, ops):
                continue
            other = Candidate.of(candidate.kind, {**current, knob.field: value})
            if forbidden(other) is None:
                out.append(other)
    return out


def start_points(
    kinds: Iterable[str], ops: frozenset[str] | None = None, *, calibration: bool = True
) -> list[Candidate]:
    """The fixed recipe of each kind that can run on a model with ``ops`` (``int8-static``
    only with calibration data)."""
    out = []
    for kind in kinds:
        if kind == "int8-static" and not calibration:
            continue
        needed = KIND_OPS.get(kind)
        if needed is not None and ops is not None and not needed & ops:
            continue
        out.append(Candidate.of(kind))
    return out


def check_kinds(kinds: Sequence[str]) -> None:
    """Refuse kinds with no search space (``KeyError`` naming the known ones)."""
    unknown = [k for k in kinds if k not in SPACE]
    if unknown:
        raise KeyError(f"no search space for {', '.join(unknown)}: use {', '.join(SPACE)}")


def describe() -> list[str]:
    """One line per knob, for ``graphtrim tune --help`` and the documentation."""
    lines = []
    for kind, knobs in SPACE.items():
        for k in knobs:
            values = " | ".join(json.dumps(_plain(v)) for v in k.values)
            lines.append(f"{kind}.{k.field}: {values}  ({k.help})")
    return lines
