"""The converters of ``int4-weight`` and ``int8-weight``: block-wise MatMul weights
(:mod:`graphtrim.quantize.weight_only`), with the refusals a build reports."""

from __future__ import annotations

from typing import Any

from graphtrim.quantize.convert import Conversion
from graphtrim.quantize.errors import NothingToQuantize, QuantizeError
from graphtrim.quantize.kinds import kind
from graphtrim.quantize.weight_only import quantize_weights
from graphtrim.quantize.weight_settings import WeightOnlyError


def convert_weight_only(bits: int, job: Conversion) -> dict[str, Any]:
    """The weight-only converter of ``int{bits}-weight``."""
    excluded = job.excluded
    settings = job.config.weight_settings(bits)
    try:
        record = quantize_weights(
            job.source, job.target, settings, excluded, work=job.target.parent
        )
    except WeightOnlyError as exc:
        raise QuantizeError(str(exc)) from exc
    if not record["matmuls_quantized"]:
        if excluded:
            raise NothingToQuantize(
                f"int{bits}-weight: nothing left to quantize: the {len(excluded)} node(s) kept "
                "in float (nodes_to_exclude, and the accuracy fallback's) hold every MatMul "
                f"weight ({kind(f'int{bits}-weight').advice}; or looser accuracy thresholds "
                "for the variant in the gate policy)"
            )
        raise QuantizeError(f"int{bits}-weight: no MatMul with a constant 2-D weight to quantize")
    return record


def convert_int4_weight(job: Conversion) -> dict[str, Any]:
    """4-bit block-wise MatMul weights."""
    return convert_weight_only(4, job)


def convert_int8_weight(job: Conversion) -> dict[str, Any]:
    """8-bit block-wise MatMul weights."""
    return convert_weight_only(8, job)
