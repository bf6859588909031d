"""The benchmark suite, built offline: torch exports of CNNs and transformers (random weights,
fixed seeds, each with the dynamo and the TorchScript exporter) plus the models that ship in the
``onnx`` package's backend test data."""

from __future__ import annotations

import logging
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx

from bench.corpus.torch_export import quiet_fd1 as _quiet_fd1

log = logging.getLogger("bench")


def _resnet() -> tuple[Any, Any]:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.b1 = nn.BatchNorm2d(cout)
            self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.b2 = nn.BatchNorm2d(cout)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
                )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(self.b1(self.c1(x)))
            y = self.b2(self.c2(y))
            return torch.relu(y + (x if self.down is None else self.down(x)))

    class ResNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(
                nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()
            )
            self.layers = nn.Sequential(
                Block(16, 16, 1), Block(16, 32, 2), Block(32, 64, 2), Block(64, 64, 1)
            )
            self.fc = nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.layers(self.stem(x))
            x = torch.flatten(torch.nn.functional.adaptive_avg_pool2d(x, 1), 1)
            return self.fc(x)

    return ResNet(), torch.randn(2, 3, 32, 32)


def _mobilenet() -> tuple[Any, Any]:
    import torch
    from torch import nn

    def dw(cin: int, cout: int, stride: int) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False),
            nn.BatchNorm2d(cin),
            nn.ReLU6(),
            nn.Conv2d(cin, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
            nn.Hardswish(),
        )

    class MobileNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv2d(3, 16, 3, 2, 1, bias=False),
                nn.BatchNorm2d(16),
                nn.ReLU6(),
                dw(16, 24, 1),
                dw(24, 32, 2),
                dw(32, 64, 2),
                dw(64, 96, 1),
            )
            self.drop = nn.Dropout(0.2)
            self.fc = nn.Linear(96, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.features(x).mean(dim=(2, 3))
            return self.fc(self.drop(x))

    return MobileNet(), torch.randn(2, 3, 64, 64)


class _LastHidden:
    """Wraps a transformers model so export sees one tensor in, one out (keyword call)."""

    def __new__(cls, model: Any) -> Any:
        import torch

        class Wrapper(torch.nn.Module):
            def __init__(self, inner: Any) -> None:
                super().__init__()
                self.inner = inner

            def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
                return self.inner(input_ids=input_ids).last_hidden_state

        return Wrapper(model)


def bert_encoder(
    vocab: int, hidden: int, layers: int, heads: int, intermediate: int, positions: int
) -> Any:
    """A BERT-like encoder of these sizes, random weights from torch's seed as it stands, that
    takes token ids and returns its last hidden state."""
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        max_position_embeddings=positions,
    )
    return _LastHidden(BertModel(cfg))


def _bert() -> tuple[Any, Any]:
    import torch

    return bert_encoder(1000, 128, 2, 4, 256, 64), torch.randint(0, 8, (2, 16))


def _gpt2() -> tuple[Any, Any]:
    import torch
    from transformers import GPT2Config, GPT2Model

    cfg = GPT2Config(
        vocab_size=1000, n_embd=128, n_layer=2, n_head=4, n_positions=64, use_cache=False
    )
    return _LastHidden(GPT2Model(cfg)), torch.randint(0, 8, (2, 16))


def _t5_encoder() -> tuple[Any, Any]:
    import torch
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(
        vocab_size=1000, d_model=128, d_kv=32, d_ff=256, num_layers=2, num_heads=4, use_cache=False
    )
    return _LastHidden(T5EncoderModel(cfg)), torch.randint(0, 8, (2, 16))


TORCH_MODELS: dict[str, Callable[[], tuple[Any, Any]]] = {
    "resnet": _resnet,
    "mobilenet": _mobilenet,
    "bert": _bert,
    "gpt2": _gpt2,
    "t5-encoder": _t5_encoder,
}

ONNX_BACKEND_MODELS = [
    "light/light_bvlc_alexnet.onnx",
    "light/light_densenet121.onnx",
    "light/light_inception_v1.onnx",
    "light/light_inception_v2.onnx",
    "light/light_resnet50.onnx",
    "light/light_shufflenet.onnx",
    "light/light_squeezenet.onnx",
    "light/light_vgg19.onnx",
    "light/light_zfnet512.onnx",
]


def _export(name: str, path: Path, dynamo: bool) -> None:
    import torch

    torch.manual_seed(0)
    model, example = TORCH_MODELS[name]()
    model.eval()
    is_ids = example.dtype == torch.int64
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if dynamo:
            batch = torch.export.Dim("batch", min=1, max=64)
            shapes: dict[int, Any] = {0: batch}
            if is_ids:
                shapes[1] = torch.export.Dim("seq", min=2, max=64)
            torch.onnx.export(
                model,
                (example,),
                str(path),
                dynamo=True,
                external_data=False,
                dynamic_shapes=(shapes,),
                input_names=["input"],
                output_names=["output"],
            )
        else:
            axes = {0: "batch", 1: "seq"} if is_ids else {0: "batch"}
            torch.onnx.export(
                model,
                (example,),
                str(path),
                dynamo=False,
                opset_version=17,
                input_names=["input"],
                output_names=["output"],
                dynamic_axes={"input": axes, "output": {0: "batch"}},
            )


def build_suite(cache: Path, names: list[str] | None = None) -> dict[str, Path]:
    """Build (or reuse) every suite model under ``cache``; returns name -> path."""
    cache.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    for name in TORCH_MODELS:
        for dynamo in (True, False):
            key = f"{name}-{'dynamo' if dynamo else 'torchscript'}"
            if names and key not in names:
                continue
            path = cache / f"{key}.onnx"
            failed = cache / f"{key}.export-failed.txt"
            if failed.exists():
                log.info("skipping %s: its export failed before (%s)", key, failed)
                continue
            if not path.exists():
                log.info("exporting %s", key)
                try:
                    with _quiet_fd1():
                        _export(name, path, dynamo)
                except Exception as exc:  # an exporter failure drops the model, not the bench
                    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    log.warning("export of %s failed: %s", key, first)
                    failed.write_text(f"{type(exc).__name__}: {first}\n")
                    path.unlink(missing_ok=True)
                    continue
            out[key] = path
    data = Path(onnx.__file__).parent / "backend" / "test" / "data"
    for rel in ONNX_BACKEND_MODELS:
        key = Path(rel).stem
        if names and key not in names:
            continue
        src = data / rel
        if src.exists():
            dst = cache / src.name
            if not dst.exists():
                shutil.copyfile(src, dst)
            out[key] = dst
    return out
