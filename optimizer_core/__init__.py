"""graphtrim's core library: ONNX graph optimization, verification and the stage functions.

This package never imports an orchestrator. The graph passes (``graphtrim.graph``) import
only ``onnx_ir``, ``onnx``, ``numpy`` and ``onnxruntime``.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
