"""Per-node error of a quantized (or fp16) model against its float model.

Both models expose every float tensor the float model's nodes produce and that the quantized
model still computes under the same name (QDQ and the fp16 converter keep node output names);
both run on the same feeds. For a tensor ``t`` the error is the relative L2 distance
``||q(t) - f(t)|| / ||f(t)||`` averaged over the feeds. A node's *local* error is the error of
its output minus the largest error among its inputs: what this node adds, not what it
inherited. Nodes are ranked by local error; the fallback moves the top ones back to float.

The QDQ quantizer fuses an activation into its producer (Conv + Relu, Gemm + Relu): the
producer's own output is gone from the quantized model and the activation's output carries the
error of both. Such a producer is listed in ``fused`` of the activation's entry, its inputs count
as the activation's for the inherited error, and the fallback keeps both in float: keeping only
the activation in float would still quantize the producer's output, the error's source.

Only the nodes a variant's converter changes are candidates (:func:`fallback_nodes`): in a
weight-only variant every other node computes in float already, and its local error is what the
quantized MatMuls before it sent, amplified (an RMS normalization, a Softmax); keeping it "in
float" would spend an attempt and change nothing.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

import numpy as np
import onnx

from graphtrim.data import Feeds


@dataclasses.dataclass(frozen=True)
class NodeError:
    node: str
    op_type: str
    output: str
    error: float
    local_error: float
    fused: tuple[str, ...] = ()

    @property
    def nodes(self) -> tuple[str, ...]:
        """The float model's nodes this entry stands for: its own and those fused into it."""
        return (*self.fused, self.node)

    def to_json(self) -> dict[str, object]:
        doc = dataclasses.asdict(self)
        doc["fused"] = list(self.fused)
        return doc


_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE}


def _float_tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False)
    types: dict[str, int] = {}
    for vi in [*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input]:
        if vi.type.HasField("tensor_type"):
            types[vi.name] = vi.type.tensor_type.elem_type
    return types


def _with_outputs(
    model: onnx.ModelProto, names: Sequence[str], types: dict[str, int]
) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    existing = {o.name for o in out.graph.output}
    for name in names:
        if name not in existing:
            out.graph.output.append(onnx.helper.make_tensor_value_info(name, types[name], None))
    return out


def _outputs(
    model_path: str | os.PathLike[str],
    structure: onnx.ModelProto,
    names: Sequence[str],
    types: dict[str, int],
    feeds: Sequence[Feeds],
) -> list[list[np.ndarray]]:
    """Run the model at ``model_path`` with ``names`` as extra outputs on every feed.

    ``structure`` is the model without its external weights: the copy with more outputs is
    written beside the original (a hidden file, removed after), so that its external-data
    references still resolve and no weight is loaded or copied here; onnxruntime alone holds
    them, one session at a time."""
    import tempfile

    import onnxruntime as ort

    from graphtrim.runtime import session_options

    model = _with_outputs(structure, names, types)
    folder = os.path.dirname(os.path.abspath(model_path))
    fd, path = tempfile.mkstemp(prefix=".graphtrim-sens-", suffix=".onnx", dir=folder)
    os.close(fd)
    try:
        onnx.save(model, path)
        del model
        sess = ort.InferenceSession(
            path, session_options(1, optimize=False), providers=["CPUExecutionProvider"]
        )
        return [sess.run(list(names), feed) for feed in feeds]
    finally:
        os.unlink(path)


