"""The float16 converters: onnxruntime's float16 converter (values out of fp16's range kept
in float32), and ``int4-fp16``: float16 activations with 4-bit block-wise MatMul weights."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from graphtrim.data import Feeds
from graphtrim.quantize.config import FP16_MAX
from graphtrim.quantize.convert import Conversion
from graphtrim.quantize.order import toposort


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


def convert_fp16(job: Conversion) -> None:
    """float16 with onnxruntime's converter (``config.fp16_keep_float`` op types stay float32)."""
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    model = onnx.load(str(job.source))
    converted = convert_float_to_float16(
        model,
        keep_io_types=job.config.keep_io_types,
        op_block_list=[*DEFAULT_OP_BLOCK_LIST, *job.config.fp16_keep_float],
        node_block_list=list(job.excluded),
    )
    toposort(converted.graph)
    _drop_fp16_round_trips(converted)
    big = converted.ByteSize() > 1_500_000_000 if converted.ByteSize() >= 0 else True
    onnx.save(
        converted,
        str(job.target),
        save_as_external_data=big,
        location=job.target.name + ".data" if big else None,
    )


def convert_int4_fp16(job: Conversion) -> dict[str, Any]:
    """float16 activations (:func:`convert_fp16`), then 4-bit block-wise MatMul weights
    quantized from their float16 values: ``MatMulNBits`` (ort form) or ``DequantizeLinear``
    (portable) with float16 scales, so every MatMul computes in float16 (GPU kernels). Nodes
    kept in float after a failed accuracy check stay float32 with float32 weights."""
    from graphtrim.quantize.weight_converters import convert_weight_only

    with tempfile.TemporaryDirectory(prefix="graphtrim-int4-fp16-", dir=job.target.parent) as tmp:
        half = Path(tmp) / "fp16.onnx"
        convert_fp16(dataclasses.replace(job, target=half))
        record = convert_weight_only(4, dataclasses.replace(job, source=half))
    return {**record, "activations": "float16"}
