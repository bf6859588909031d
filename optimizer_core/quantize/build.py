"""Build one variant of a model: ``graph``, ``int8-dynamic``, ``int8-static`` or ``fp16``.

Every variant starts from graphtrim's optimized model (verified against the source). int8 and
fp16 conversions run on it, then graphtrim's exact passes clean up after them, verified against
the converted model. Every built variant is compared with the float model it came from (on the
calibration feeds, else on seeded random inputs): the build record's ``agreement`` holds the
numbers, or says why they could not be measured. With an accuracy check, a failing int8/fp16
variant is rebuilt with the nodes that add the most error kept in float, up to
``max_attempts`` builds; every attempt is recorded. The output appears at its path only when
complete, built in a staging folder beside it (:func:`graphtrim.modelio.staging_dir`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from graphtrim.data import CalibrationReader, Feeds
from graphtrim.errors import (
    GraphtrimError,
    InvalidModelError,
    PassFailure,
    VerificationError,
)
from graphtrim.quantize.agreement import Agreement, measure_agreement
from graphtrim.quantize.errors import NothingToQuantize as NothingToQuantize
from graphtrim.quantize.errors import QuantizeError as QuantizeError
from graphtrim.quantize.kinds import VARIANTS, kind
from graphtrim.quantize.sensitivity import NodeError, fallback_nodes, node_errors

logger = logging.getLogger("graphtrim.quantize")

CALIBRATION_METHODS: tuple[str, ...] = ("minmax", "entropy", "percentile")
QUANT_TYPES: tuple[str, ...] = ("int8", "uint8")
# int8-static's form: QuantizeLinear/DequantizeLinear pairs around float ops, or onnxruntime's
# quantized operators (QLinearConv, QLinearMatMul, ...)
QUANT_FORMATS: tuple[str, ...] = ("qdq", "qoperator")

# ops whose fp16 results overflow or lose too much in typical models: computed in float32
FP16_KEEP_FLOAT = ("Pow", "ReduceSumSquare", "ReduceL2", "Exp", "Log", "Softplus", "CumSum")
FP16_MAX = 65504.0

ProgressFn = Callable[[str], None]
# returns (passed, measured numbers) for a candidate model file
AccuracyCheck = Callable[[Path], tuple[bool, dict[str, Any]]]


@dataclasses.dataclass(frozen=True)
class RuntimeDefect:
    """A runtime bug a converted model can hit, and the form of the variant that avoids it.
    Tried in order when a candidate crashes its runtime at the default optimization level;
    the form is used only when it loads there (and then passes the usual checks)."""

    name: str
    runtime: str
    what: str
    keep_float: tuple[str, ...]  # fp16: op types computed in float32 instead
    form: str

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "keep_float": list(self.keep_float)}


RUNTIME_DEFECTS: dict[str, tuple[RuntimeDefect, ...]] = {
    "fp16": (
        RuntimeDefect(
            "ort-fp16-transpose-matmul",
            "onnxruntime 1.32 CPUExecutionProvider (ORT_ENABLE_ALL, ORT_ENABLE_LAYOUT)",
            "an fp16 Transpose(perm=[1,0,2]) read through a Cast by a float MatMul: "
            "MatmulTransposeFusion moves the Cast above the Transpose, then NchwcTransformer "
            "segfaults while the session is created",
            ("Transpose",),
            "with Transpose kept in float32",
        ),
    ),
}


@dataclasses.dataclass
class QuantizeConfig:
    """How variants are built. Part of the config hash that identifies a result."""

    preset: str = "default"
    per_channel: bool = True
    method: str = "minmax"
    activation_type: str = "int8"
    weight_type: str = "int8"
    # 7-bit weights. None: each kind's default, on for int8-dynamic: its uint8 activations
    # times int8 weights saturate in onnxruntime's x86 kernels on CPUs without VNNI (AVX2 and
    # AVX-512 before VNNI; measured: cosine 0.989 against 0.9998 on an attention block), off for
    # int8-static (int8 activations)
    reduce_range: bool | None = None
    op_types: list[str] | None = None
    # int8-static: the form written (QUANT_FORMATS) and how many calibration batches are read
    # (None: all of them)
    quant_format: str = "qdq"
    calibration_batches: int | None = None
    nodes_to_exclude: list[str] = dataclasses.field(default_factory=list)
    max_attempts: int = 3
    fallback_fraction: float = 0.1
    keep_io_types: bool = True
    fp16_keep_float: list[str] = dataclasses.field(default_factory=lambda: list(FP16_KEEP_FLOAT))
    # the device the variant is built for (``cpu`` / ``gpu``): rewrites that only pay off on
    # some runtimes (``residual-sum``) are timed there and kept where faster; None: not tuned
    tune_device: str | None = None
    # int4-weight / int8-weight (block-wise, MatMul weights): see graphtrim.quantize.weight_only
    block_size: int = 32
    weight_symmetric: bool = True
    weight_algorithm: str = "rtn"
    # "ort": onnxruntime's MatMulNBits; "portable": DequantizeLinear(block_size) + MatMul
    weight_form: str = "portable"
    # MatMulNBits' accuracy_level (ort form); None: 4 (int8 compute), as onnxruntime runs the
    # portable form
    accuracy_level: int | None = None
    # int4-weight: token embedding tables (Gather) too, as GatherBlockQuantized (ort form)
    quantize_embeddings: bool = False

    def weight_settings(self, bits: int) -> Any:
        from graphtrim.quantize.weight_only import WeightOnlySettings

        return WeightOnlySettings(
            bits=bits,
            block_size=self.block_size,
            symmetric=self.weight_symmetric,
            algorithm=self.weight_algorithm,
            form=self.weight_form,
            accuracy_level=self.accuracy_level,
            embeddings=self.quantize_embeddings and bits == 4,
        )

    def validate(self) -> None:
        if self.method not in CALIBRATION_METHODS:
            raise QuantizeError(
                f"unknown calibration method '{self.method}': use one of {', '.join(CALIBRATION_METHODS)}"
            )
        for field in ("activation_type", "weight_type"):
            if getattr(self, field) not in QUANT_TYPES:
                raise QuantizeError(f"{field} must be one of {', '.join(QUANT_TYPES)}")
        if self.quant_format not in QUANT_FORMATS:
            raise QuantizeError(f"quant_format must be one of {', '.join(QUANT_FORMATS)}")
        if self.calibration_batches is not None and self.calibration_batches < 1:
            raise QuantizeError("calibration_batches must be at least 1 (or None: all)")
        if self.tune_device not in (None, "cpu", "gpu"):
            raise QuantizeError("tune_device must be 'cpu', 'gpu' or None")
        if self.max_attempts < 1:
            raise QuantizeError("max_attempts must be at least 1")
        if not 0 < self.fallback_fraction <= 1:
            raise QuantizeError("fallback_fraction must be in (0, 1]")
        from graphtrim.quantize.weight_only import WeightOnlyError

        try:
            self.weight_settings(4).validate()
        except WeightOnlyError as exc:
            raise QuantizeError(str(exc)) from exc

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]


@dataclasses.dataclass
class Attempt:
    number: int
    excluded: list[str]
    accuracy_passed: bool | None
    measured: dict[str, Any]
    most_sensitive: list[NodeError] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "excluded": list(self.excluded),
            "accuracy_passed": self.accuracy_passed,
            "measured": self.measured,
            "most_sensitive": [e.to_json() for e in self.most_sensitive],
        }


@dataclasses.dataclass
class VariantBuild:
    variant: str
    source: str
    output: str
    seconds: float
    config: QuantizeConfig
    attempts: list[Attempt]
    optimization: dict[str, Any]
    cleanup: dict[str, Any] | None
    # what tuning for ``config.tune_device`` measured and kept (None: not tuned)
    tuning: dict[str, Any] | None = None
    # known runtime defects the candidate hit, and the form that avoided each
    runtime_defects: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # how the built variant agrees with the float model (build_variant always measures it)
    agreement: Agreement | None = None
    # what the converter reports about the last attempt (weight-only: settings, form, counts)
    conversion: dict[str, Any] | None = None
    # why the fallback stopped before its last attempt (every convertible node in float)
    stopped: str | None = None

    @property
    def excluded(self) -> list[str]:
        return self.attempts[-1].excluded if self.attempts else []

    @property
    def accuracy_passed(self) -> bool | None:
        return self.attempts[-1].accuracy_passed if self.attempts else None

    def to_json(self) -> dict[str, Any]:
        return {
            "variant": self.variant,
            "source": self.source,
            "output": self.output,
            "seconds": round(self.seconds, 3),
            "config": self.config.to_json(),
            "config_hash": self.config.digest(),
            "excluded_nodes": self.excluded,
            "accuracy_passed": self.accuracy_passed,
            "attempts": [a.to_json() for a in self.attempts],
            "optimization": self.optimization,
            "cleanup": self.cleanup,
            "tuning": self.tuning,
            "runtime_defects": self.runtime_defects,
            "agreement": self.agreement.to_json() if self.agreement is not None else None,
            "conversion": self.conversion,
            "stopped": self.stopped,
            "advice": kind(self.variant).advice if self.accuracy_passed is False else None,
        }


def _say(progress: ProgressFn | None, line: str) -> None:
    if progress is not None:
        progress(line)
    logger.info("%s", line)


def _name_nodes(path: Path) -> None:
    """Give every node a unique name: exclusion lists and sensitivity reports refer to them."""
    model = onnx.load(str(path), load_external_data=False)
    seen: set[str] = set()
    changed = False
    for i, node in enumerate(model.graph.node):
        if not node.name or node.name in seen:
            base = f"{node.op_type}_{i}"
            name = base
            k = 0
            while name in seen:
                k += 1
                name = f"{base}_{k}"
            node.name = name
            changed = True
        seen.add(node.name)
    if changed:
        # external data references stay valid: the file keeps its name and folder
        onnx.save(model, str(path))


def _files(path: Path) -> list[Path]:
    out = [path]
    data = path.with_name(path.name + ".data")
    if data.exists():
        out.append(data)
    return out


def _model_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in _files(path))


def _quant_type(name: str) -> Any:
    from onnxruntime.quantization import QuantType

    return QuantType.QInt8 if name == "int8" else QuantType.QUInt8


def standard_attention_nodes(path: Path) -> list[str]:
    """Names of the standard-domain ``Attention`` nodes (opset 23) of the model at ``path``.

    onnxruntime's dynamic quantizer keys its operator table on the op type alone: it rewrites
    any ``Attention`` as its contrib ``QAttention``, whose inputs are (activation, packed QKV
    weight). A standard ``Attention`` reads Q, K and V activations, so the rewrite yields a model
    onnxruntime refuses to load. These nodes have no weights to quantize: they stay in float.
    """
    model = onnx.load(str(path), load_external_data=False)
    return [
        n.name
        for n in model.graph.node
        if n.op_type == "Attention" and n.domain in ("", "ai.onnx") and n.name
    ]


def _unsorted(graph: onnx.GraphProto, outer: frozenset[str] = frozenset()) -> bool:
    """Whether a node of ``graph`` (or of a subgraph) reads a value produced by a later node,
    directly or from inside one of its subgraphs."""
    produced = {o for n in graph.node for o in n.output if o}
    known = set(outer) | {i.name for i in graph.input} | {t.name for t in graph.initializer}

    def reads(node: onnx.NodeProto) -> set[str]:
        names = {i for i in node.input if i}
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                inner = {o for n in sub.node for o in n.output} | {i.name for i in sub.input}
                inner |= {t.name for t in sub.initializer}
                names |= {r for n in sub.node for r in reads(n)} - inner
        return names

    for node in graph.node:
        if any(name in produced and name not in known for name in reads(node)):
            return True
        known.update(node.output)
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                if _unsorted(sub, frozenset(known)):
                    return True
    return False


def _sorted_output(raw: Path) -> Path:
    """The converter's output with its nodes in topological order. onnxruntime's quantizer
    appends the nodes it adds, so a value that an ``If``/``Loop`` body reads from the outer
    graph can end up produced after that node; such a model is valid once sorted."""
    import onnx_ir as ir

    from graphtrim.modelio import save_model

    if not _unsorted(onnx.load(str(raw), load_external_data=False).graph):
        return raw
    model = ir.load(str(raw))
    model.graph.sort()  # subgraphs too, with their reads from outer scopes as dependencies
    return save_model(model, raw.with_name("sorted.onnx"))[0]


def convert_int8_dynamic(
    src: Path,
    dst: Path,
    cfg: QuantizeConfig,
    excluded: Sequence[str],
    calibration: Sequence[Feeds] = (),
    progress: ProgressFn | None = None,
) -> None:
    """int8 weights with onnxruntime's ``quantize_dynamic`` (attention kept in float), its shape
    inference lent one that copies no weights (:mod:`graphtrim.quantize.shapes`)."""
    from onnxruntime.quantization import quantize_dynamic

    from graphtrim.quantize.shapes import weightless_shape_inference

    keep_float = sorted(set(excluded) | set(standard_attention_nodes(src)))
    with weightless_shape_inference():
        quantize_dynamic(
            src,
            dst,
            op_types_to_quantize=cfg.op_types,
            per_channel=cfg.per_channel,
            reduce_range=True if cfg.reduce_range is None else cfg.reduce_range,
            weight_type=_quant_type(cfg.weight_type),
            nodes_to_exclude=keep_float,
            use_external_data_format=_model_bytes(src) > 1_500_000_000,
        )


def convert_int4_fp16(
    src: Path,
    dst: Path,
    cfg: QuantizeConfig,
    excluded: Sequence[str],
    calibration: Sequence[Feeds] = (),
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """float16 activations (:func:`convert_fp16`), then 4-bit block-wise MatMul weights
    quantized from their float16 values: ``MatMulNBits`` (ort form) or ``DequantizeLinear``
    (portable) with float16 scales, so every MatMul computes in float16 (GPU kernels). Nodes
    kept in float after a failed accuracy check stay float32 with float32 weights."""
    from graphtrim.quantize.weight_only import convert_weight_only

    with tempfile.TemporaryDirectory(prefix="graphtrim-int4-fp16-", dir=dst.parent) as tmp:
        half = Path(tmp) / "fp16.onnx"
        convert_fp16(src, half, cfg, excluded, calibration, progress)
        record = convert_weight_only(4, half, dst, cfg, excluded)
    return {**record, "activations": "float16"}


# the first opset whose DequantizeLinear takes an ``axis``: per-channel QDQ needs it
PER_CHANNEL_QDQ_OPSET = 13


def _per_channel_source(
    src: Path, tmp: Path, cfg: QuantizeConfig
) -> tuple[Path, bool, dict[str, Any] | None]:
    """The model to quantize, whether per channel, and a note when either changed.

    onnxruntime's QDQ quantizer writes per-channel ``DequantizeLinear(axis=...)`` whatever the
    model's opset; below 13 that attribute does not exist and the result is invalid. Such a
    model is raised to opset 13 first (onnx's version converter, exact); one the converter
    cannot raise, or one too large to convert in memory (external data), is quantized per
    tensor instead, and the note says which and why.
    """
    if not cfg.per_channel or cfg.quant_format != "qdq":
        return src, cfg.per_channel, None
    proto = onnx.load(str(src), load_external_data=False)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None or opset >= PER_CHANNEL_QDQ_OPSET:
        return src, True, None
    why = f"opset {opset} has no per-channel DequantizeLinear (it needs {PER_CHANNEL_QDQ_OPSET})"
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer):
        return src, False, {"per_channel": f"per tensor: {why}; external data is not converted"}
    from onnx import version_converter

    try:
        # no initializer is external, so the proto read above already holds every weight
        converted = version_converter.convert_version(proto, PER_CHANNEL_QDQ_OPSET)
        onnx.checker.check_model(converted)
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return (
            src,
            False,
            {"per_channel": f"per tensor: {why}, and it cannot be raised: {reason}"},
        )
    out = tmp / "opset13.onnx"
    onnx.save(converted, str(out))
    return out, True, {"opset": f"raised from {opset} to {PER_CHANNEL_QDQ_OPSET}: {why}"}


def convert_int8_static(
    src: Path,
    dst: Path,
    cfg: QuantizeConfig,
    excluded: Sequence[str],
    calibration: Sequence[Feeds] = (),
    progress: ProgressFn | None = None,
) -> dict[str, Any] | None:
    """QDQ int8 with onnxruntime's ``quantize_static``, calibrated on ``calibration``; a model
    below opset 13 is raised to it for per-channel weights (see :func:`_per_channel_source`)."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, quantize_static

    method = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }[cfg.method]
    with tempfile.TemporaryDirectory(prefix="graphtrim-calib-") as tmp:
        source, per_channel, note = _per_channel_source(src, Path(tmp), cfg)
        if note is not None:
            _say(progress, f"int8-static: {next(iter(note.values()))}")
        quantize_static(
            source,
            dst,
            CalibrationReader(list(calibration)[: cfg.calibration_batches], progress=progress),
            quant_format=QuantFormat.QDQ if cfg.quant_format == "qdq" else QuantFormat.QOperator,
            op_types_to_quantize=cfg.op_types,
            per_channel=per_channel,
            reduce_range=bool(cfg.reduce_range),
            activation_type=_quant_type(cfg.activation_type),
            weight_type=_quant_type(cfg.weight_type),
            nodes_to_exclude=list(excluded),
            use_external_data_format=_model_bytes(src) > 1_500_000_000,
            calibrate_method=method,
            extra_options={"CalibTensorRangeSymmetric": False},
            calibration_cache_path=None,
        )
    return note


