"""Execution devices and onnxruntime sessions for measuring deployed behaviour.

The device a user asks for decides the execution provider: ``cpu`` is onnxruntime's CPU provider,
``gpu`` its CUDA provider (``tensorrt=True`` puts TensorRT first). A GPU that is not there is an
error, never a silent measurement on the CPU (a test deployment without GPUs that proves the
routing of GPU stages sets ``GRAPHTRIM_TEST_GPU_ON_CPU=1`` explicitly, and every such session says
so in the log).

Unlike verification sessions (``graphtrim.verify``), which disable onnxruntime's graph
optimizations to see the model as written, these sessions run as deployed: optimizations on,
a fixed thread count, sequential execution.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from graphtrim.errors import GraphtrimError, InvalidModelError

Device = Literal["cpu", "gpu"]
DEVICES: tuple[str, ...] = ("cpu", "gpu")


class DeviceUnavailableError(GraphtrimError):
    """The requested device has no execution provider in this onnxruntime build or machine."""


class ModelLoadError(InvalidModelError):
    """onnxruntime cannot load the model: an operator it does not implement, a custom domain
    without its operator library, a type it has no kernel for. Nothing can be run, measured or
    built from such a model."""


GPU_ON_CPU_ENV = "GRAPHTRIM_TEST_GPU_ON_CPU"


def _load_reason(exc: BaseException) -> str:
    """onnxruntime's reason, without its error-code prefix and the path it repeats."""
    text = str(exc).strip()
    text = re.sub(r"^\[ONNXRuntimeError\]\s*:\s*\d+\s*:\s*\w+\s*:\s*", "", text)
    text = re.sub(r"^Load model from .*? failed:\s*", "", text, flags=re.DOTALL)
    first = text.splitlines()[0].strip() if text else ""
    return (first or type(exc).__name__)[:400]


def create_session(path: str | os.PathLike[str], options: Any, providers: Sequence[str]) -> Any:
    """``onnxruntime.InferenceSession(path, options, providers)``; a model onnxruntime cannot
    load is a :class:`ModelLoadError` naming the model and onnxruntime's reason in one line."""
    import onnxruntime as ort

    try:
        return ort.InferenceSession(str(path), options, providers=list(providers))
    except Exception as exc:
        raise ModelLoadError.at(
            path, f"onnxruntime {ort.__version__} cannot load the model: {_load_reason(exc)}"
        ) from exc


def providers_for(device: str, *, tensorrt: bool = False) -> list[str]:
    """The execution providers for ``device``, checked against what onnxruntime offers."""
    import onnxruntime as ort

    if device not in DEVICES:
        raise GraphtrimError(f"unknown device '{device}': expected one of {', '.join(DEVICES)}")
    available = ort.get_available_providers()
    if device == "cpu":
        return ["CPUExecutionProvider"]
    wanted = ["CUDAExecutionProvider"]
    if tensorrt:
        wanted.insert(0, "TensorrtExecutionProvider")
    missing = [p for p in wanted if p not in available]
    if missing and os.environ.get(GPU_ON_CPU_ENV) == "1":
        # a test deployment without GPUs proving the routing of GPU stages; never silent
        logging.getLogger("graphtrim").warning(
            "device 'gpu' requested but %s is missing: running on the CPU provider because %s=1",
            ", ".join(missing),
            GPU_ON_CPU_ENV,
        )
        return ["CPUExecutionProvider"]
    if missing:
        raise DeviceUnavailableError(
            f"device 'gpu' needs {', '.join(missing)}, which this onnxruntime "
            f"{ort.__version__} does not offer (available: {', '.join(available)}); install "
            "onnxruntime-gpu on a machine with a CUDA GPU, or measure with device 'cpu'"
        )
    return [*wanted, "CPUExecutionProvider"]


