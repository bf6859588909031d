"""Inputs for verification: seeded random values of each input's type and shape (symbolic dims
bound by name), the inputs a model declares, and copies of a model that onnxruntime accepts."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from graphtrim.modelio.protos import all_nodes

_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
    "tensor(int8)": np.int8,
    "tensor(int16)": np.int16,
    "tensor(int32)": np.int32,
    "tensor(int64)": np.int64,
    "tensor(uint8)": np.uint8,
    "tensor(uint16)": np.uint16,
    "tensor(uint32)": np.uint32,
    "tensor(uint64)": np.uint64,
    "tensor(bool)": np.bool_,
    "tensor(string)": np.str_,
}

# what random string inputs are drawn from: short words, an empty string and an unusual one
STRING_VALUES = ("a", "b", "high", "low", "", "zz-unseen")


def _unique_node_names(source: str | bytes) -> bytes | None:
    """The model with repeated node names made unique (``name__2``, ...), serialized; ``None``
    where it cannot be held in one protobuf."""
    from graphtrim.modelio import PROTO_LIMIT_BYTES

    try:
        if isinstance(source, bytes):
            proto = onnx.load_from_string(source)
        else:  # external data follows, relative to the model's own folder
            proto = onnx.load(source)
    except Exception:  # onnxruntime's own refusal says more
        return None
    seen: set[str] = set()
    for node in all_nodes(proto.graph):  # each renamed before its subgraphs' nodes are seen
        if node.name:
            name, k = node.name, 1
            while name in seen:
                k += 1
                name = f"{node.name}__{k}"
            node.name = name
            seen.add(name)
    if proto.ByteSize() >= PROTO_LIMIT_BYTES:
        return None
    return proto.SerializeToString()


def make_inputs(
    specs: Sequence[tuple[str, Any, Sequence[int | str | None]]],
    *,
    seed: int,
    dim_values: Mapping[str, int] | None = None,
    default_dim: int = 2,
) -> dict[str, np.ndarray]:
    """Seeded random feeds; a named symbolic dim gets the same size everywhere it appears.

    A decoder with a KV cache (inputs named ``past...``, as transformers, Optimum and
    onnxruntime-genai write them) is fed as it runs: the attention mask covers the cached and
    the new tokens (its length is the sum when it has a dim of its own), every position
    attends (ones), position ids count on from the cache's length, and the batch is one
    sequence (unless ``dim_values`` says otherwise)."""
    rng = np.random.default_rng(seed)
    bound: dict[str, int] = dict(dim_values or {})
    from graphtrim.runtime import decoder_dims

    decoder = decoder_dims(specs, bound, default_dim)
    feeds: dict[str, np.ndarray] = {}
    for name, type_str, shape in specs:
        dtype = _ORT_TYPES.get(type_str)
        if dtype is None:
            raise ValueError(
                f"input '{name}' has type {type_str}, which random inputs cannot fill; pass inputs"
            )
        dims: list[int] = []
        for d in shape:
            if isinstance(d, int) and d >= 0:
                dims.append(d)
            elif isinstance(d, str) and d:
                dims.append(bound.setdefault(d, default_dim))
            else:
                dims.append(default_dim)
        arr: np.ndarray
        if decoder is not None and name == "attention_mask" and np.issubdtype(dtype, np.integer):
            arr = np.ones(dims, dtype=dtype)
        elif decoder is not None and name == "position_ids" and np.issubdtype(dtype, np.integer):
            past = decoder
            arr = np.broadcast_to(np.arange(past, past + dims[-1], dtype=dtype), dims).copy()
        elif dtype == np.str_:
            arr = np.array(STRING_VALUES, dtype=object)[
                rng.integers(0, len(STRING_VALUES), size=dims)
            ]
        elif dtype == np.bool_:
            arr = rng.integers(0, 2, size=dims).astype(np.bool_)
        elif np.issubdtype(dtype, np.integer):
            arr = rng.integers(0, 8, size=dims).astype(dtype)
        else:
            arr = rng.standard_normal(size=dims).astype(dtype)
        feeds[name] = arr
    return feeds


def _dims_hint(
    specs: Sequence[tuple[str, Any, Sequence[int | str | None]]],
    dim_values: Mapping[str, int] | None,
    default_dim: int = 2,
) -> str:
    """Where random inputs sized the model's symbolic dims: which sizes they took, and how to
    set them (a model that cannot run at the default size is not a changed result)."""
    given = dict(dim_values or {})
    from graphtrim.runtime import decoder_dims

    decoder_dims(specs, given, default_dim)  # the sizes make_inputs derives for decoders
    named = {d for _, _, shape in specs for d in shape if isinstance(d, str) and d}
    unnamed = any(d is None or (isinstance(d, int) and d < 0) for _, _, s in specs for d in s)
    if not named and not unnamed:
        return ""
    sizes = ", ".join(f"{d}={given.get(d, default_dim)}" for d in sorted(named))
    if unnamed:
        sizes += (", " if sizes else "") + f"unnamed dims={default_dim}"
    return (
        f" (symbolic dims sized {sizes}; set them with --dim NAME=SIZE, or compare on inputs "
        "of your own with --inputs FEEDS.npz)"
    )


def declared_input_specs(
    path: str | os.PathLike[str],
) -> list[tuple[str, Any, list[int | str | None]]]:
    """The model's inputs as :func:`graphtrim.data.input_specs` gives them, read from the graph
    without loading it into a runtime (nor its weights): where loading is what may fail."""
    proto = onnx.load(str(path), load_external_data=False)
    weights = {t.name for t in proto.graph.initializer}
    specs: list[tuple[str, Any, list[int | str | None]]] = []
    for vi in proto.graph.input:
        if vi.name in weights or not vi.type.HasField("tensor_type"):
            continue
        tensor = vi.type.tensor_type
        kind = onnx.TensorProto.DataType.Name(tensor.elem_type).lower()
        dims: list[int | str | None] = [
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in tensor.shape.dim
        ]
        specs.append((vi.name, f"tensor({kind})", dims))
    return specs
