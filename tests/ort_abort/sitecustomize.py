"""A runtime crash on demand, for tests of process isolation.

Put this folder on ``PYTHONPATH`` with ``GRAPHTRIM_TEST_ABORT_FP16=1`` and every Python process
started with that environment aborts (SIGABRT) when onnxruntime opens a model holding float16
initializers at its default optimization level (ORT_ENABLE_ALL), the way onnxruntime 1.32's CPU
provider segfaulted on a user's fp16 model. Sessions at other levels work as usual.
"""

from __future__ import annotations

import os

if os.environ.get("GRAPHTRIM_TEST_ABORT_FP16") == "1":
    import onnx
    import onnxruntime

    _real_init = onnxruntime.InferenceSession.__init__

    def _has_fp16(model: object) -> bool:
        if not isinstance(model, (str, os.PathLike)):
            return False
        proto = onnx.load(str(model), load_external_data=False)
        return any(t.data_type == onnx.TensorProto.FLOAT16 for t in proto.graph.initializer)

    def _init(self, path_or_bytes, sess_options=None, *args, **kwargs):  # type: ignore[no-untyped-def]
        level = getattr(sess_options, "graph_optimization_level", None)
        default = level is None or level == onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        if default and _has_fp16(path_or_bytes):
            os.abort()
        _real_init(self, path_or_bytes, sess_options, *args, **kwargs)

    onnxruntime.InferenceSession.__init__ = _init  # type: ignore[method-assign]