def session_options(threads: int, *, optimize: bool = True) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if optimize
        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    if not optimize:
        # a run for its results, not its speed: without the arena what a run allocates goes
        # back when it ends (weights dequantized in the graph would otherwise stay as a float
        # copy in the arena, growing run by run), and without prepacking the weights are read
        # from the file's mapping as they are instead of copied into packed buffers (a float
        # decoder's session held its whole weights again before its first run)
        so.enable_cpu_mem_arena = False
        so.add_session_config_entry("session.disable_prepacking", "1")
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    return so


def open_session(
    path: str | os.PathLike[str],
    *,
    device: str = "cpu",
    threads: int = 1,
    optimize: bool = True,
    providers: Sequence[str] | None = None,
) -> Any:
    """An ``InferenceSession`` on ``device``; the providers it really got must include the
    requested one (onnxruntime silently drops providers it cannot create). A model onnxruntime
    cannot load is a :class:`ModelLoadError`."""
    wanted = list(providers) if providers is not None else providers_for(device)
    sess = create_session(path, session_options(threads, optimize=optimize), wanted)
    if wanted[0] not in sess.get_providers():
        raise DeviceUnavailableError(
            f"onnxruntime could not create {wanted[0]} for {path} "
            f"(got {', '.join(sess.get_providers())})"
        )
    return sess


