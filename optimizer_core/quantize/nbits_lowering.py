"""The portable form of a weight-only variant: each onnxruntime ``MatMulNBits`` rewritten as
``DequantizeLinear(block_size) -> MatMul [-> Add]`` with standard ops only, its packed weights
unpacked (and 4-bit values packed the way ONNX stores them)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.numpy_helper as onh

from graphtrim.modelio.protos import node_subgraphs
from graphtrim.quantize.weight_settings import (
    PORTABLE_OPSET,
    WeightOnlyError,
    _default_opset,
)


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


def _reads_domain(graph: onnx.GraphProto, domain: str) -> bool:
    return any(
        n.domain == domain or any(_reads_domain(g, domain) for g in node_subgraphs(n))
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
        for sub in node_subgraphs(node):
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
    for sub in node_subgraphs(node):
        for inner in sub.node:
            names |= _reads(inner)
    return names