def node_errors(
    float_model: str | os.PathLike[str],
    quant_model: str | os.PathLike[str],
    feeds: Sequence[Feeds],
) -> list[NodeError]:
    """Rank the float model's nodes by the error they add in the quantized model."""

    # the structure only: external weights stay on disk (onnxruntime reads them)
    fmodel = onnx.load(str(float_model), load_external_data=False)
    qmodel = onnx.load(str(quant_model), load_external_data=False)
    ftypes = _float_tensor_types(fmodel)
    qtypes = _float_tensor_types(qmodel)
    q_produced = {o for n in qmodel.graph.node for o in n.output}
    # what the quantized model's consumers read in place of a tensor: its Q -> DQ output when
    # it has one (the QDQ quantizer may also fold an activation into the producer and give the
    # producer's pre-activation output the activation's name; the DQ output is clamped again)
    q_consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in qmodel.graph.node:
        for i in n.input:
            q_consumers.setdefault(i, []).append(n)

    def effective(t: str) -> str:
        for q in q_consumers.get(t, []):
            if q.op_type == "QuantizeLinear":
                for dq in q_consumers.get(q.output[0], []):
                    if dq.op_type == "DequantizeLinear":
                        return dq.output[0]
        return t

    producer: dict[str, onnx.NodeProto] = {}
    for node in fmodel.graph.node:
        for o in node.output:
            if o:
                producer[o] = node
    compared = [
        t
        for t, node in producer.items()
        if ftypes.get(t) in _FLOAT_TYPES
        and t in q_produced
        and qtypes.get(effective(t), onnx.TensorProto.FLOAT) in _FLOAT_TYPES
    ]
    if not compared:
        return []
    q_names = [effective(t) for t in compared]
    qtypes = {**qtypes, **{e: qtypes.get(e, onnx.TensorProto.FLOAT) for e in q_names}}
    # one session at a time: the float model's outputs are kept, then the quantized model runs
    f_runs = _outputs(float_model, fmodel, compared, ftypes, feeds)
    q_runs = _outputs(quant_model, qmodel, q_names, qtypes, feeds)
    sums = dict.fromkeys(compared, 0.0)
    for f_out, q_out in zip(f_runs, q_runs, strict=True):
        for t, fa, qa in zip(compared, f_out, q_out, strict=True):
            a = np.asarray(fa, dtype=np.float64)
            b = np.asarray(qa, dtype=np.float64)
            if a.shape != b.shape:
                continue
            norm = float(np.linalg.norm(a))
            diff = float(np.linalg.norm(a - b))
            sums[t] += diff / norm if norm > 0 else (0.0 if diff == 0 else 1.0)
    del f_runs, q_runs
    n = max(1, len(feeds))
    err = {t: s / n for t, s in sums.items()}
    readers: dict[str, int] = {}
    for node in fmodel.graph.node:
        for i in node.input:
            readers[i] = readers.get(i, 0) + 1

    def fused_into(node: onnx.NodeProto) -> list[onnx.NodeProto]:
        """Producers whose only output the quantized model no longer has and ``node`` alone read."""
        found = []
        for i in node.input:
            p = producer.get(i)
            if (
                p is not None
                and len(p.output) == 1
                and i not in q_produced
                and readers.get(i) == 1
                and ftypes.get(i) in _FLOAT_TYPES
            ):
                found.append(p)
        return found

    ranked: list[NodeError] = []
    for t in compared:
        node = producer[t]
        fused = fused_into(node)
        sources = [i for i in node.input if i and producer.get(i) not in fused]
        sources += [i for p in fused for i in p.input if i]
        inherited = max((err.get(i, 0.0) for i in sources), default=0.0)
        ranked.append(
            NodeError(
                node.name,
                node.op_type,
                t,
                err[t],
                err[t] - inherited,
                tuple(p.name for p in fused),
            )
        )
    ranked.sort(key=lambda e: e.local_error, reverse=True)
    return ranked


def fallback_nodes(
    ranked: Sequence[NodeError],
    converts: Sequence[str] | None,
    fraction: float,
    attempt: int,
) -> list[str]:
    """The nodes the next attempt keeps in float, after ``attempt`` failed: of the ranked
    entries whose op the converter changes (``converts``; None: any op), the
    ``ceil(fraction * candidates) * attempt`` that add the most error (at least one; only
    those that add any). Empty: nothing left that keeping in float could help."""
    candidates = [e for e in ranked if converts is None or e.op_type in converts]
    positive = [e for e in candidates if e.local_error > 0]
    k = max(1, math.ceil(fraction * len(candidates)) * attempt)
    return sorted({n for e in positive[:k] for n in e.nodes})