def fp16_overflow_nodes(
    src: Path, feeds: Sequence[Feeds], *, workdir: Path | None = None
) -> list[str]:
    """Nodes whose float outputs on ``feeds`` leave the fp16 range (with a 2x margin).

    A copy of the model with every float value as an output is written under ``workdir`` (the
    system's temporary folder without it): a build passes its staging folder, which a killed
    run's successor removes."""
    import onnxruntime as ort

    from graphtrim.runtime import session_options

    model = onnx.load(str(src))
    inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False)
    floats = {
        vi.name
        for vi in inferred.graph.value_info
        if vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    }
    producer = {o: n.name for n in model.graph.node for o in n.output if o in floats}
    names = sorted(producer)
    if not names or not feeds:
        return []
    for name in names:
        model.graph.output.append(
            onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
        )
    with tempfile.TemporaryDirectory(prefix="graphtrim-fp16-", dir=workdir) as tmp:
        path = os.path.join(tmp, "m.onnx")
        onnx.save(model, path, save_as_external_data=model.ByteSize() > 1_500_000_000)
        sess = ort.InferenceSession(
            path, session_options(1, optimize=False), providers=["CPUExecutionProvider"]
        )
        peak = dict.fromkeys(names, 0.0)
        for feed in feeds:
            for name, arr in zip(names, sess.run(names, dict(feed)), strict=True):
                if arr.size:
                    peak[name] = max(peak[name], float(np.max(np.abs(arr))))
    hot = {n for n, v in peak.items() if not v < FP16_MAX / 2}
    # the producers of out-of-range values, and their consumers: an fp16 consumer would read
    # the value after a cast to fp16, which is already inf
    nodes = {producer[n] for n in hot}
    nodes |= {node.name for node in model.graph.node if any(i in hot for i in node.input)}
    return sorted(nodes)


