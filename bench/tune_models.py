"""The models the settings-search benchmark searches: built here with torch (random weights) and
their calibration and evaluation data; the gate policy both sides are held to."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("bench.tune")


def _export(module: Any, example: Any, path: Path, names: list[str]) -> None:
    import torch

    from bench.corpus.torch_export import quiet_fd1

    module.eval()
    with warnings.catch_warnings(), torch.no_grad(), quiet_fd1():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            (example,),
            str(path),
            dynamo=False,
            opset_version=17,
            input_names=names,
            output_names=["output"],
        )


def _images(shape: tuple[int, ...], n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *shape[1:])).astype(np.float32)


def _detector(seed: int) -> Any:
    """A YOLO-style detector: strided conv backbone with residual blocks, a head per cell
    (box, objectness, 8 classes, 3 anchors) decoded onto the grid (sigmoid, grid offsets,
    anchor scales) and concatenated."""
    import torch
    from torch import nn

    def cbs(cin: int, cout: int, stride: int = 1) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.SiLU()
        )

    class Res(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.a, self.b = cbs(c, c), cbs(c, c)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.b(self.a(x))

    class Detector(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Sequential(
                cbs(3, 16, 2), cbs(16, 32, 2), Res(32), cbs(32, 64, 2), Res(64), cbs(64, 96, 2)
            )
            self.anchors, self.classes = 3, 8
            self.head = nn.Conv2d(96, self.anchors * (5 + self.classes), 1)
            self.register_buffer("scale", torch.tensor([[10.0, 13.0], [16.0, 30.0], [33.0, 23.0]]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            f = self.head(self.backbone(x))
            b, _, h, w = f.shape
            f = f.view(b, self.anchors, 5 + self.classes, h, w).permute(0, 1, 3, 4, 2).sigmoid()
            gy, gx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            grid = torch.stack((gx, gy), -1).view(1, 1, h, w, 2).float()
            xy = (f[..., :2] * 2 - 0.5 + grid) * 16.0
            wh = (f[..., 2:4] * 2) ** 2 * self.scale.view(1, self.anchors, 1, 1, 2)
            out = torch.cat((xy, wh, f[..., 4:]), -1)
            return out.view(b, -1, 5 + self.classes)

    torch.manual_seed(seed)
    return Detector()


def _resnet(seed: int) -> Any:
    import torch

    from bench.suite import _resnet as resnet

    torch.manual_seed(seed)
    return resnet()[0]


def _mobilenet_v2(seed: int) -> Any:
    """MobileNetV2 at width 0.5: inverted residual blocks (1x1 expand, 3x3 depthwise, 1x1
    project, residual add where shapes allow), ReLU6, the paper's stage table."""
    import torch
    from torch import nn

    def cbr(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, act: bool = True) -> Any:
        layers: list[Any] = [
            nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
            nn.BatchNorm2d(cout),
        ]
        return nn.Sequential(*layers, *([nn.ReLU6()] if act else []))

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
            super().__init__()
            mid = cin * expand
            self.residual = stride == 1 and cin == cout
            self.body = nn.Sequential(
                *([cbr(cin, mid, 1)] if expand != 1 else []),
                cbr(mid, mid, 3, stride, groups=mid),
                cbr(mid, cout, 1, act=False),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.body(x)
            return x + y if self.residual else y

    class MobileNetV2(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            table = [
                (1, 8, 1, 1),
                (6, 12, 2, 2),
                (6, 16, 3, 2),
                (6, 32, 4, 2),
                (6, 48, 3, 1),
                (6, 80, 3, 2),
                (6, 160, 1, 1),
            ]
            layers: list[Any] = [cbr(3, 16, 3, 2)]
            cin = 16
            for t, c, n, stride in table:
                for i in range(n):
                    layers.append(Block(cin, c, stride if i == 0 else 1, t))
                    cin = c
            layers.append(cbr(cin, 640, 1))
            self.features = nn.Sequential(*layers)
            self.fc = nn.Linear(640, 100)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.features(x).mean(dim=(2, 3)))

    torch.manual_seed(seed)
    return MobileNetV2()


def _encoder(seed: int) -> Any:
    import torch

    from bench.suite import bert_encoder

    torch.manual_seed(seed)
    return bert_encoder(4096, 256, 4, 4, 1024, 128).eval()


def _kws(seed: int) -> Any:
    from graphtrim.examples.kws import kws_net, make_kws_data, train_kws

    x, y = make_kws_data(1024, seed=100 + seed)
    return train_kws(kws_net(seed), x, y, epochs=2, seed=seed)


class Model:
    """A bench model: how to build a version of it and its data."""

    def __init__(
        self,
        name: str,
        kind: str,
        build: Callable[[int, Path], None],
        data: Callable[[Path, Path], None],
        kinds: tuple[str, ...],
        calibrated: bool = True,
    ) -> None:
        self.name, self.kind, self.build, self.data = name, kind, build, data
        self.kinds, self.calibrated = kinds, calibrated

    def files(self, cache: Path, version: int) -> tuple[Path, Path, Path]:
        cache.mkdir(parents=True, exist_ok=True)
        model = cache / f"{self.name}-v{version}.onnx"
        calib, evald = cache / f"{self.name}.calibration.npz", cache / f"{self.name}.eval.npz"
        if not model.exists():
            log.info("%s: building version %d", self.name, version)
            self.build(version, model)
        if not evald.exists():
            self.data(calib, evald)
        return model, calib, evald


def _image_model(name: str, kind: str, make: Callable[[int], Any], shape: tuple[int, ...]) -> Model:
    def build(version: int, path: Path) -> None:
        import torch

        _export(make(version), torch.randn(*shape), path, ["input"])

    def data(calib: Path, evald: Path) -> None:
        np.savez(calib, input=_images(shape, 32, 1))
        np.savez(evald, input=_images(shape, 32, 2))

    return Model(name, kind, build, data, ("graph", "int8-dynamic", "int8-static"))


def _token_data(calib: Path, evald: Path, *, vocab: int, samples: int) -> None:
    """Random token ids, 64 per sample, for calibration and evaluation (one seed for both)."""
    rng = np.random.default_rng(0)
    for path in (calib, evald):
        np.savez(path, input_ids=rng.integers(0, vocab, (samples, 64), dtype=np.int64))


def _encoder_model() -> Model:
    def build(version: int, path: Path) -> None:
        import torch

        _export(_encoder(version), torch.randint(0, 4096, (1, 64)), path, ["input_ids"])

    return Model(
        "bert-256x4",
        "transformer encoder",
        build,
        lambda calib, evald: _token_data(calib, evald, vocab=4096, samples=16),
        ("graph", "int8-dynamic", "int8-static", "int8-weight"),
    )


def _kws_model() -> Model:
    def build(version: int, path: Path) -> None:
        import torch

        from graphtrim.examples.models import export

        # TorchScript's exporter takes no fused multi-head attention: dynamo's, batch 1
        export(_kws(version), torch.randn(1, 40, 49), path, dynamo=True, dynamic_batch=False)

    def data(calib: Path, evald: Path) -> None:
        from graphtrim.examples.kws import make_kws_data

        x, _ = make_kws_data(64, seed=7)
        np.savez(calib, input=x)
        x, y = make_kws_data(256, seed=8)
        np.savez(evald, input=x, labels=y)

    return Model(
        "kws-audio",
        "audio (keyword spotter, trained)",
        build,
        data,
        ("graph", "int8-dynamic", "int8-static"),
    )


def _decoder_model() -> Model:
    def build(version: int, path: Path) -> None:
        from graphtrim.examples.language import llama
        from graphtrim.exporter import export_causal_lm

        model = llama(
            vocab_size=2048,
            hidden=256,
            layers=4,
            heads=8,
            kv_heads=4,
            intermediate=688,
            seed=version,
        )
        export_causal_lm(model, path)

    return Model(
        "llama-256x4",
        "decoder LM with KV cache",
        build,
        lambda calib, evald: _token_data(calib, evald, vocab=2048, samples=8),
        ("graph", "int8-dynamic", "int4-weight", "int8-weight"),
        calibrated=False,
    )


# gates both sides are held to: the built-in policy, with an output-agreement bar that a
# random-weight model can meet (its logits carry no task to measure a drop on)
POLICY: dict[str, Any] = {
    "defaults": {"accuracy": {"min_cosine": 0.99, "min_top1_agreement": None}},
}


def _speedup(variant: Any) -> float | None:
    lat = variant.gate("latency") if variant is not None else None
    value = lat.measured.get("speedup_p50") if lat else None
    return float(value) if isinstance(value, int | float) else None


def _f(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)