def load_probe(
    path: str | os.PathLike[str],
    *,
    device: str = "cpu",
    tensorrt: bool = False,
    feeds: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Open ``path`` as a serving process would (onnxruntime's default session options:
    ``ORT_ENABLE_ALL``, its own thread settings) on ``device`` and run ``feeds`` once (seeded
    random inputs without them). Meant for a child process (:mod:`graphtrim.isolation`):
    a model that crashes the runtime takes only the child down."""
    import onnxruntime as ort

    from graphtrim.isolation import step

    providers = providers_for(device, tensorrt=tensorrt)
    step(f"opening an onnxruntime session (ORT_ENABLE_ALL, {providers[0]})")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = create_session(path, so, providers)
    if feeds is None:
        feeds = probe_feeds(sess)
    step(f"running the model once (ORT_ENABLE_ALL, {providers[0]})")
    outs = sess.run(None, dict(feeds))
    return {
        "level": "ORT_ENABLE_ALL",
        "providers": sess.get_providers(),
        "outputs": [list(getattr(o, "shape", ())) for o in outs],
    }


# past_key_values.0.key (transformers, onnxruntime-genai), past.0.value, past_key.3, past_value_3
_KV_CACHE_NAME = re.compile(r"^past(_key_values)?[._]\d+[._](key|value)$|^past_(key|value)[._]\d+$")


def kv_cache_inputs(specs: Sequence[tuple[str, Any, Sequence[Any]]]) -> list[str]:
    """The names of the KV-cache inputs (``past...`` of rank 3 or more) among ``specs``; empty
    for a model that is no decoder with a cache."""
    return [n for n, _, shape in specs if _KV_CACHE_NAME.match(n) and len(shape) >= 3]


def decoder_feeds(
    specs: Sequence[tuple[str, Any, Sequence[Any]]],
    input_ids: Any,
    *,
    cache: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Feeds of a KV-cache decoder for the tokens ``input_ids`` ``[batch, sequence]``: the
    attention mask (ones over the cache and the tokens), position ids where the model takes
    them, and ``cache`` (name -> ``[batch, heads, past, head]``) or an empty cache (a
    prefill).

    Raises:
        GraphtrimError: the cache's head count or head size is a named dim, so an empty cache
            cannot be shaped (pass ``cache``).
    """
    import numpy as np

    ids = np.asarray(input_ids, dtype=np.int64)
    batch, seq = ids.shape
    feeds: dict[str, Any] = {"input_ids": ids}
    past = 0
    types = {n: t for n, t, _ in specs}
    cached = set(kv_cache_inputs(specs))
    for name, _, shape in specs:
        if name not in cached:
            continue
        if cache is not None:
            feeds[name] = cache[name]
            past = int(np.shape(cache[name])[-2])
            continue
        inner = [d for i, d in enumerate(shape) if i not in (0, len(shape) - 2)]
        if not all(isinstance(d, int) and d > 0 for d in inner):
            raise GraphtrimError(
                f"input {name} {list(shape)}: its heads and head size are named dims, so an "
                "empty KV cache cannot be shaped"
            )
        dims = list(shape)
        dims[0], dims[-2] = batch, 0
        dtype = {"tensor(float16)": np.float16, "tensor(double)": np.float64}.get(
            str(types[name]), np.float32
        )
        feeds[name] = np.zeros(dims, dtype=dtype)
    if "attention_mask" in types:
        feeds["attention_mask"] = np.ones((batch, past + seq), dtype=np.int64)
    if "position_ids" in types:
        feeds["position_ids"] = np.broadcast_to(
            np.arange(past, past + seq, dtype=np.int64), (batch, seq)
        ).copy()
    return feeds


def decoder_dims(
    specs: Sequence[tuple[str, Any, Sequence[int | str | None]]],
    bound: dict[str, int],
    default_dim: int,
) -> int | None:
    """For a decoder with a KV cache, bind the attention mask's own length dim to the cache's
    length plus the new tokens' (in ``bound``); the cache's length, or None for other models.

    The cache length is axis -2 of the ``past...`` inputs (``[batch, heads, length, head]``),
    the new tokens axis 1 of ``input_ids`` (or of ``inputs_embeds``)."""
    shapes = {name: list(shape) for name, _, shape in specs}
    past = [shapes[n] for n in kv_cache_inputs(specs)]
    if not past:
        return None

    def size(d: int | str | None) -> int:
        if isinstance(d, int) and d >= 0:
            return d
        if isinstance(d, str) and d:
            return bound.setdefault(d, default_dim)
        return default_dim

    tokens = shapes.get("input_ids") or shapes.get("inputs_embeds")
    if tokens and isinstance(tokens[0], str) and tokens[0]:
        # one sequence: onnxruntime's GroupQueryAttention takes no batch of prompts with a cache
        bound.setdefault(tokens[0], 1)
    cache = size(past[0][-2])
    mask = shapes.get("attention_mask")
    if tokens is not None and len(tokens) >= 2 and mask is not None and len(mask) == 2:
        new = size(tokens[1])
        total = mask[1]
        if isinstance(total, str) and total and total != tokens[1] and total not in bound:
            bound[total] = cache + new
    return cache


def probe_feeds(sess: Any) -> dict[str, Any]:
    """Seeded inputs of an onnxruntime session's input types (symbolic dims of size 2), for
    probes that only need the model to run once; a decoder's cache dims as
    :func:`decoder_dims` binds them, with its attention mask all ones."""
    import numpy as np

    rng = np.random.default_rng(0)
    inputs = sess.get_inputs()
    bound: dict[str, int] = {}
    decoder = decoder_dims([(i.name, i.type, list(i.shape)) for i in inputs], bound, 2)
    feeds: dict[str, Any] = {}
    for i in inputs:
        shape = [
            d if isinstance(d, int) and d > 0 else bound.get(d, 2) if isinstance(d, str) else 2
            for d in i.shape
        ]
        kind = str(i.type).removeprefix("tensor(").removesuffix(")")
        dtype = {"float": np.float32, "double": np.float64, "float16": np.float16}.get(kind)
        if dtype is not None:
            feeds[i.name] = rng.standard_normal(shape).astype(dtype)
        elif kind == "bool":
            feeds[i.name] = np.zeros(shape, dtype=np.bool_)
        elif decoder is not None and i.name == "attention_mask":
            feeds[i.name] = np.ones(shape, dtype=np.dtype(kind))
        else:
            feeds[i.name] = np.zeros(shape, dtype=np.dtype(kind) if kind != "string" else object)
    return feeds
