"""Shape inference for onnxruntime's dynamic quantizer that holds no second copy of the weights.

``quantize_dynamic`` loads the model (its weights in the message) and, to refresh the value
types after turning ``Gemm`` into ``MatMul``, deep-copies it, saves the copy, infers shapes on
the file and loads that back. Until the copy is loaded the original is still held, and a
protobuf message's memory goes only when the message goes: three times the weights at the peak
(a 1 GiB model of MatMuls measured 3.13 GiB). Shape inference needs the weights' types and
dims, not their values: :func:`infer_in_place` infers on a copy of the graph whose float tensors
carry their header alone and writes the inferred types back into the model itself (1.59 GiB on
that model, the same output).

:func:`weightless_shape_inference` lends it to the quantizer for the length of a ``with``
block. The quantizer's output with it is the one without it, tensor for tensor: a test holds
the two side by side, so an onnxruntime whose quantizer changes its use of the helper fails
there rather than in a user's run.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator
from typing import Any

import onnx

logger = logging.getLogger("graphtrim.quantize")

# float tensors above this many bytes go to the inference copy as a header alone; shape
# inference reads values only of small integer tensors (shapes, axes, indices)
HEADER_ONLY_BYTES = 1024
_FLOATS = frozenset(
    {
        onnx.TensorProto.FLOAT,
        onnx.TensorProto.FLOAT16,
        onnx.TensorProto.BFLOAT16,
        onnx.TensorProto.DOUBLE,
    }
)
# where onnxruntime's ONNXQuantizer looks the helper up
_QUANTIZER_MODULE = "onnxruntime.quantization.onnx_quantizer"
_HELPER = "save_and_reload_model_with_shape_infer"


def _copy_fields(src: Any, dst: Any, skip: frozenset[str] = frozenset()) -> None:
    for field, value in src.ListFields():
        if field.name in skip:
            continue
        target = getattr(dst, field.name)
        if hasattr(value, "extend"):  # a repeated field
            target.extend(value)
        elif hasattr(value, "ListFields"):  # a message
            target.CopyFrom(value)
        else:
            setattr(dst, field.name, value)


def _nbytes(tensor: onnx.TensorProto) -> int:
    if tensor.HasField("raw_data"):
        return len(tensor.raw_data)
    count = 1
    for d in tensor.dims:
        count *= d
    return count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def _header(tensor: onnx.TensorProto, out: onnx.TensorProto) -> None:
    """``tensor``'s name, type and dims in ``out``, its values left outside."""
    out.name = tensor.name
    out.data_type = tensor.data_type
    out.dims.extend(tensor.dims)
    out.data_location = onnx.TensorProto.EXTERNAL
    entry = out.external_data.add()
    entry.key, entry.value = "location", "graphtrim-shape-inference-header"


def infer_in_place(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model's value types inferred as onnxruntime's ``save_and_reload_model_with_shape_infer``
    infers them, written into ``model`` itself (returned), with onnxruntime's marker that shapes
    were inferred. The weights are never copied."""
    from onnxruntime.quantization.quant_utils import add_infer_metadata

    skeleton = onnx.ModelProto()
    _copy_fields(model, skeleton, frozenset({"graph"}))
    _copy_fields(model.graph, skeleton.graph, frozenset({"initializer"}))
    for tensor in model.graph.initializer:
        out = skeleton.graph.initializer.add()
        if tensor.data_type in _FLOATS and _nbytes(tensor) > HEADER_ONLY_BYTES:
            _header(tensor, out)
        else:
            out.CopyFrom(tensor)
    inferred = onnx.shape_inference.infer_shapes(skeleton)
    graph = model.graph
    # nodes too: the value types of subgraphs live in their bodies
    for name in ("node", "input", "output", "value_info"):
        field = getattr(graph, name)
        del field[:]
        field.extend(getattr(inferred.graph, name))
    add_infer_metadata(model)
    return model


@contextlib.contextmanager
def weightless_shape_inference() -> Iterator[bool]:
    """While open, onnxruntime's dynamic quantizer infers shapes with :func:`infer_in_place`.
    Yields whether it could: an onnxruntime without the helper runs as it is (and its memory
    with it)."""
    module = importlib.import_module(_QUANTIZER_MODULE)
    original = getattr(module, _HELPER, None)
    if original is None:
        logger.warning(
            "%s has no %s: the dynamic quantizer copies the model to infer shapes",
            _QUANTIZER_MODULE,
            _HELPER,
        )
        yield False
        return
    setattr(module, _HELPER, infer_in_place)
    try:
        yield True
    finally:
        setattr(module, _HELPER, original)
