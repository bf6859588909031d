"""A real accuracy task that needs no download: a small CNN trained on scikit-learn's digits.

``make_digits_task(folder)`` trains the CNN (a few seconds on a CPU, fixed seeds), exports it to
ONNX with a dynamic batch, and writes three data files beside it: ``calibration.npz`` (training
images, no labels), ``eval.npz`` (held-out images with ``labels``) and ``train.npz``. Inputs are
named ``image``: float32, shape ``[batch, 1, 8, 8]``, scaled to [0, 1].
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np


@dataclasses.dataclass
class DigitsTask:
    model: Path
    calibration: Path
    eval: Path
    torch_accuracy: float
    module: Any = None  # the trained torch module


def _data(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(len(x) * 0.75)
    return x[:split], y[:split], x[split:], y[split:]


def digits_cnn() -> Any:
    import torch
    from torch import nn

    class DigitsCNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv2d(1, 32, 3, padding=1),
                nn.BatchNorm2d(32),
                nn.ReLU(),
                nn.Conv2d(32, 64, 3, padding=1),
                nn.BatchNorm2d(64),
                nn.ReLU(),
                nn.MaxPool2d(2),
            )
            self.head = nn.Sequential(
                nn.Flatten(),
                nn.Linear(64 * 4 * 4, 256),
                nn.ReLU(),
                nn.Dropout(0.1),
                nn.Linear(256, 10),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.features(x))

    return DigitsCNN()


def make_digits_task(folder: str | Path, *, epochs: int = 12, seed: int = 0) -> DigitsTask:
    import torch

    from graphtrim.examples.models import export

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    xtr, ytr, xte, yte = _data(seed)
    torch.manual_seed(seed)
    model = digits_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    xt, yt = torch.from_numpy(xtr), torch.from_numpy(ytr)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        model.train()
        perm = torch.randperm(len(xt), generator=gen)
        for i in range(0, len(xt), 64):
            idx = perm[i : i + 64]
            opt.zero_grad()
            loss_fn(model(xt[idx]), yt[idx]).backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        acc = float((model(torch.from_numpy(xte)).argmax(-1).numpy() == yte).mean())
    path = out / "digits_cnn.onnx"
    export(model, torch.from_numpy(xte[:2]), path, dynamo=True, input_name="image")
    np.savez(out / "calibration.npz", image=xtr[:256])
    np.savez(out / "eval.npz", image=xte, labels=yte)
    np.savez(out / "train.npz", image=xtr, labels=ytr)
    return DigitsTask(path, out / "calibration.npz", out / "eval.npz", acc, model)
