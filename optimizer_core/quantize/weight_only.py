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
* its QDQ output exists for 4 bits only; the lowering here writes 8 bits too.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper as onh

from graphtrim.errors import GraphtrimError

logger = logging.getLogger("graphtrim.quantize")

WEIGHT_ALGORITHMS: tuple[str, ...] = ("rtn", "hqq")
WEIGHT_FORMS: tuple[str, ...] = ("ort", "portable")
# MatMulNBits' accuracy_level when none is asked for: int8 compute. onnxruntime's CPU kernels
# for level 0 (float compute) are slower than float MatMul on 8 bits (21x measured on a decode
# step) and no faster on 4 bits at sequence length 64; onnxruntime fuses the portable form into
# MatMulNBits at this level too (its session.qdq_matmulnbits_accuracy_level defaults to 4)
DEFAULT_ACCURACY_LEVEL = 4
# the opset whose DequantizeLinear has block_size and int4 inputs
PORTABLE_OPSET = 21


class WeightOnlyError(GraphtrimError):
    """A weight-only variant cannot be built with the settings asked for."""


@dataclasses.dataclass(frozen=True)
class WeightOnlySettings:
    bits: int
    block_size: int
    symmetric: bool
    algorithm: str
    form: str
    accuracy_level: int | None = None
    # Gather tables (token embeddings) too: onnxruntime's GatherBlockQuantized (ort form, 4 bits)
    embeddings: bool = False

    def validate(self) -> None:
        if self.bits not in (4, 8):
            raise WeightOnlyError(f"weight-only quantization has 4 or 8 bits, not {self.bits}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise WeightOnlyError(
                f"block size must be a power of two of at least 16, not {self.block_size}"
            )
        if self.algorithm not in WEIGHT_ALGORITHMS:
            raise WeightOnlyError(
                f"unknown weight algorithm '{self.algorithm}': use one of "
                f"{', '.join(WEIGHT_ALGORITHMS)}"
            )
        if self.form not in WEIGHT_FORMS:
            raise WeightOnlyError(
                f"unknown weight form '{self.form}': use one of {', '.join(WEIGHT_FORMS)}"
            )
        if self.algorithm == "hqq":
            if self.bits != 4:
                raise WeightOnlyError("HQQ quantizes to 4 bits only")
            if self.form == "portable":
                raise WeightOnlyError(
                    "HQQ's zero points are floats, which DequantizeLinear cannot take: "
                    "use the ort form, or the rtn algorithm for the portable one"
                )
            if self.symmetric:
                raise WeightOnlyError("HQQ is asymmetric: its zero points are fitted")
        if self.embeddings and (self.form != "ort" or self.bits != 4 or self.algorithm != "rtn"):
            raise WeightOnlyError(
                "embedding tables are quantized in the ort form, with 4 bits and rtn only "
                "(onnxruntime's GatherBlockQuantized; onnx's Gather takes no 4-bit table, so "
                "the portable form has no standard op for it)"
            )
        if self.accuracy_level is not None and self.accuracy_level not in (0, 1, 2, 3, 4):
            raise WeightOnlyError("accuracy level is 0 to 4 (MatMulNBits' accuracy_level)")
        if self.accuracy_level is not None and self.form == "portable":
            raise WeightOnlyError(
                "accuracy level is an attribute of the ort form only (onnxruntime picks it "
                "for the portable form: session option session.qdq_matmulnbits_accuracy_level)"
            )


def _default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


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


