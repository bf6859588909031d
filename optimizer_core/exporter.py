"""Turn a downloaded MLflow model into ONNX.

The ONNX flavor passes through. The PyTorch flavor (MLflow 3 saves ``pt2`` exported programs by
default; pickled modules too) goes through ``torch.onnx.export``: the dynamo exporter first, the
TorchScript exporter as a fallback, the one used recorded. Example inputs and dynamic dims come
from the model's signature (``-1`` dims become dynamic) or its input example.

The ``transformers`` flavor (a logged pipeline, or a model with its tokenizer) exports the
model itself with the dynamo exporter:

* a causal language model (task ``text-generation``, or a ``...ForCausalLM``) as one graph that
  serves prefill and decode, its KV cache explicit: inputs ``input_ids [batch, sequence]``,
  ``attention_mask [batch, total_sequence]`` and ``past_key_values.<layer>.key|value
  [batch, kv_heads, past_sequence, head_dim]``; outputs ``logits`` and
  ``present.<layer>.key|value [batch, kv_heads, past_sequence + sequence, head_dim]`` (the
  names transformers, Optimum and onnxruntime-genai use). ``past_sequence`` may be 0
  (prefill). Opset 22: at 23 torch's exporter writes ``RotaryEmbedding`` with cos/sin caches of
  batch 1, which the op does not broadcast (onnxruntime refuses a batch of 2); graphtrim's
  ``--opset 23`` fuses RMSNormalization, Attention and RotaryEmbedding afterwards where
  wanted (its rotary caches expanded to the batch);
* any other model (text encoders: feature extraction, classification, fill-mask) with
  ``input_ids`` and ``attention_mask`` (``[batch, sequence]``) and its first output
  (``last_hidden_state`` or ``logits``).

Weights over 1.5 GB go to external data (``model.onnx.data``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from graphtrim.errors import GraphtrimError

logger = logging.getLogger("graphtrim.stages")


class ExportError(GraphtrimError):
    """The registered model cannot be turned into ONNX."""


@dataclasses.dataclass
class ExportInfo:
    flavor: str
    exporter: str
    inputs: list[dict[str, Any]]
    notes: list[str]
    # a causal LM's KV cache as exported (layers, heads, head size, dims); None otherwise
    decoder: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_NP = {
    "float32": np.float32,
    "float64": np.float64,
    "float16": np.float16,
    "int64": np.int64,
    "int32": np.int32,
    "bool": np.bool_,
    "uint8": np.uint8,
    "int8": np.int8,
}


def read_mlmodel(folder: Path) -> dict[str, Any]:
    """The ``MLmodel`` document of the MLflow model folder ``folder`` (its flavors, signature)."""
    import yaml

    path = folder / "MLmodel"
    if not path.is_file():
        raise ExportError(f"{folder}: not an MLflow model (no MLmodel file)")
    doc = yaml.safe_load(path.read_text())
    if not isinstance(doc, dict) or "flavors" not in doc:
        raise ExportError(f"{path}: no flavors")
    return doc


def _signature_inputs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    sig = doc.get("signature") or {}
    raw = sig.get("inputs")
    if not raw:
        return []
    specs = json.loads(raw) if isinstance(raw, str) else raw
    out = []
    for i, s in enumerate(specs):
        if s.get("type") != "tensor":
            raise ExportError(
                f"signature input {s.get('name') or i} is a column ({s.get('type')}), not a tensor: "
                "only tensor signatures can be exported to ONNX"
            )
        ts = s["tensor-spec"]
        out.append(
            {"name": s.get("name") or f"input_{i}", "dtype": ts["dtype"], "shape": ts["shape"]}
        )
    return out


def _example(folder: Path, doc: dict[str, Any], specs: list[dict[str, Any]]) -> list[np.ndarray]:
    info = doc.get("saved_input_example_info") or {}
    path = folder / info.get("artifact_path", "input_example.json")
    if path.is_file() and info.get("type", "ndarray") == "ndarray":
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "inputs" in data:
            data = data["inputs"]
        if isinstance(data, dict):
            names = [s["name"] for s in specs] or list(data)
            arrays = [np.asarray(data[n]) for n in names]
        else:
            arrays = [np.asarray(data)]
        if specs:
            arrays = [
                a.astype(_NP.get(s["dtype"], a.dtype)) for a, s in zip(arrays, specs, strict=False)
            ]
        return arrays
    if not specs:
        raise ExportError(
            "the model has neither a tensor signature nor an input example: there is no way to "
            "know its input shapes; log it with `signature=` or `input_example=`"
        )
    arrays = []
    for s in specs:
        dtype = _NP.get(s["dtype"])
        if dtype is None:
            raise ExportError(f"signature input '{s['name']}' has unsupported dtype {s['dtype']}")
        shape = [2 if d == -1 else int(d) for d in s["shape"]]
        arrays.append(np.zeros(shape, dtype=dtype))
    return arrays


def _dynamic_dims(specs: list[dict[str, Any]], arrays: list[np.ndarray]) -> list[list[int]]:
    """Per input, the axes that are dynamic: ``-1`` in the signature; without one, axis 0."""
    if specs:
        return [[i for i, d in enumerate(s["shape"]) if d == -1] for s in specs]
    return [[0] if a.ndim else [] for a in arrays]


def _export_torch(
    module: Any, arrays: list[np.ndarray], dyn: list[list[int]], names: list[str], dst: Path
) -> tuple[str, list[str]]:
    import warnings

    import torch

    args = tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in arrays)
    notes: list[str] = []
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        try:
            shapes = tuple(
                {ax: torch.export.Dim(f"{n}_dim{ax}", min=1, max=1 << 16) for ax in axes} or None
                for n, axes in zip(names, dyn, strict=True)
            )
            torch.onnx.export(
                module,
                args,
                str(dst),
                dynamo=True,
                external_data=False,
                dynamic_shapes=shapes,
                input_names=names,
                verbose=False,  # its progress lines go to stdout, past the stage's own log
            )
            return "dynamo", notes
        except Exception as exc:
            first = (
                str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            )
            notes.append(f"dynamo exporter failed ({first}); fell back to the TorchScript exporter")
            logger.warning("%s", notes[-1])
            dst.unlink(missing_ok=True)
        try:
            axes = {
                n: {ax: f"{n}_dim{ax}" for ax in a} for n, a in zip(names, dyn, strict=True) if a
            }
            torch.onnx.export(
                module,
                args,
                str(dst),
                dynamo=False,
                input_names=names,
                dynamic_axes=axes or None,
                opset_version=17,
            )
            return "torchscript", notes
        except Exception as exc:
            raise ExportError(
                f"both exporters failed; TorchScript: {type(exc).__name__}: {str(exc)[:300]}"
            ) from exc


def to_onnx(
    folder: str | Path,
    dst: str | Path,
    *,
    registry: str = "the configured registry",
    fx_simplify: bool = False,
) -> ExportInfo:
    """Write the model in MLflow model folder ``folder`` as ONNX at ``dst``; with
    ``fx_simplify`` a PyTorch model goes through ``torch_simplify.fx_simplify`` first."""
    src = Path(folder)
    out = Path(dst)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = read_mlmodel(src)
    flavors = doc["flavors"]
    if "onnx" in flavors:
        conf = flavors["onnx"]
        model = src / conf.get("data", "model.onnx")
        if not model.is_file():
            raise ExportError(f"{src}: the onnx flavor's model file {model.name} is missing")
        import onnx

        proto = onnx.load(str(model))  # external data is resolved relative to the file
        big = proto.ByteSize() > 1_500_000_000
        onnx.save(proto, str(out), save_as_external_data=big, location=out.name + ".data")
        inputs = [{"name": i.name} for i in proto.graph.input]
        return ExportInfo("onnx", "none", inputs, [])
    if "transformers" in flavors:
        return _export_transformers(src, out, flavors["transformers"])
    if "pytorch" not in flavors:
        raise ExportError(
            f"flavors {', '.join(sorted(flavors))} are not supported: log the model with the "
            "pytorch, transformers or onnx flavor"
        )
    import mlflow.pytorch

    data = flavors["pytorch"].get("model_data", "data")
    pickled = not any((src / data).glob("*.pt2"))
    notes = []
    if pickled:
        notes.append(
            f"loading a pickled PyTorch model from {registry} (unpickling runs code: only models "
            "from the configured registry are loaded)"
        )
        logger.warning("%s", notes[-1])
    specs = _signature_inputs(doc)
    arrays = _example(src, doc, specs)
    try:
        module = mlflow.pytorch.load_model(str(src))
    except Exception as exc:
        raise ExportError(f"cannot load the PyTorch model: {type(exc).__name__}: {exc}") from exc
    if hasattr(module, "eval") and not type(module).__name__.endswith("GraphModule"):
        module.eval()
    if fx_simplify:
        from graphtrim.torch_simplify import fx_simplify as simplify

        module, fx_notes = simplify(module)
        notes += fx_notes
    names = [s["name"] for s in specs] if specs else [f"input_{i}" for i in range(len(arrays))]
    dyn = _dynamic_dims(specs, arrays)
    exporter, more = _export_torch(module, arrays, dyn, names, out)
    inputs = [
        {"name": n, "dtype": str(a.dtype), "dynamic_axes": d}
        for n, a, d in zip(names, arrays, dyn, strict=True)
    ]
    return ExportInfo(
        "pytorch-pickle" if pickled else "pytorch-pt2", exporter, inputs, notes + more
    )


# dynamo's exporter writes one protobuf up to this many bytes of weights, external data above
_EXTERNAL_BYTES = 1_500_000_000
DECODER_OPSET = 22


def _export_transformers(src: Path, out: Path, flavor: dict[str, Any]) -> ExportInfo:
    import mlflow.transformers

    try:
        parts = mlflow.transformers.load_model(str(src), return_type="components")
    except Exception as exc:
        raise ExportError(
            f"cannot load the transformers model: {type(exc).__name__}: {str(exc)[:300]} "
            "(a model logged with save_pretrained=False is a reference to the Hugging Face "
            "Hub, which must be reachable)"
        ) from exc
    model = parts["model"]
    task = parts.get("task") or flavor.get("task") or ""
    if not hasattr(model, "config") or not hasattr(model, "forward"):
        raise ExportError(f"the transformers flavor holds a {type(model).__name__}, not a model")
    if type(model).__module__.split(".")[0] != "transformers" or not hasattr(model, "eval"):
        raise ExportError(f"{type(model).__name__} is not a PyTorch transformers model")
    model.eval()
    if task == "text-generation" or type(model).__name__.endswith("ForCausalLM"):
        decoder = export_causal_lm(model, out)
        inputs = [{"name": n, "dims": d} for n, d in decoder.pop("inputs").items()]
        notes = [
            f"causal LM with its KV cache: {decoder['layers']} layers, {decoder['kv_heads']} "
            f"key/value heads of {decoder['head_dim']}; one graph for prefill and decode"
        ]
        return ExportInfo(
            f"transformers ({task or type(model).__name__})", "dynamo", inputs, notes, decoder
        )
    inputs, notes = export_encoder(model, out)
    return ExportInfo(f"transformers ({task or type(model).__name__})", "dynamo", inputs, notes)


def _weight_bytes(model: Any) -> int:
    return int(sum(p.numel() * p.element_size() for p in model.parameters()))


def _onnx_export(module: Any, args: tuple[Any, ...], dst: Path, **kwargs: Any) -> None:
    import warnings

    import torch

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(
                module,
                args,
                str(dst),
                dynamo=True,
                external_data=_weight_bytes(module) > _EXTERNAL_BYTES,
                opset_version=DECODER_OPSET,
                verbose=False,
                **kwargs,
            )
        except Exception as exc:
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
            raise ExportError(f"torch's exporter failed: {type(exc).__name__}: {first}") from exc


def export_causal_lm(model: Any, dst: Path) -> dict[str, Any]:
    """Export a transformers causal LM with its KV cache as explicit inputs and outputs (see
    the module's documentation); what was exported: layers, heads, head size and the dims of
    every input and output."""
    import torch
    from transformers import DynamicCache

    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    layers = int(text.num_hidden_layers)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    names = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]

    class WithCache(torch.nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: Any, attention_mask: Any, past: list[Any]) -> Any:
            cache = DynamicCache(config=cfg)
            for i in range(layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.inner(
                input_ids=input_ids,
                attention_mask=attention_mask,
                past_key_values=cache,
                use_cache=True,
            )
            kv: list[Any] = []
            for layer in out.past_key_values.layers:
                kv += [layer.keys, layer.values]
            return (out.logits, *kv)

    # distinct example sizes, none of them 1, so that no dim is taken for a constant
    batch, seq, past = 2, 3, 5
    dtype = next(model.parameters()).dtype
    vocab = int(getattr(text, "vocab_size", 2) or 2)
    ids = torch.randint(0, vocab, (batch, seq))
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    cache = [torch.zeros(batch, kv_heads, past, head_dim, dtype=dtype) for _ in names]
    b = torch.export.Dim("batch", min=1, max=1 << 12)
    s = torch.export.Dim("sequence", min=1, max=1 << 20)
    p = torch.export.Dim("past_sequence", min=0, max=1 << 20)
    t = torch.export.Dim("total_sequence", min=1, max=1 << 21)
    _onnx_export(
        WithCache(model),
        (ids, mask, cache),
        dst,
        input_names=["input_ids", "attention_mask", *names],
        output_names=["logits", *present],
        dynamic_shapes=({0: b, 1: s}, {0: b, 1: t}, [{0: b, 2: p} for _ in names]),
    )
    kv_dims: list[Any] = ["batch", kv_heads, "past_sequence", head_dim]
    return {
        "layers": layers,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "opset": DECODER_OPSET,
        "inputs": {
            "input_ids": ["batch", "sequence"],
            "attention_mask": ["batch", "total_sequence"],
            **{n: kv_dims for n in names},
        },
        "outputs": {
            "logits": ["batch", "sequence", vocab],
            **{n: ["batch", kv_heads, "past_sequence + sequence", head_dim] for n in present},
        },
    }


def export_encoder(model: Any, dst: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Export a transformers model taking ``input_ids`` and ``attention_mask`` (dynamic batch
    and sequence) with its first output; the inputs and a note."""
    import torch

    class FirstOutput(torch.nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            return self.inner(input_ids=input_ids, attention_mask=attention_mask)[0]

    cfg = model.config
    vocab = int(getattr(cfg, "vocab_size", 2) or 2)
    ids = torch.randint(0, vocab, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.int64)
    b = torch.export.Dim("batch", min=1, max=1 << 12)
    s = torch.export.Dim("sequence", min=2, max=1 << 20)
    _onnx_export(
        FirstOutput(model),
        (ids, mask),
        dst,
        input_names=["input_ids", "attention_mask"],
        output_names=["output"],
        dynamic_shapes=({0: b, 1: s}, {0: b, 1: s}),
    )
    inputs = [{"name": n, "dims": ["batch", "sequence"]} for n in ("input_ids", "attention_mask")]
    return inputs, [f"{type(model).__name__}: its first output exported as 'output'"]


def copy_model(src: Path, dst: Path) -> None:
    shutil.copyfile(src, dst)
    data = src.with_name(src.name + ".data")
    if data.exists():
        shutil.copyfile(data, dst.with_name(dst.name + ".data"))
