"""Models derived from other corpus models in the project's environment: quantized (QDQ from
onnxruntime's static quantizer, QOperator from its static and dynamic quantizers), fp16 (inputs
and outputs kept fp32), converted to newer opsets (onnx's version converter, opsets 21 and 23),
saved with external data, and with weights as training leaves them.

Why the last: a randomly initialized model has exactly 1 and 0 where training moves the values
(normalization scales and shifts, the zero biases of ``transformers``' initialization), and
the exporter shares one such tensor among all its uses. An optimizer drops ``x * 1`` and
``x + 0`` there, so the random-weight corpus never shows what a runtime does with a trained
model's normalizations (onnxruntime fuses a written-out LayerNormalization only with its scale
and shift). ``trained`` gives every use of a constant-valued float weight its own copy with
seeded noise around the value: ``v * (1 + 0.1 n)``, or ``0.02 n`` for 0."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.corpus import Manifest, Spec, spec

DERIVED = [
    # (name, kind, source key)
    ("resnet18-qdq", "qdq", "timm-resnet18-dynamo"),
    ("mobilenetv3-qdq", "qdq", "timm-mobilenetv3_large_100-torchscript"),
    ("efficientnet-qdq", "qdq", "tv-efficientnet_b0-dynamo"),
    ("vit-qdq", "qdq", "timm-vit_tiny_patch16_224-dynamo"),
    ("bert-qdq", "qdq", "hf-bert-torchscript"),
    ("resnet18-qoperator", "qoperator", "timm-resnet18-torchscript"),
    ("bert-dynamic-int8", "dynamic", "hf-bert-dynamo"),
    ("gpt2-dynamic-int8", "dynamic", "hf-gpt2-torchscript"),
    ("resnet18-fp16", "fp16", "timm-resnet18-dynamo"),
    ("convnext-fp16", "fp16", "timm-convnext_atto-torchscript"),
    ("bert-fp16", "fp16", "hf-bert-dynamo"),
    ("yolov8n-fp16", "fp16", "yolo-yolov8n-ultralytics"),
    ("mobilenetv2-opset21", "opset21", "tv-mobilenet_v2-torchscript"),
    ("gpt2-opset23", "opset23", "hf-gpt2-dynamo"),
    ("llama-external-data", "external", "hf-llama-kv-dynamo"),
    ("convnext-external-data", "external", "timm-convnext_atto-dynamo"),
    # written-out normalizations (TorchScript below opset 17) and, for contrast, the op
    ("bert-legacy-mask-trained", "trained", "legacy-bert-legacy-mask-torchscript"),
    ("bert-trained", "trained", "hf-bert-torchscript"),
    ("gpt2-trained", "trained", "hf-gpt2-torchscript"),
    ("bart-trained", "trained", "hf-bart-torchscript"),
    ("vit-trained", "trained", "hf-vit-torchscript"),
    ("wav2vec2-trained", "trained", "hf-wav2vec2-torchscript"),
    ("convnext-trained", "trained", "timm-convnext_atto-torchscript"),
    ("llama-trained", "trained", "hf-llama-torchscript"),
    ("bert-dynamo-trained", "trained", "hf-bert-dynamo"),
]

_FAMILY = {
    "qdq": "quantized",
    "qoperator": "quantized",
    "dynamic": "quantized",
    "fp16": "fp16",
    "external": "external-data",
    "trained": "trained-weights",
}

SPECS: list[Spec] = [
    spec(
        f"derived-{name}",
        _FAMILY.get(kind, "opset-converted"),
        key,
        "bench.corpus.derived:derive",
        exporters=(kind,),
        derive=True,
        source_key=key,
    )
    for name, kind, key in DERIVED
]


class _Reader:
    """Calibration data: seeded random feeds shaped like the model's inputs."""

    def __init__(self, path: Path, count: int = 8) -> None:
        import onnxruntime as ort

        from graphtrim.verify import make_inputs

        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        specs = [(i.name, i.type, list(i.shape)) for i in sess.get_inputs()]
        self.feeds = [make_inputs(specs, seed=s) for s in range(count)]

    def get_next(self) -> dict[str, Any] | None:
        return self.feeds.pop() if self.feeds else None

    def rewind(self) -> None:  # pragma: no cover - the quantizer may call it
        pass


def derive(sp: Spec, kind: str, manifest: Manifest, out: Path) -> dict[str, Any]:
    import onnx

    key = sp.kwargs()["source_key"]
    src_entry = manifest.entries.get(key)
    if not src_entry or src_entry.get("status") != "ok":
        raise RuntimeError(f"its source {key} was not built")
    src = manifest.model_path(src_entry)
    out.unlink(missing_ok=True)
    if kind in ("qdq", "qoperator"):
        from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

        quantize_static(
            str(src),
            str(out),
            _Reader(src),
            quant_format=QuantFormat.QDQ if kind == "qdq" else QuantFormat.QOperator,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
        )
    elif kind == "dynamic":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(str(src), str(out), weight_type=QuantType.QInt8)
    elif kind == "fp16":
        from onnxruntime.transformers.float16 import convert_float_to_float16

        model = convert_float_to_float16(onnx.load(str(src)), keep_io_types=True)
        onnx.save(model, str(out))
    elif kind.startswith("opset"):
        from onnx import version_converter

        model = version_converter.convert_version(onnx.load(str(src)), int(kind[5:]))
        onnx.checker.check_model(model)
        onnx.save(model, str(out))
    elif kind == "external":
        model = onnx.load(str(src))
        onnx.save(
            model,
            str(out),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=out.name + ".data",
            size_threshold=1024,
        )
    elif kind == "trained":
        model = onnx.load(str(src))
        trained_weights(model)
        onnx.checker.check_model(model)
        onnx.save(model, str(out))
    else:
        raise ValueError(kind)
    # the source's inputs: the sweep sizes the symbolic dims from its example
    return {"dynamic": True, "shapes": src_entry.get("shapes")}


def trained_weights(model: Any, seed: int = 0) -> int:
    """Give every use of a constant-valued float initializer (more than one element, every
    element equal) in the main graph its own copy with seeded noise around the value; returns
    the number of uses rewritten. Initializers a subgraph reads are left as they are."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    graph = model.graph
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)

    def subgraph_reads(g: Any) -> set[str]:
        """Names the subgraphs of ``g``'s nodes read, at any depth."""
        found: set[str] = set()
        for node in g.node:
            for attr in node.attribute:
                for sub in [attr.g, *attr.graphs]:
                    found.update(name for n in sub.node for name in n.input)
                    found |= subgraph_reads(sub)
        return found

    in_subgraphs = subgraph_reads(graph)
    constant: dict[str, Any] = {}
    for t in graph.initializer:
        if t.data_type not in floats or t.name in in_subgraphs or t.data_location:
            continue
        a = numpy_helper.to_array(t)
        if a.size > 1 and np.all(a == a.flat[0]):
            constant[t.name] = a
    rng = np.random.default_rng(seed)
    uses = 0
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name not in constant:
                continue
            a = constant[name]
            value, noise = float(a.flat[0]), rng.standard_normal(a.shape)
            b = value * (1 + 0.1 * noise) if value != 0 else 0.02 * noise
            copy = f"{name}__trained{uses}"
            graph.initializer.append(numpy_helper.from_array(b.astype(a.dtype), copy))
            node.input[i] = copy
            uses += 1
    read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    kept = [t for t in graph.initializer if t.name not in constant or t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return uses
