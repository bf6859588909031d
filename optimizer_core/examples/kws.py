"""A small keyword-spotting network and a synthetic task it learns in a few seconds on a CPU.

``KwsNet`` reads log-mel features, float32 ``[batch, 40 mel bins, 49 frames]``, and scores 12
classes: two 1-D convolution blocks (BatchNorm, ReLU), then a pre-norm transformer block over
the frames (LayerNorm, multi-head self-attention, residual; LayerNorm, GELU feed-forward,
residual), mean pooling over time and a linear classifier. About 68 k parameters; the
initial weights depend only on ``seed``.

``make_kws_data(n, seed)`` draws a learnable task: each class is a pattern of energy over
(frequency, time) — a pair of bands with a class-dependent sweep — placed at a random time
shift, with noise on top. ``train_kws`` fits a model to it (Adam, fixed seed).

torch is imported on first use: ``import graphtrim.examples.kws`` stays cheap, and
``KwsNet`` is built when first looked up.
"""

from __future__ import annotations

from typing import Any

import numpy as np

N_MELS = 40
N_FRAMES = 49
N_CLASSES = 12
CHANNELS = 72
HEADS = 4

_CLASS: Any = None


def _build_class() -> Any:
    import torch
    from torch import nn

    class KwsNet(nn.Module):
        """Keyword spotter: ``[batch, 40, 49]`` log-mel frames -> ``[batch, 12]`` logits."""

        def __init__(
            self,
            seed: int = 0,
            *,
            n_mels: int = N_MELS,
            channels: int = CHANNELS,
            heads: int = HEADS,
            n_classes: int = N_CLASSES,
        ) -> None:
            super().__init__()
            # the weights drawn below depend on the seed alone, not on the global RNG state
            gen_state = torch.random.get_rng_state()
            torch.manual_seed(seed)
            try:
                self.conv1 = nn.Conv1d(n_mels, channels, 3, padding=1)
                self.bn1 = nn.BatchNorm1d(channels)
                self.conv2 = nn.Conv1d(channels, channels, 3, padding=1)
                self.bn2 = nn.BatchNorm1d(channels)
                self.norm1 = nn.LayerNorm(channels)
                self.attn = nn.MultiheadAttention(channels, heads, batch_first=True)
                self.norm2 = nn.LayerNorm(channels)
                self.ff1 = nn.Linear(channels, 2 * channels)
                self.ff2 = nn.Linear(2 * channels, channels)
                self.head = nn.Linear(channels, n_classes)
            finally:
                torch.random.set_rng_state(gen_state)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.relu(self.bn1(self.conv1(x)))
            x = torch.relu(self.bn2(self.conv2(x)))
            x = x.transpose(1, 2)  # [batch, frames, channels]
            h = self.norm1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            x = x + self.ff2(nn.functional.gelu(self.ff1(self.norm2(x))))
            return self.head(x.mean(dim=1))

    return KwsNet


def __getattr__(name: str) -> Any:
    global _CLASS
    if name == "KwsNet":
        if _CLASS is None:
            _CLASS = _build_class()
        return _CLASS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def kws_net(seed: int = 0) -> Any:
    """A fresh ``KwsNet`` whose initial weights depend only on ``seed``."""
    return __getattr__("KwsNet")(seed)


def parameter_count(model: Any) -> int:
    return int(sum(p.numel() for p in model.parameters()))


def make_kws_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` synthetic log-mel clips, float32 ``[n, 40, 49]``, and their int64 labels (0..11).

    Class ``c`` puts energy in two bands that sweep over time at a class-dependent rate
    (start band ``3 c``, slope ``(c % 4 - 1.5) / 8`` bins per frame, the second band 8 bins
    higher), inside a window of 24 frames at a random position; unit-variance noise on top.
    The class patterns are fixed (they do not depend on ``seed``): two sets drawn with
    different seeds are one task.
    """
    rng = np.random.default_rng(seed)
    y = rng.integers(0, N_CLASSES, size=n).astype(np.int64)
    mel = np.arange(N_MELS, dtype=np.float32)[:, None]
    frames = np.arange(N_FRAMES, dtype=np.float32)[None, :]
    x = rng.standard_normal((n, N_MELS, N_FRAMES)).astype(np.float32)
    starts = rng.integers(0, N_FRAMES - 24, size=n)
    gains = rng.uniform(1.5, 2.5, size=n).astype(np.float32)
    for i in range(n):
        c = int(y[i])
        t = frames - starts[i]
        centre = 3.0 * c + (c % 4 - 1.5) / 8.0 * t
        pattern = np.exp(-0.5 * ((mel - centre) / 1.5) ** 2)
        pattern += 0.7 * np.exp(-0.5 * ((mel - centre - 8.0) / 1.5) ** 2)
        pattern *= ((t >= 0) & (t < 24)).astype(np.float32)
        x[i] += gains[i] * pattern.astype(np.float32)
    return x, y


def train_kws(
    model: Any,
    x: np.ndarray,
    y: np.ndarray,
    *,
    epochs: int = 3,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
) -> Any:
    """Train ``model`` on ``(x, y)`` with Adam (fixed shuffling seed); returns it in eval mode."""
    import torch

    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = torch.nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(xt), generator=gen)
        for i in range(0, len(xt), batch_size):
            idx = perm[i : i + batch_size]
            opt.zero_grad()
            loss_fn(model(xt[idx]), yt[idx]).backward()
            opt.step()
    model.eval()
    return model


def accuracy(model: Any, x: np.ndarray, y: np.ndarray) -> float:
    """Top-1 accuracy of ``model`` (eval mode, no gradients) on ``(x, y)``."""
    import torch

    model.eval()
    with torch.no_grad():
        pred = model(torch.from_numpy(x)).argmax(-1).numpy()
    return float((pred == y).mean())
