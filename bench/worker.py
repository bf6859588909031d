"""Runs one optimizer on one model in a fresh process: ``python -m bench.worker TOOL IN OUT``.

Prints one JSON line: seconds (the optimize call and the save, imports excluded) and peak RSS.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path


def _graphtrim(src: str, dst: str) -> None:
    from graphtrim.graph.optimizer import optimize_model
    from graphtrim.modelio import load_model, save_model

    save_model(optimize_model(load_model(src)).model, dst)


def _graphtrim_grow(src: str, dst: str) -> None:
    """graphtrim set for the fewest nodes: the ``compact`` preset (sibling MatMuls merged) and a
    folding budget as loose as the anchors' (constants are materialized even when the model
    grows: placeholder weights made by ConstantOfShape become tensors)."""
    from graphtrim.graph.framework import OptimizeOptions
    from graphtrim.graph.optimizer import optimize_model
    from graphtrim.modelio import load_model, save_model

    gib = 1024**3
    options = OptimizeOptions(fold_max_growth_bytes=gib, fold_max_tensor_bytes=gib)
    save_model(optimize_model(load_model(src), preset="compact", options=options).model, dst)


def _onnxsim(src: str, dst: str) -> None:
    import onnx
    import onnxsim

    model, _ = onnxsim.simplify(onnx.load(src))
    onnx.save(model, dst)


def _onnxslim(src: str, dst: str) -> None:
    import onnx
    import onnxslim

    onnx.save(onnxslim.slim(onnx.load(src)), dst)


def _onnxoptimizer(src: str, dst: str) -> None:
    import onnx
    import onnxoptimizer

    onnx.save(onnxoptimizer.optimize(onnx.load(src)), dst)


def _ort_basic(src: str, dst: str) -> None:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.optimized_model_filepath = dst
    ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


def _onnxscript(src: str, dst: str) -> None:
    import onnx
    import onnxscript.optimizer

    onnx.save(onnxscript.optimizer.optimize(onnx.load(src)), dst)


TOOLS = {
    "graphtrim": _graphtrim,
    "graphtrim-grow": _graphtrim_grow,
    "onnxsim": _onnxsim,
    "onnxslim": _onnxslim,
    "onnxoptimizer": _onnxoptimizer,
    "ort-basic": _ort_basic,
    "onnxscript": _onnxscript,
}

# import each tool's modules before timing so the time is the optimization alone
_IMPORTS = {
    "graphtrim": ["graphtrim.graph.optimizer", "graphtrim.modelio", "onnxruntime"],
    "graphtrim-grow": ["graphtrim.graph.optimizer", "graphtrim.modelio", "onnxruntime"],
    "onnxsim": ["onnxsim"],
    "onnxslim": ["onnxslim"],
    "onnxoptimizer": ["onnxoptimizer"],
    "ort-basic": ["onnxruntime"],
    "onnxscript": ["onnxscript.optimizer"],
}


def _warm_onnx() -> None:
    """Every tool uses onnx's checker and shape inference, whose first call initializes the
    operator schema registry (tens of ms): pay that before the clock starts, for all alike."""
    import onnx
    from onnx import helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "warm",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph)
    onnx.checker.check_model(model)
    onnx.shape_inference.infer_shapes(model)


def _peak_rss_kb() -> int:
    """This process's peak RSS. VmHWM starts afresh at exec; ru_maxrss would carry the
    parent's peak over a fork, which made every row show the bench runner's memory."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def serve() -> int:
    """``python -m bench.worker --serve``: one JSON request per line on stdin
    (``{"tool", "src", "dst"}``), one JSON answer per line on stdout. Tools are imported on first
    use and stay imported, so a sweep over many models pays each import once; a tool that crashes
    the process is answered by the caller, who starts a new worker."""
    import contextlib
    import io
    import os
    import traceback

    _warm_onnx()
    # answers go to the original stdout; whatever a tool prints from C++ (to file descriptor 1)
    # goes to stderr instead of into the answers
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for line in sys.stdin:
        req = json.loads(line)
        t0 = time.perf_counter()
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                TOOLS[req["tool"]](req["src"], req["dst"])
            answer = {"ok": Path(req["dst"]).exists(), "seconds": time.perf_counter() - t0}
        except Exception as exc:
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            answer = {"ok": False, "error": last[:300]}
        out.write(json.dumps(answer) + "\n")
        out.flush()
    return 0


def main() -> int:
    if sys.argv[1:2] == ["--serve"]:
        return serve()
    tool, src, dst = sys.argv[1:4]
    import contextlib
    import importlib
    import io

    for mod in _IMPORTS[tool]:
        importlib.import_module(mod)
    _warm_onnx()
    base_rss = _peak_rss_kb()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        TOOLS[tool](src, dst)
    seconds = time.perf_counter() - t0
    peak = _peak_rss_kb()
    print(
        json.dumps(
            {
                "seconds": seconds,
                "peak_rss_mb": peak / 1024,
                "base_rss_mb": base_rss / 1024,
                "ok": Path(dst).exists(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
