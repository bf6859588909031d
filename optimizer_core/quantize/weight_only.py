"""Block-wise weight-only quantization of MatMul weights (``int4-weight``, ``int8-weight``).

The weights are quantized by onnxruntime's ``matmul_nbits_quantizer`` (round-to-nearest, or
HQQ), which writes onnxruntime's contrib op ``MatMulNBits``. That is the ``ort`` form. The
``portable`` form is the same quantized weights written with standard ops only: each
``MatMulNBits`` becomes ``DequantizeLinear`` (``block_size``, opset 21) of a 4- or 8-bit
integer weight, then ``MatMul`` (and ``Add`` for a bias). Both forms hold the same integers and
scales, so they compute the same numbers; they differ only in the kernels a runtime picks.

Two defects of the quantizer are avoided here:

* it raises a model's default-domain opset to 21 by rewriting the import alone (its own log
  says "the generated model may not be a valid model"): a ``ReduceMean`` with an ``axes``
  attribute, or a ``Split`` with ``split``, is then invalid. The model is converted properly
  (onnx's version converter, :func:`graphtrim.graph.opset.upgrade_opset`) before the quantizer
  sees it, whenever the form needs opset 21;
* its QDQ output exists for 4 bits only; the lowering (:mod:`graphtrim.quantize.nbits_lowering`)
  writes 8 bits too.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx

from graphtrim.modelio.protos import all_graphs, node_subgraphs
from graphtrim.quantize.nbits_lowering import (
    lower_matmul_nbits,
)
from graphtrim.quantize.weight_settings import (
    DEFAULT_ACCURACY_LEVEL,
    PORTABLE_OPSET,
    WeightOnlySettings,
    _default_opset,
)
from graphtrim.quantize.weight_settings import (
    WeightOnlyError as WeightOnlyError,  # its import path before it moved
)

logger = logging.getLogger("graphtrim.quantize")


def _raised_opset(src: Path, work: Path) -> Path:
    """``src`` converted to opset 21 (written under ``work``), or ``src`` when it is there."""
    import onnx_ir as ir

    from graphtrim.graph.opset import upgrade_opset
    from graphtrim.modelio import load_model, save_model

    head = onnx.load(str(src), load_external_data=False)
    if _default_opset(head) >= PORTABLE_OPSET:
        return src
    del head
    model: ir.Model = load_model(src)
    upgraded, note = upgrade_opset(model, PORTABLE_OPSET)
    logger.info("%s", note)
    out = work / f"opset{PORTABLE_OPSET}.onnx"
    save_model(upgraded, out)
    return out


def quantize_weights(
    src: Path,
    dst: Path,
    settings: WeightOnlySettings,
    excluded: Sequence[str] = (),
    work: Path | None = None,
) -> dict[str, Any]:
    """Quantize the MatMul weights of the model at ``src`` into ``dst``; what was done.

    ``excluded`` nodes stay in float. ``work`` is a folder for intermediate files (``dst``'s
    folder without it)."""
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq
    from onnxruntime.quantization.quant_utils import QuantFormat

    settings.validate()
    if settings.form == "ort" and settings.accuracy_level is None:
        settings = dataclasses.replace(settings, accuracy_level=DEFAULT_ACCURACY_LEVEL)
    folder = work or dst.parent
    source = _raised_opset(src, folder) if settings.form == "portable" else src
    if settings.algorithm == "hqq":
        algo: Any = mnq.HQQWeightOnlyQuantConfig(
            block_size=settings.block_size, bits=settings.bits, op_types_to_quantize=("MatMul",)
        )
    else:
        algo = mnq.DefaultWeightOnlyQuantConfig(
            block_size=settings.block_size,
            is_symmetric=settings.symmetric,
            accuracy_level=settings.accuracy_level,
            quant_format=QuantFormat.QOperator,
            op_types_to_quantize=("MatMul", "Gather") if settings.embeddings else ("MatMul",),
            bits=settings.bits,
        )
    # the graph without its weights: each MatMul's weight is read when its turn comes, into a
    # message of its own that goes once the weight is quantized (protobuf's arena would keep
    # the memory of every weight read into the model's own message until the model goes)
    model = onnx.load(str(source), load_external_data=False)
    quantizer = mnq.MatMulNBitsQuantizer(
        model,
        bits=settings.bits,
        block_size=settings.block_size,
        is_symmetric=settings.symmetric,
        accuracy_level=settings.accuracy_level,
        algo_config=algo,
    )
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.add(domain="com.microsoft", version=1)
    ops = {"MatMul": 1, **({"Gather": 0} if settings.embeddings else {})}
    _quantize_graph(quantizer.node_quantizer, [model.graph], set(excluded), source.parent, ops)
    _drop_unread(model.graph)
    _load_external(model.graph, source.parent)  # what stays in float
    del quantizer
    quantized = _count(model.graph, "MatMulNBits", "com.microsoft")
    record: dict[str, Any] = {
        **dataclasses.asdict(settings),
        "matmuls_quantized": quantized,
        "opset": _default_opset(model),
    }
    if settings.embeddings:
        record["gathers_quantized"] = _count(model.graph, "GatherBlockQuantized", "com.microsoft")
    if settings.form == "portable":
        record["lowered"] = lower_matmul_nbits(model)
        record["opset"] = _default_opset(model)
    # the weights go to a data file tensor by tensor: serializing a model with its weights
    # inline took 2.5 GiB over the 1.4 GiB the process held (int8-weight of a 1.5 GB decoder)
    onnx.save(
        model,
        str(dst),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=f"{dst.name}.data",
    )
    return record


def _quantize_graph(
    quantize: Any,
    stack: list[onnx.GraphProto],
    excluded: set[str],
    base: Path,
    ops: dict[str, int],
) -> None:
    """Each node of ``stack[-1]`` (and of its subgraphs) whose op is in ``ops`` (op -> the
    input holding its weight: MatMul's B, Gather's table) and whose weight is a constant,
    quantized by onnxruntime's node quantizer ``quantize`` one at a time: the weight (found in
    this graph or an enclosing one) is read alone into a graph of its own, and what the
    quantizer writes there goes to the graph that held the weight."""
    graph = stack[-1]
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        for sub in node_subgraphs(node):
            _quantize_graph(quantize, [*stack, sub], excluded, base, ops)
        slot = ops.get(node.op_type)
        weight_name = node.input[slot] if slot is not None and len(node.input) > slot else ""
        owner = _owner(stack, weight_name) if weight_name else None
        if (
            owner is None
            or node.domain not in ("", "ai.onnx")
            or (node.name and node.name in excluded)
        ):
            nodes.append(node)
            continue
        alone = onnx.GraphProto()
        weight = alone.initializer.add()
        weight.CopyFrom(next(t for t in owner.initializer if t.name == weight_name))
        if weight.data_location == onnx.TensorProto.EXTERNAL:
            _read_external(weight, base)
        written = quantize.quantize(node, [alone])
        if len(written) == 1 and written[0] is node:
            nodes.append(node)  # not a weight the quantizer takes
            continue
        # a weight read by two MatMuls is quantized twice to the same tensors: kept once
        have = {t.name for t in owner.initializer}
        owner.initializer.extend(
            t for t in alone.initializer if t.name != weight_name and t.name not in have
        )
        nodes.extend(written)
        del alone, weight
    graph.ClearField("node")
    graph.node.extend(nodes)


def _owner(stack: list[onnx.GraphProto], name: str) -> onnx.GraphProto | None:
    """The innermost graph of ``stack`` whose initializers hold ``name`` (none where a node or
    an input of a nearer scope defines it)."""
    for graph in reversed(stack):
        if any(t.name == name for t in graph.initializer):
            return graph
        if any(name in n.output for n in graph.node) or any(i.name == name for i in graph.input):
            return None
    return None


def _drop_unread(graph: onnx.GraphProto) -> None:
    """Initializers no node reads any more (the float weights now quantized), in every graph."""
    graphs = list(all_graphs(graph))
    read = {name for g in graphs for n in g.node for name in n.input}
    read |= {o.name for g in graphs for o in g.output}  # a branch may return a constant
    for g in graphs:
        keep = [t for t in g.initializer if t.name in read]
        if len(keep) != len(g.initializer):
            g.ClearField("initializer")
            g.initializer.extend(keep)


def _read_external(tensor: onnx.TensorProto, base: Path) -> None:
    from onnx.external_data_helper import load_external_data_for_tensor

    load_external_data_for_tensor(tensor, str(base))
    tensor.data_location = onnx.TensorProto.DEFAULT
    del tensor.external_data[:]


def _load_external(graph: onnx.GraphProto, base: Path) -> None:
    """Read the data of every external initializer into the model, in every graph."""
    for g in list(all_graphs(graph)):
        for tensor in g.initializer:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                _read_external(tensor, base)


def _count(graph: onnx.GraphProto, op_type: str, domain: str) -> int:
    """Nodes of ``op_type`` in ``domain`` in ``graph`` and its subgraphs."""
    return sum(
        (n.op_type == op_type and n.domain == domain)
        + sum(_count(g, op_type, domain) for g in node_subgraphs(n))
        for n in graph.node
    )
