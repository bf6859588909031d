"""An onnxruntime session over a model file, a ModelProto or an onnx_ir model, with
onnxruntime's own graph optimizations off unless asked for."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from graphtrim.verify.inputs import (
    _unique_node_names,
)

ModelLike = str | os.PathLike[str] | onnx.ModelProto | ir.Model


class Session:
    """An onnxruntime session over a path, a ModelProto or an ``onnx_ir`` model.

    Large in-memory models are written to a temporary folder first (protobuf's 2 GB limit; the
    external data of a loaded model is relative to its own folder).
    """

    def __init__(
        self,
        model: ModelLike,
        *,
        threads: int = 1,
        providers: Sequence[str] = ("CPUExecutionProvider",),
        graph_optimizations: bool = False,
    ):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.graph_optimization_level = (
            ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            if graph_optimizations
            else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        )
        # without the arena, what a run allocates goes back when the run ends: a model whose
        # weights are dequantized in the graph (weight-only int4) would otherwise hold a float
        # copy of them per run in the arena, growing run by run
        so.enable_cpu_mem_arena = False
        so.add_session_config_entry("session.disable_prepacking", "1")  # weights read in place
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        source: str | bytes
        if isinstance(model, str | os.PathLike):
            source = str(model)
        elif isinstance(model, onnx.ModelProto):
            source = model.SerializeToString()
        else:
            source = self._from_ir(model)
        try:
            try:
                self.session = ort.InferenceSession(source, so, providers=list(providers))
            except Exception as exc:
                # node names mean nothing to the computation, but onnxruntime refuses repeats
                renamed = _unique_node_names(source) if "same node name" in str(exc) else None
                if renamed is None:
                    raise
                self.session = ort.InferenceSession(renamed, so, providers=list(providers))
        except BaseException:
            self.close()
            raise
        # kept past close(): a closed session still says what it took and gave
        self._specs = [(i.name, i.type, list(i.shape)) for i in self.session.get_inputs()]
        self._outputs = [o.name for o in self.session.get_outputs()]

    def _from_ir(self, model: ir.Model) -> str | bytes:
        from graphtrim.modelio import (
            PROTO_LIMIT_BYTES,
            has_external_data,
            initializer_bytes,
            save_model,
        )

        if not has_external_data(model) and initializer_bytes(model) < PROTO_LIMIT_BYTES:
            return ir.serde.serialize_model(model).SerializeToString()
        self._tmp = tempfile.TemporaryDirectory(prefix="graphtrim-verify-")
        path = Path(self._tmp.name) / "model.onnx"
        save_model(model, path, external_data=True)
        return str(path)

    def input_specs(self) -> list[tuple[str, Any, list[int | str | None]]]:
        return [(n, t, list(s)) for n, t, s in self._specs]

    def output_names(self) -> list[str]:
        return list(self._outputs)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.session is None:
            raise RuntimeError("the session is closed")
        names = self.output_names()
        return dict(zip(names, self.session.run(names, dict(feeds)), strict=True))

    def close(self) -> None:
        """Let the session and its weights go (idempotent)."""
        self.session = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
