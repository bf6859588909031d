"""Keras models converted by tf2onnx: ``keras.applications`` classifiers (random weights, small
inputs; ConvNeXt is left out: tf2onnx 1.17 leaves its depthwise convolutions as
``StatefulPartitionedCall``) and layers ``keras.applications`` has few of (LSTM, bidirectional GRU, multi-head
attention, Conv1D, a U-Net's transposed convolutions and skips, separable convolutions, a
Normalization layer). Built and converted in the TensorFlow export venv (``.venv-export-tf``,
``requirements-export-tf.txt``: tensorflow-cpu, keras, tf2onnx), with ``tf2onnx``'s
``convert.from_keras`` as a user calls it: its own graph optimizers on (the default), the batch
dim dynamic, the opset spread over 13 and 17 by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.corpus import Spec, converted_specs, opset_by_name

# name -> (keras.applications constructor, input side, its keyword arguments)
APPLICATIONS: dict[str, tuple[str, int, dict[str, Any]]] = {
    "mobilenet-v2": ("MobileNetV2", 96, {"alpha": 0.35}),
    "mobilenet-v3-small": ("MobileNetV3Small", 96, {"minimalistic": False}),
    "resnet50": ("ResNet50", 64, {}),
    "efficientnet-b0": ("EfficientNetB0", 64, {}),
    "efficientnet-v2-b0": ("EfficientNetV2B0", 64, {}),
    "densenet121": ("DenseNet121", 64, {}),
    "mobilenet-v1": ("MobileNet", 64, {"alpha": 0.5}),
}
LAYERS = ("lstm", "bigru", "attention", "conv1d", "unet", "separable", "mlp-normalization")
OPSETS = (13, 17)

SPECS: list[Spec] = converted_specs(
    "keras",
    "keras_tf",
    "tf2onnx",
    "tf",
    {
        **{name: f"keras.applications.{ctor}" for name, (ctor, _, _) in APPLICATIONS.items()},
        **{name: f"keras.layers ({name})" for name in LAYERS},
    },
)


def opset_for(name: str) -> int:
    """13 or 17, the same for a name on every build."""
    return opset_by_name(name, OPSETS)


def _application(name: str) -> tuple[Any, list[tuple[list[int | None], str]]]:
    import keras

    ctor, side, kwargs = APPLICATIONS[name]
    model = getattr(keras.applications, ctor)(
        weights=None, input_shape=(side, side, 3), classes=10, **kwargs
    )
    return model, [([None, side, side, 3], "float32")]


def _layers(name: str) -> tuple[Any, list[tuple[list[int | None], str]]]:
    import keras
    from keras import layers

    if name in ("lstm", "bigru", "attention"):
        seq, vocab, width = 16, 500, 32
        ids = keras.Input((seq,), dtype="int32")
        x = layers.Embedding(vocab, width)(ids)
        if name == "lstm":
            x = layers.LSTM(width)(x)
        elif name == "bigru":
            x = layers.Bidirectional(layers.GRU(width, return_sequences=True))(x)
            x = layers.GlobalMaxPooling1D()(x)
        else:
            for _ in range(2):  # two post-norm encoder blocks
                a = layers.MultiHeadAttention(num_heads=4, key_dim=width // 4)(x, x)
                x = layers.LayerNormalization()(x + a)
                # the tanh form: tf2onnx 1.17 leaves the exact GELU's Erfc unconverted
                f = layers.Dense(width * 2)(x)
                f = keras.activations.gelu(f, approximate=True)
                x = layers.LayerNormalization()(x + layers.Dense(width)(f))
            x = layers.GlobalAveragePooling1D()(x)
        out = layers.Dense(4, activation="softmax")(x)
        return keras.Model(ids, out), [([None, seq], "int32")]
    if name == "conv1d":
        inp = keras.Input((400, 1))
        x = inp
        for filters in (16, 32, 64):
            x = layers.Conv1D(filters, 5, padding="same")(x)
            x = layers.BatchNormalization()(x)
            x = layers.ReLU()(x)
            x = layers.MaxPooling1D(2)(x)
        x = layers.GlobalAveragePooling1D()(x)
        return keras.Model(inp, layers.Dense(6)(x)), [([None, 400, 1], "float32")]
    if name == "unet":
        inp = keras.Input((64, 64, 3))
        skips, x = [], inp
        for filters in (16, 32):
            x = layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
            x = layers.BatchNormalization()(x)
            skips.append(x)
            x = layers.MaxPooling2D()(x)
        x = layers.Conv2D(64, 3, padding="same", activation="relu")(x)
        x = layers.Conv2DTranspose(32, 2, strides=2)(x)
        x = layers.Concatenate()([x, skips[1]])
        x = layers.Conv2D(32, 3, padding="same", activation="relu")(x)
        x = layers.UpSampling2D()(x)
        x = layers.Concatenate()([x, skips[0]])
        out = layers.Conv2D(2, 1, activation="sigmoid")(x)
        return keras.Model(inp, out), [([None, 64, 64, 3], "float32")]
    if name == "separable":
        inp = keras.Input((48, 48, 3))
        x = layers.Conv2D(16, 3, strides=2, padding="same")(inp)
        x = layers.LeakyReLU(0.1)(x)
        x = layers.DepthwiseConv2D(3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.PReLU()(x)
        x = layers.SeparableConv2D(32, 3, padding="same", activation="relu")(x)
        x = layers.Dropout(0.2)(x)
        x = layers.GlobalMaxPooling2D()(x)
        return keras.Model(inp, layers.Dense(5)(x)), [([None, 48, 48, 3], "float32")]
    if name == "mlp-normalization":
        import numpy as np

        norm = layers.Normalization()
        norm.adapt(np.random.default_rng(0).normal(3.0, 2.0, (256, 20)).astype("float32"))
        inp = keras.Input((20,))
        x = layers.Dense(64, activation="relu")(norm(inp))
        x = layers.Dropout(0.1)(x)
        x = layers.Dense(32, activation="tanh")(x)
        return keras.Model(inp, layers.Dense(1, activation="sigmoid")(x)), [([None, 20], "float32")]
    raise ValueError(name)


def build(model: str) -> Any:
    def write(out: Path, exporter: str) -> dict[str, Any]:
        import keras
        import tensorflow as tf
        import tf2onnx

        keras.utils.set_random_seed(0)
        net, inputs = _application(model) if model in APPLICATIONS else _layers(model)
        signature = tuple(
            tf.TensorSpec(shape, dtype, name=f"input_{i}")
            for i, (shape, dtype) in enumerate(inputs)
        )
        onx, _ = tf2onnx.convert.from_keras(net, input_signature=signature, opset=opset_for(model))
        import onnx

        # an op tf2onnx could not convert is left in the graph under its TensorFlow name
        # (ConvNeXt's StatefulPartitionedCall, the exact GELU's Erfc): a failed export
        onnx.checker.check_model(onx)
        onnx.save(onx, str(out))
        names = [i.name for i in onx.graph.input]
        shapes = {
            n: [2 if d is None else d for d in s] for n, (s, _) in zip(names, inputs, strict=True)
        }
        return {"dynamic": True, "opset": opset_for(model), "shapes": shapes}

    return write