def _drop_fp16_round_trips(model: onnx.ModelProto) -> int:
    """Remove ``Cast(to=fp16) -> Cast(to=fp32)`` pairs on float32 values: the converter puts
    them between adjacent nodes it keeps in float32, where they only lose precision (or
    overflow). Consumers read the float32 value directly instead."""
    graph = model.graph
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    outputs = {o.name for o in graph.output}
    f16, f32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT

    def cast_to(node: onnx.NodeProto) -> int | None:
        if node.op_type != "Cast" or node.domain not in ("", "ai.onnx"):
            return None
        return next((a.i for a in node.attribute if a.name == "to"), None)

    # the converter records the type of every value it leaves in float32
    producer_type: dict[str, int] = {t.name: t.data_type for t in graph.initializer}
    for vi in [*graph.value_info, *graph.input, *graph.output]:
        producer_type[vi.name] = vi.type.tensor_type.elem_type
    drop: set[int] = set()
    rename: dict[str, str] = {}
    for node in graph.node:
        if cast_to(node) != f16 or producer_type.get(node.input[0]) != f32:
            continue
        users = consumers.get(node.output[0], [])
        if not users or node.output[0] in outputs:
            continue
        if all(cast_to(u) == f32 and u.output[0] not in outputs for u in users):
            drop.add(id(node))
            for u in users:
                drop.add(id(u))
                rename[u.output[0]] = node.input[0]
    if not drop:
        return 0
    kept = [n for n in graph.node if id(n) not in drop]
    for n in kept:
        for k, name in enumerate(n.input):
            if name in rename:
                n.input[k] = rename[name]
    copies = [onnx.NodeProto.FromString(n.SerializeToString()) for n in kept]
    del graph.node[:]
    graph.node.extend(copies)
    return len(drop)


