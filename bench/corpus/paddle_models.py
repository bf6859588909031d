"""PaddlePaddle models converted by paddle2onnx: ``paddle.vision.models`` classifiers (random
weights) and a text encoder and a recurrent model built from ``paddle.nn``. Built in the Paddle
export venv (``.venv-export-paddle``, ``requirements-export-paddle.txt``: paddlepaddle,
paddle2onnx and the packages its constant folding through polygraphy imports, which it would
otherwise try to install while converting). Each model is saved with ``paddle.jit.save`` and
converted with ``paddle2onnx.export`` at its defaults (polygraphy's constant folding on), the
batch dim dynamic, at opset 13 or 17 by name."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from bench.corpus import Spec, converted_specs, opset_by_name

# name -> (paddle.vision.models constructor, input side, its keyword arguments)
VISION: dict[str, tuple[str, int, dict[str, Any]]] = {
    "resnet18": ("resnet18", 64, {}),
    "mobilenet-v1": ("mobilenet_v1", 64, {"scale": 0.5}),
    "mobilenet-v2": ("mobilenet_v2", 64, {"scale": 0.5}),
    "mobilenet-v3-small": ("mobilenet_v3_small", 64, {"scale": 0.5}),
    "shufflenet-v2": ("shufflenet_v2_x0_5", 64, {}),
    "squeezenet": ("squeezenet1_1", 64, {}),
    "densenet121": ("densenet121", 64, {}),
    "googlenet": ("googlenet", 224, {}),  # its classifier expects 224 x 224
}
LAYERS = ("transformer-encoder", "lstm")
OPSETS = (13, 17)

SPECS: list[Spec] = converted_specs(
    "paddle",
    "paddle_models",
    "paddle2onnx",
    "paddle",
    {
        **{name: f"paddle.vision.models.{ctor}" for name, (ctor, _, _) in VISION.items()},
        **{name: f"paddle.nn ({name})" for name in LAYERS},
    },
)


def opset_for(name: str) -> int:
    """13 or 17, the same for a name on every build."""
    return opset_by_name(name, OPSETS)


def _model(name: str) -> tuple[Any, list[Any], dict[str, list[int]]]:
    """The layer, its input specs and the example shapes (batch 2)."""
    import paddle
    from paddle import nn

    if name in VISION:
        ctor, side, kwargs = VISION[name]
        net = getattr(paddle.vision.models, ctor)(pretrained=False, num_classes=10, **kwargs)
        specs = [paddle.static.InputSpec([None, 3, side, side], "float32", "x")]
        return net, specs, {"x": [2, 3, side, side]}
    seq, vocab, width = 16, 500, 32

    class Encoder(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            layer = nn.TransformerEncoderLayer(width, 4, width * 2, dropout=0.0)
            self.encoder = nn.TransformerEncoder(layer, 2)
            self.head = nn.Linear(width, 4)

        def forward(self, ids: Any) -> Any:
            return self.head(self.encoder(self.embed(ids)).mean(axis=1))

    class Recurrent(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.lstm = nn.LSTM(width, width, num_layers=2)
            self.head = nn.Linear(width, 4)

        def forward(self, ids: Any) -> Any:
            out, _ = self.lstm(self.embed(ids))
            return self.head(out[:, -1])

    if name == "transformer-encoder":
        net = Encoder()
    elif name == "lstm":
        net = Recurrent()
    else:
        raise ValueError(name)
    return net, [paddle.static.InputSpec([None, seq], "int64", "ids")], {"ids": [2, seq]}


def build(model: str) -> Any:
    def write(out: Path, exporter: str) -> dict[str, Any]:
        import paddle
        import paddle2onnx

        paddle.seed(0)
        net, specs, shapes = _model(model)
        net.eval()
        with tempfile.TemporaryDirectory() as tmp:
            prefix = Path(tmp) / "model"
            paddle.jit.save(net, str(prefix), input_spec=specs)
            # Paddle 3 writes the program as JSON (PIR); older versions as .pdmodel
            program = next(
                p
                for p in (prefix.with_suffix(".json"), prefix.with_suffix(".pdmodel"))
                if p.exists()
            )
            paddle2onnx.export(
                str(program),
                str(prefix.with_suffix(".pdiparams")),
                str(out),
                opset_version=opset_for(model),
            )
        return {"dynamic": True, "opset": opset_for(model), "shapes": shapes}

    return write
