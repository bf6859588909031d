"""Models that crash onnxruntime, for tests of the code that must survive them.

``crashing_model(path)`` writes a three-node model that kills the process (SIGSEGV) when
onnxruntime 1.32's CPU provider creates a session for it at ``ORT_ENABLE_ALL`` (the default
level), before any run::

    x: float16 [2, 8, 8] -> Transpose(perm=[1, 0, 2]) -> Cast(to=float) -> MatMul(w: float [8, 8]) -> y

Measured on x86-64 with onnxruntime 1.32.0 (``CPUExecutionProvider``, default
``SessionOptions`` otherwise), the exit status of a child process that opens the session and
runs it once:

- ``ORT_ENABLE_ALL``: -11 (SIGSEGV during ``InferenceSession(...)``). Also ``ORT_ENABLE_LAYOUT``.
- ``ORT_ENABLE_EXTENDED``, ``ORT_ENABLE_BASIC``, ``ORT_DISABLE_ALL``: 0, correct results.
- ``ORT_ENABLE_ALL`` with ``disabled_optimizers=["MatmulTransposeFusion"]`` or
  ``disabled_optimizers=["NchwcTransformer"]``: 0. Disabling ``TransposeOptimizer``: still -11.

What happens (onnxruntime's verbose log and ``optimized_model_filepath``): the level-2
``MatmulTransposeFusion`` moves the ``Cast`` above the ``Transpose`` (a new value named
``<cast output>/MatmulTransposeFusion/``) without fusing the transpose into the ``MatMul``;
the level-3 ``NchwcTransformer`` that runs next then crashes. Needed: a float16
``Transpose`` with ``perm=[1, 0, 2]`` (``[0, 2, 1]``, ``[2, 0, 1]``, and the rank-4
``[1, 0, 2, 3]`` and ``[0, 2, 1, 3]`` load fine) whose only consumer reaches a ``MatMul``
through a cast to float. The cast may also be implicit: a float16 ``MatMul`` has no CPU
kernel, so onnxruntime's own ``InsertCastTransformer`` puts the same ``Cast`` there.
Dims and a symbolic batch do not matter; the same graph in float32 loads fine.

This is the pattern ``onnxruntime.transformers.float16.convert_float_to_float16`` leaves in
a dynamo-exported ``torch.nn.MultiheadAttention(batch_first=True)``: the input's
``transpose(1, 0)`` feeds the packed in-projection ``MatMul`` (the TorchScript exporter adds a
``Shape`` consumer to that transpose, and the fusion does not fire). Keeping ``Transpose`` in
float32 during the conversion (``op_block_list``) avoids it: that is ``safe_model``, the same
computation with the cast before the transpose, which loads at every level. Keeping
``MatMul``, ``LayerNormalization``, ``Conv`` or ``Gemm`` in float32 does not.

Open these models only in a child process.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SHAPE = (2, 8, 8)


def _weight() -> np.ndarray:
    c = SHAPE[-1]
    return np.asarray((np.arange(c * c).reshape(c, c) % 7 - 3) / 8, dtype=np.float32)


def _write(path: str | os.PathLike[str], *, cast_first: bool) -> Path:
    b, t, c = SHAPE
    weight = numpy_helper.from_array(_weight(), "w")
    if cast_first:
        nodes = [
            helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
            helper.make_node("Transpose", ["xf"], ["t"], perm=[1, 0, 2]),
            helper.make_node("MatMul", ["t", "w"], ["y"]),
        ]
    else:
        nodes = [
            helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2]),
            helper.make_node("Cast", ["t"], ["tf"], to=TensorProto.FLOAT),
            helper.make_node("MatMul", ["tf", "w"], ["y"]),
        ]
    graph = helper.make_graph(
        nodes,
        "transpose_cast_matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [b, t, c])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [t, b, c])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out))
    return out


def crashing_model(path: str | os.PathLike[str]) -> Path:
    """Write the model that segfaults onnxruntime 1.32's CPU session creation at
    ``ORT_ENABLE_ALL`` (see the module docstring) to ``path``; returns the path. Input ``x``:
    float16 ``[2, 8, 8]``; output ``y``: float32 ``[8, 2, 8]``."""
    return _write(path, cast_first=False)


def safe_model(path: str | os.PathLike[str]) -> Path:
    """Write the same computation with the ``Transpose`` in float32 (the cast first), which
    loads and runs at every optimization level, to ``path``; returns the path."""
    return _write(path, cast_first=True)


def reference_output(x: np.ndarray) -> np.ndarray:
    """What both models compute for ``x`` (float16 ``[2, 8, 8]``), in float32."""
    return np.asarray(np.transpose(x.astype(np.float32), (1, 0, 2)) @ _weight(), dtype=np.float32)