def _toposort(graph: onnx.GraphProto) -> None:
    """Order ``graph``'s nodes so every node follows its producers (the fp16 converter appends
    the casts it adds for the inputs at the end)."""
    available = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    pending = list(graph.node)
    ordered: list[onnx.NodeProto] = []
    outer_ok = set()
    for node in pending:  # names produced nowhere in this graph come from an outer scope
        outer_ok.update(node.input)
    produced = {o for n in pending for o in n.output}
    available |= outer_ok - produced
    while pending:
        rest = []
        for node in pending:
            if all(i in available for i in node.input):
                ordered.append(node)
                available.update(node.output)
            else:
                rest.append(node)
        if len(rest) == len(pending):  # a cycle: leave the remainder as it was
            ordered.extend(rest)
            break
        pending = rest
    copies = [onnx.NodeProto.FromString(n.SerializeToString()) for n in ordered]
    del graph.node[:]
    graph.node.extend(copies)


class _DropPreprocessAdvice(logging.Filter):
    """onnxruntime's quantizer advises ``quant_pre_process`` on the root logger; graphtrim's
    optimizer has already done that pre-processing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "pre-processing before quantization" not in record.getMessage()


def convert_fp16(
    src: Path,
    dst: Path,
    cfg: QuantizeConfig,
    excluded: Sequence[str],
    calibration: Sequence[Feeds] = (),
    progress: ProgressFn | None = None,
) -> None:
    """float16 with onnxruntime's converter (``cfg.fp16_keep_float`` op types stay float32)."""
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    model = onnx.load(str(src))
    converted = convert_float_to_float16(
        model,
        keep_io_types=cfg.keep_io_types,
        op_block_list=[*DEFAULT_OP_BLOCK_LIST, *cfg.fp16_keep_float],
        node_block_list=list(excluded),
    )
    _toposort(converted.graph)
    _drop_fp16_round_trips(converted)
    big = converted.ByteSize() > 1_500_000_000 if converted.ByteSize() >= 0 else True
    onnx.save(
        converted,
        str(dst),
        save_as_external_data=big,
        location=dst.name + ".data" if big else None,
    )