def _unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Rows of ``bits``-bit unsigned values packed low nibble first, ``count`` per row."""
    rows = packed.reshape(packed.shape[0], -1)
    if bits == 8:
        return rows[:, :count].astype(np.uint8)
    out = np.empty((rows.shape[0], rows.shape[1] * 2), dtype=np.uint8)
    out[:, 0::2] = rows & 0x0F
    out[:, 1::2] = rows >> 4
    return out[:, :count]


def _pack4(values: np.ndarray) -> bytes:
    """4-bit values (row-major, as int8/uint8) packed two per byte, the first in the low nibble."""
    flat = (values.reshape(-1).astype(np.int16) & 0x0F).astype(np.uint8)
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    return (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8).tobytes()


def _int_tensor(values: np.ndarray, bits: int, signed: bool, name: str) -> onnx.TensorProto:
    if bits == 8:
        return onh.from_array(values.astype(np.int8 if signed else np.uint8), name)
    dtype = onnx.TensorProto.INT4 if signed else onnx.TensorProto.UINT4
    return onnx.helper.make_tensor(name, dtype, list(values.shape), _pack4(values), raw=True)


def lower_matmul_nbits(model: onnx.ModelProto) -> int:
    """Rewrite every ``MatMulNBits`` of ``model`` (opset 21 or later; subgraphs included) as
    ``DequantizeLinear(block_size) -> MatMul [-> Add]``, in place; the number rewritten.

    MatMulNBits holds ``B`` as ``[N, blocks, block_size * bits / 8]`` bytes (transposed,
    zero-padded to whole blocks), scales as ``N * blocks`` and optional zero points packed
    the same way (default ``2^(bits-1)``). The portable weight is ``[K, N]``: a signed integer
    without zero point where the quantizer wrote none (symmetric), else unsigned with
    ``[blocks, N]`` zero points."""
    if _default_opset(model) < PORTABLE_OPSET:
        raise WeightOnlyError(f"the portable form needs opset {PORTABLE_OPSET}")
    spent: list[tuple[onnx.GraphProto, str]] = []
    lowered = _lower_graph(model.graph, [], {}, spent)
    # the packed tensors go, unless something else still reads them. Deleted in place, one by
    # one: rebuilding the repeated field copies every tensor into the model's arena, whose
    # memory protobuf frees only with the model (a 124 M-parameter model ran out of 24 GiB)
    read = _reads_graph(model.graph)
    gone: dict[int, tuple[onnx.GraphProto, set[str]]] = {}
    for owner, name in spent:
        if name not in read:
            gone.setdefault(id(owner), (owner, set()))[1].add(name)
    for owner, names in gone.values():
        for i in reversed([i for i, t in enumerate(owner.initializer) if t.name in names]):
            del owner.initializer[i]
    if lowered and not _reads_domain(model.graph, "com.microsoft"):
        imports = [o for o in model.opset_import if o.domain != "com.microsoft"]
        del model.opset_import[:]
        model.opset_import.extend(imports)
    return lowered


def _graphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    """``graph`` and every graph nested in it."""
    out = [graph]
    for node in graph.node:
        for sub in _subgraphs(node):
            out.extend(_graphs(sub))
    return out


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
        for sub in _subgraphs(node):
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
    graphs = _graphs(graph)
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
    for g in _graphs(graph):
        for tensor in g.initializer:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                _read_external(tensor, base)


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    out: list[onnx.GraphProto] = []
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            out.append(attr.g)
        elif attr.type == onnx.AttributeProto.GRAPHS:
            out.extend(attr.graphs)
    return out


def _count(graph: onnx.GraphProto, op_type: str, domain: str) -> int:
    """Nodes of ``op_type`` in ``domain`` in ``graph`` and its subgraphs."""
    return sum(
        (n.op_type == op_type and n.domain == domain)
        + sum(_count(g, op_type, domain) for g in _subgraphs(n))
        for n in graph.node
    )


def _reads_domain(graph: onnx.GraphProto, domain: str) -> bool:
    return any(
        n.domain == domain or any(_reads_domain(g, domain) for g in _subgraphs(n))
        for n in graph.node
    )


def _lower_graph(
    graph: onnx.GraphProto,
    outer: list[onnx.GraphProto],
    written: dict[tuple[int, str, str, str, int], list[str]],
    spent: list[tuple[onnx.GraphProto, str]],
) -> int:
    """Lower the MatMulNBits of ``graph`` and its subgraphs. ``written``: the DQ inputs made
    for a packed weight (by its graph and names), shared by every graph that reads it;
    ``spent``: the packed tensors, removed by the caller once nothing reads them."""
    stack = [*outer, graph]

    def find(name: str) -> tuple[onnx.GraphProto, onnx.TensorProto]:
        for g in reversed(stack):
            for t in g.initializer:
                if t.name == name:
                    return g, t
        raise WeightOnlyError(f"MatMulNBits input {name} is not a constant")

    lowered = 0
    nodes: list[onnx.NodeProto] = []
    made: dict[tuple[str, ...], str] = {}  # this graph's DQ outputs, by MatMulNBits weights
    for node in graph.node:
        for sub in _subgraphs(node):
            lowered += _lower_graph(sub, stack, written, spent)
        if node.op_type != "MatMulNBits" or node.domain != "com.microsoft":
            nodes.append(node)
            continue
        if not node.name:  # output names are unique; node names must be too
            node.name = f"{node.output[0]}_MatMul"
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        k, n, bits, block = attrs["K"], attrs["N"], attrs["bits"], attrs["block_size"]
        a_name, b_name, s_name, zp_name, g_idx, bias = (list(node.input) + [""] * 6)[:6]
        if g_idx:
            raise WeightOnlyError(f"{node.name}: MatMulNBits with g_idx has no portable form")
        key = (b_name, s_name, zp_name, str(block))
        if key in made:  # a weight shared by several MatMuls is dequantized once
            nodes.extend(_matmul(node, a_name, made[key], bias))
            lowered += 1
            continue
        home, b_tensor = find(b_name)
        shared = (id(home), b_name, s_name, zp_name, block)
        if shared not in written:
            written[shared] = _dequantize_inputs(
                node.name,
                b_tensor,
                find(s_name)[1],
                find(zp_name)[1] if zp_name else None,
                k,
                n,
                bits,
                block,
                home,
            )
            spent += [(home, b_name), (find(s_name)[0], s_name)]
            if zp_name:
                spent.append((find(zp_name)[0], zp_name))
        dq_inputs = written[shared]
        w_name = made[key] = f"{node.name}_DQ_out"
        nodes.append(
            onnx.helper.make_node(
                "DequantizeLinear",
                dq_inputs,
                [w_name],
                name=f"{node.name}_DequantizeLinear",
                axis=0,
                block_size=block,
            )
        )
        nodes.extend(_matmul(node, a_name, w_name, bias))
        lowered += 1
    if lowered:
        del graph.node[:]
        graph.node.extend(nodes)
    return lowered


def _dequantize_inputs(
    label: str,
    b_tensor: onnx.TensorProto,
    s_tensor: onnx.TensorProto,
    zp_tensor: onnx.TensorProto | None,
    k: int,
    n: int,
    bits: int,
    block: int,
    home: onnx.GraphProto,
) -> list[str]:
    """The ``[K, N]`` integer weight, ``[blocks, N]`` scales (and zero points) of one
    MatMulNBits weight, added to ``home``; their names."""
    blocks = (k + block - 1) // block
    q = _unpack(onh.to_array(b_tensor), bits, blocks * block)  # [N, blocks * block]
    scales = onh.to_array(s_tensor).reshape(n, blocks)
    weight = q[:, :k].T  # [K, N]
    base = b_tensor.name.removesuffix(f"_Q{bits}")
    names = [f"{base}_DQ_W{bits}", f"{base}_DQ_scales"]
    added = [onh.from_array(np.ascontiguousarray(scales.T), names[1])]
    if zp_tensor is not None:
        zp_values = onh.to_array(zp_tensor)
        if zp_values.dtype != np.uint8:
            raise WeightOnlyError(
                f"{label}: zero points of type {zp_values.dtype} have no portable form"
            )
        zp = _unpack(zp_values.reshape(n, -1), bits, blocks)  # [N, blocks]
        added.append(_int_tensor(weight, bits, False, names[0]))
        added.append(_int_tensor(np.ascontiguousarray(zp.T), bits, False, f"{base}_DQ_zp"))
        names.append(f"{base}_DQ_zp")
    else:
        signed = weight.astype(np.int16) - (1 << (bits - 1))
        added.append(_int_tensor(signed, bits, True, names[0]))
    taken = {t.name for t in home.initializer}
    if taken & {t.name for t in added}:
        raise WeightOnlyError(f"{label}: initializer names {names} are taken")
    home.initializer.extend(added)
    return names


def _matmul(node: onnx.NodeProto, a_name: str, w_name: str, bias: str) -> list[onnx.NodeProto]:
    if not bias:
        return [
            onnx.helper.make_node("MatMul", [a_name, w_name], list(node.output), name=node.name)
        ]
    out = f"{node.output[0]}_before_bias"
    return [
        onnx.helper.make_node("MatMul", [a_name, w_name], [out], name=node.name),
        onnx.helper.make_node("Add", [out, bias], list(node.output), name=f"{node.name}_bias"),
    ]


def _reads_graph(graph: onnx.GraphProto) -> set[str]:
    return {i for nd in graph.node for i in _reads(nd)}


def _reads(node: onnx.NodeProto) -> set[str]:
    names = {i for i in node.input if i}
    for sub in _subgraphs(node):
        for inner in sub.node:
            names |= _reads(inner)
    return names