def build_variant(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    variant: str,
    *,
    config: QuantizeConfig | None = None,
    calibration: Iterable[Feeds] | None = None,
    accuracy_check: AccuracyCheck | None = None,
    progress: ProgressFn | None = None,
    probe: bool = True,
    probe_timeout: float = 600.0,
) -> VariantBuild:
    """Build ``variant`` of the model at ``src`` into ``dst``.

    Args:
        calibration: feeds for static quantization (required for ``int8-static``), the fp16
            range check and the sensitivity measurement.
        accuracy_check: judges a candidate file; when it fails, the most sensitive nodes are
            kept in float and the variant rebuilt (``config.max_attempts`` builds at most). The
            last attempt's file is written either way; ``accuracy_passed`` says how it went.
        probe: before anything else loads a candidate, open it in a child process as it will
            be served (onnxruntime's default optimization level on ``config.tune_device``,
            else the CPU) and run it once; a candidate that crashes or hangs the runtime is
            never written (:class:`QuantizeError` names the signal and the step).
    """
    from graphtrim.data import input_specs
    from graphtrim.modelio import publish_model, staging_dir
    from graphtrim.optimize_file import optimize_file

    cfg = config or QuantizeConfig()
    cfg.validate()
    if variant not in VARIANTS:
        raise QuantizeError(f"unknown variant '{variant}': use one of {', '.join(VARIANTS)}")
    spec = kind(variant)
    from graphtrim.modelio import read_proto, refuse_overwrite

    source, target = Path(src), Path(dst)
    proto = read_proto(source)  # an unusable input is an InvalidModelError, as ever
    try:
        refuse_overwrite(source, target, proto)  # the model file, or a data file it reads
    except InvalidModelError as exc:
        raise QuantizeError(f"refusing to overwrite the input model: {exc}") from exc
    del proto
    input_specs(source)  # a model onnxruntime cannot load is refused before any work
    feeds = list(calibration) if calibration is not None else []
    if spec.needs_calibration and not feeds:
        raise QuantizeError(f"{variant} needs calibration data (an .npz file or feeds)")
    t0 = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    stage = staging_dir(target)  # what a killed build left beside the target goes first
    try:
        _say(progress, f"{variant}: optimizing the graph ({cfg.preset})")
        pre_dir = stage / "pre"
        pre_dir.mkdir()
        pre = pre_dir / target.name
        # the residual form is left to the tuning below: the converters see the plain Add
        opt = optimize_file(source, pre, preset=cfg.preset, skip=_TUNED_REWRITES, check=True)

        def finish(
            built: Path, attempts: list[Attempt], cleanup: dict[str, Any] | None
        ) -> VariantBuild:
            tuning = None
            if cfg.tune_device is not None:
                _say(progress, f"{variant}: timing runtime-specific rewrites on {cfg.tune_device}")
                # fp16 inputs (``keep_io_types=False``) cannot take the float32 calibration feeds
                fp16_io = spec.float16 and not cfg.keep_io_types
                tuning = _tune(built, cfg.tune_device, [] if fp16_io else feeds)
            _say(progress, f"{variant}: comparing with the float model")
            agreement = measure_agreement(source, built, feeds)
            _say(progress, f"{variant}: agreement with the float model: {agreement.summary()}")
            publish_model(built, target)
            return VariantBuild(
                variant,
                str(source),
                str(target),
                time.perf_counter() - t0,
                cfg,
                attempts,
                opt.to_json(),
                cleanup,
                tuning,
                agreement=agreement,
            )

        _name_nodes(pre)
        # fp16 inputs (``keep_io_types=False``) cannot take the float32 calibration feeds
        fp16_io = spec.float16 and not cfg.keep_io_types
        probe_feeds = feeds[0] if feeds and not fp16_io else None

        def probed(candidate: Path, what: str) -> None:
            if probe:
                _say(progress, f"{variant}: loading {what} as it will be served (child process)")
                _probe(candidate, variant, cfg.tune_device or "cpu", probe_feeds, probe_timeout)

        if spec.converter is None:
            probed(pre, "the optimized model")
            only = Attempt(1, [], None, {})
            if accuracy_check is not None:
                only.accuracy_passed, only.measured = accuracy_check(pre)
            return finish(pre, [only], None)

        excluded = list(cfg.nodes_to_exclude)
        if spec.float16:
            overflow = fp16_overflow_nodes(pre, feeds[:8], workdir=stage)
            if overflow:
                _say(
                    progress,
                    f"{variant}: {len(overflow)} node(s) exceed the fp16 range: kept in fp32",
                )
            excluded = sorted(set(excluded) | set(overflow))
        attempts: list[Attempt] = []
        defects: list[dict[str, Any]] = []
        final: Path | None = None
        cleanup: dict[str, Any] | None = None
        conversion: dict[str, Any] | None = None
        stopped: str | None = None
        build_cfg = cfg  # an avoided runtime defect keeps more ops in float from then on
        for number in range(1, cfg.max_attempts + 1):
            work = stage / f"attempt{number}"
            work.mkdir()

            def convert(
                work: Path, bcfg: QuantizeConfig, excluded: list[str]
            ) -> tuple[Path, dict[str, Any]]:
                nonlocal conversion
                raw = work / "raw.onnx"
                advice = _DropPreprocessAdvice()
                # onnxruntime calls logging.warning(): the root logger's filter sees the record
                logging.getLogger().addFilter(advice)
                try:
                    # onnxruntime's calibrators print their progress: it goes to stderr, with
                    # the rest of the progress, and stdout keeps the command's results
                    with contextlib.redirect_stdout(sys.stderr):
                        conversion = spec.convert()(pre, raw, bcfg, excluded, feeds, progress)
                except GraphtrimError:
                    raise
                except Exception as exc:
                    raise QuantizeError(
                        f"{variant} conversion failed: {type(exc).__name__}: {exc}"
                    ) from exc
                finally:
                    logging.getLogger().removeFilter(advice)
                try:
                    raw = _sorted_output(raw)
                except Exception as exc:  # the converter wrote something onnx cannot parse
                    raise QuantizeError(
                        f"{variant}: the converted model is unusable: {exc}"
                    ) from exc
                clean = work / target.name
                _say(progress, f"{variant}: cleaning up after the conversion")
                try:
                    cleaned = optimize_file(
                        raw, clean, preset="safe", skip=_TUNED_REWRITES, check=True
                    )
                except (VerificationError, PassFailure):
                    raise  # a pass changed results or crashed: graphtrim's fault, said as such
                except GraphtrimError as exc:
                    # the converter wrote a model that cannot be read or loaded: this variant
                    # cannot be built (the others of a ``variants`` run go on)
                    raise QuantizeError(
                        f"{variant}: the converted model is unusable: {exc}"
                    ) from exc
                return clean, cleaned.to_json()

            _say(progress, f"{variant}: attempt {number}, {len(excluded)} node(s) kept in float")
            try:
                clean, cleanup = convert(work, build_cfg, excluded)
            except NothingToQuantize as exc:
                if final is None:
                    raise
                # the fallback kept every weight in float: the last attempt's file stands
                stopped = f"{exc}: attempt {number - 1}'s variant is kept, failing its check"
                _say(progress, f"{variant}: {stopped}")
                break
            try:
                probed(clean, f"attempt {number}")
            except QuantizeError as crash:
                avoided = None
                for known in RUNTIME_DEFECTS.get(variant, ()):
                    if set(known.keep_float) <= set(build_cfg.fp16_keep_float):
                        continue
                    _say(progress, f"{variant}: {crash}; building it {known.form}")
                    trial_cfg = dataclasses.replace(
                        build_cfg,
                        fp16_keep_float=sorted({*build_cfg.fp16_keep_float, *known.keep_float}),
                    )
                    trial = work / known.name
                    trial.mkdir()
                    clean_t, cleanup_t = convert(trial, trial_cfg, excluded)
                    try:
                        probed(clean_t, f"attempt {number} {known.form}")
                    except QuantizeError:
                        continue
                    build_cfg, clean, cleanup, avoided = trial_cfg, clean_t, cleanup_t, known
                    break
                if avoided is None:
                    raise
                defects.append({**avoided.to_json(), "seen": str(crash)})
            final = clean
            if accuracy_check is None:
                attempts.append(Attempt(number, list(excluded), None, {}))
                break
            passed, measured = accuracy_check(clean)
            attempt = Attempt(number, list(excluded), passed, measured)
            attempts.append(attempt)
            if passed or number == cfg.max_attempts:
                break
            sens_feeds = feeds[:8]
            if not sens_feeds:
                from graphtrim.data import input_specs, random_data

                sens_feeds = random_data(input_specs(pre), batches=4).batches
            _say(progress, f"{variant}: accuracy check failed; measuring per-node error")
            ranked = [
                e for e in node_errors(pre, clean, sens_feeds) if not set(e.nodes) <= set(excluded)
            ]
            attempt.most_sensitive = ranked[:10]
            picked = fallback_nodes(ranked, spec.converts, cfg.fallback_fraction, number)
            if not picked:
                break
            excluded = sorted(set(excluded) | set(picked))
        assert final is not None
        built = finish(final, attempts, cleanup)
        built.runtime_defects = defects
        built.conversion = conversion
        built.config = build_cfg  # what was built: with the ops an avoided defect kept in float
        built.stopped = stopped
        return built
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _probe(
    path: Path, variant: str, device: str, feeds: Feeds | None, timeout: float
) -> dict[str, Any]:
    """:func:`graphtrim.runtime.load_probe` in a child process; a crash or a hang there is
    a :class:`QuantizeError` saying what happened."""
    from graphtrim.isolation import ChildFailed, call_isolated
    from graphtrim.runtime import DeviceUnavailableError

    try:
        result: dict[str, Any] = call_isolated(
            "graphtrim.runtime:load_probe",
            str(path),
            common={"device": device, "feeds": feeds},
            timeout=timeout,
            what=f"{variant} candidate",
        )
    except ChildFailed as exc:
        raise QuantizeError(f"the {variant} model cannot be served: {exc}") from exc
    except DeviceUnavailableError:
        raise
    except InvalidModelError as exc:  # onnxruntime refused the candidate: this variant failed
        raise QuantizeError(f"the {variant} model cannot be served: {exc}") from exc
    return result


# runtime-specific forms a variant gets only where ``tune_device`` times them faster (``_tune``)
_TUNED_REWRITES = ("residual-sum",)


def _tune(built: Path, device: str, feeds: Sequence[Feeds]) -> dict[str, Any]:
    """Keep ``residual-sum`` in the built model where it is measurably faster on ``device``
    (timed on the first calibration batch, or random inputs without calibration data)."""
    from graphtrim.ort_target import tune_residual_sum
    from graphtrim.runtime import providers_for

    provider = providers_for(device)[0]
    try:
        return tune_residual_sum(built, provider, feeds=feeds[0] if feeds else None)
    except VerificationError:
        raise  # a rewrite that changed results: never a model to publish
    except Exception as exc:  # the timing itself failed: the variant stays as built
        logger.warning("tuning for %s skipped: %s", device, exc)
        return {
            "rewrite": "residual-sum",
            "kept": "original",
            "why": f"could not be timed: {type(exc).__name__}: {exc}",
        }
