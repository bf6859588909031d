"""Models with real control flow and audio front-ends.

The scripted ones are ``torch.jit.script``-ed modules exported with the TorchScript exporter, so
their loops and branches become ``Loop`` and ``If`` nodes: a recurrent cell unrolled over time, a
while loop with a tensor condition, data-dependent branches, rank and size checks that are
constant once shapes are known (the pattern of scripted audio models), and a loop that grows a
tensor. The audio front-ends (STFT, mel filterbank, log, MFCC) and recurrent layers are traced and
exported with both exporters."""

from __future__ import annotations

from typing import Any

from bench.corpus import Spec, spec

SCRIPTED = [
    "rnn-cell-loop",
    "while-halving",
    "data-branch",
    "shape-checks",
    "audio-frontend",
    "growing-loop",
]
TRACED = ["stft-mel", "mfcc", "lstm-tagger", "gru-encoder", "conv1d-separator"]
# blocks of older model generations that real exports still carry
LEGACY = ["focus-stem", "scaled-head", "bert-legacy-mask"]

SPECS: list[Spec] = (
    [
        spec(
            f"scripted-{n}",
            "control-flow",
            f"torch.jit.script:{n}",
            "bench.corpus.scripted:scripted",
            exporters=("torchscript",),
            which=n,
        )
        for n in SCRIPTED
    ]
    + [
        spec(f"audio-{n}", "audio-rnn", f"torch:{n}", "bench.corpus.scripted:traced", which=n)
        for n in TRACED
    ]
    + [
        spec(f"legacy-{n}", "legacy-blocks", f"torch:{n}", "bench.corpus.scripted:traced", which=n)
        for n in LEGACY
    ]
)


def _mel_filters(n_fft: int, n_mels: int, sr: int = 16000) -> Any:
    import numpy as np
    import torch

    freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    mel = lambda f: 2595 * np.log10(1 + f / 700)  # noqa: E731
    points = np.linspace(mel(0), mel(sr / 2), n_mels + 2)
    hz = 700 * (10 ** (points / 2595) - 1)
    bank = np.zeros((n_mels, len(freqs)), dtype=np.float32)
    for i in range(n_mels):
        lo, mid, hi = hz[i], hz[i + 1], hz[i + 2]
        bank[i] = np.clip(np.minimum((freqs - lo) / (mid - lo), (hi - freqs) / (hi - mid)), 0, None)
    return torch.from_numpy(bank)


def scripted(which: str) -> Any:
    import torch
    from torch import nn

    from bench.corpus.torch_export import Built

    if which == "rnn-cell-loop":

        class Cell(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.wx = nn.Linear(16, 32)
                self.wh = nn.Linear(32, 32)
                self.out = nn.Linear(32, 4)

            def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, B, 16]
                h = torch.zeros(x.size(1), 32)
                for t in range(x.size(0)):
                    h = torch.tanh(self.wx(x[t]) + self.wh(h))
                return self.out(h)

        return Built(
            Cell(),
            {"x": torch.randn(6, 2, 16)},
            ["y"],
            {"x": {0: "time", 1: "batch"}},
            opset=16,
            script=True,
        )
    if which == "while-halving":

        class Halve(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.proj = nn.Linear(8, 8)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                y = self.proj(x)
                i = 0
                while bool(y.abs().max() > 1.0) and i < 20:
                    y = y * 0.5
                    i += 1
                return y

        return Built(
            Halve(),
            {"x": torch.randn(3, 8) * 10},
            ["y"],
            {"x": {0: "batch"}},
            opset=15,
            script=True,
        )
    if which == "data-branch":

        class Branch(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = nn.Linear(8, 8)
                self.b = nn.Linear(8, 8)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                if bool(x.mean() > 0):
                    y = torch.relu(self.a(x))
                else:
                    y = torch.sigmoid(self.b(x)) + 0.0
                return y * 1.0

        return Built(
            Branch(), {"x": torch.randn(4, 8)}, ["y"], {"x": {0: "batch"}}, opset=13, script=True
        )
    if which == "shape-checks":

        class Checks(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.conv = nn.Conv1d(1, 8, 5, padding=2)

            def forward(self, wav: torch.Tensor) -> torch.Tensor:
                if wav.dim() == 1:
                    wav = wav.unsqueeze(0)
                if wav.dim() == 2:
                    wav = wav.unsqueeze(1)
                if wav.size(1) != 1:
                    wav = wav.mean(dim=1, keepdim=True)
                return self.conv(wav)

        return Built(
            Checks(),
            {"wav": torch.randn(2, 1600)},
            ["features"],
            {"wav": {0: "batch", 1: "samples"}},
            opset=14,
            script=True,
        )
    if which == "audio-frontend":

        class Frontend(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.register_buffer("window", torch.hann_window(400))
                self.register_buffer("mel", _mel_filters(400, 40))
                self.preemph = 0.97

            def forward(self, wav: torch.Tensor) -> torch.Tensor:
                if wav.dim() == 1:
                    wav = wav.unsqueeze(0)
                wav = torch.cat([wav[:, :1], wav[:, 1:] - self.preemph * wav[:, :-1]], dim=1)
                spec = torch.stft(
                    wav, 400, 160, window=self.window, return_complex=False, center=False
                )
                power = spec.pow(2).sum(-1)
                mel = torch.matmul(self.mel, power)
                return torch.log(mel + 1e-6)

        return Built(
            Frontend(),
            {"wav": torch.randn(2, 4000)},
            ["logmel"],
            {"wav": {0: "batch", 1: "samples"}},
            opset=17,
            script=True,
        )
    if which == "growing-loop":

        class Grow(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.step = nn.Linear(8, 8)

            def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
                outs = x.unsqueeze(0)
                h = x
                for _ in range(int(n)):
                    h = torch.relu(self.step(h))
                    outs = torch.cat([outs, h.unsqueeze(0)], dim=0)
                return outs

        return Built(
            Grow(),
            {"x": torch.randn(2, 8), "n": torch.tensor(4)},
            ["steps"],
            {"x": {0: "batch"}},
            opset=13,
            script=True,
        )
    raise ValueError(which)


def traced(which: str) -> Any:
    import torch
    from torch import nn

    from bench.corpus.torch_export import Built

    if which in ("stft-mel", "mfcc"):
        mfcc = which == "mfcc"

        class Mel(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.register_buffer("window", torch.hann_window(512))
                self.register_buffer("mel", _mel_filters(512, 64))
                n = torch.arange(64, dtype=torch.float32)
                dct = torch.cos(torch.pi / 64 * (n[None, :] + 0.5) * n[:13, None])
                self.register_buffer("dct", dct)

            def forward(self, wav: torch.Tensor) -> torch.Tensor:
                frames = wav.unfold(-1, 512, 256) * self.window
                power = torch.fft.rfft(frames).abs().pow(2)
                mel = torch.log(torch.matmul(power, self.mel.t()) + 1e-6)
                return torch.matmul(mel, self.dct.t()) if mfcc else mel

        return Built(
            Mel(), {"wav": torch.randn(1, 8000)}, ["features"], {"wav": {0: "batch"}}, opset=17
        )
    if which == "lstm-tagger":

        class Tagger(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.emb = nn.Embedding(500, 32)
                self.lstm = nn.LSTM(32, 32, num_layers=2, bidirectional=True, batch_first=True)
                self.head = nn.Linear(64, 9)

            def forward(self, tokens: torch.Tensor) -> torch.Tensor:
                return self.head(self.lstm(self.emb(tokens))[0])

        return Built(
            Tagger(),
            {"tokens": torch.randint(0, 500, (2, 12))},
            ["tags"],
            {"tokens": {0: "batch", 1: "seq"}},
        )
    if which == "gru-encoder":

        class Enc(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.gru = nn.GRU(40, 48, batch_first=True)
                self.norm = nn.LayerNorm(48)

            def forward(self, feats: torch.Tensor) -> torch.Tensor:
                out, h = self.gru(feats)
                return self.norm(out) + h.transpose(0, 1)

        return Built(
            Enc(),
            {"feats": torch.randn(2, 20, 40)},
            ["encoded"],
            {"feats": {0: "batch", 1: "frames"}},
        )
    if which == "conv1d-separator":

        class Sep(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.enc = nn.Conv1d(1, 32, 16, stride=8)
                blocks = []
                for d in (1, 2, 4, 8):
                    blocks += [
                        nn.Conv1d(32, 32, 3, padding=d, dilation=d),
                        nn.GroupNorm(1, 32),
                        nn.PReLU(),
                    ]
                self.tcn = nn.Sequential(*blocks)
                self.mask = nn.Conv1d(32, 64, 1)
                self.dec = nn.ConvTranspose1d(32, 1, 16, stride=8)

            def forward(self, wav: torch.Tensor) -> torch.Tensor:
                w = torch.relu(self.enc(wav))
                m = torch.sigmoid(self.mask(self.tcn(w))).view(wav.size(0), 2, 32, -1)
                return torch.stack([self.dec(w * m[:, i]) for i in range(2)], dim=1)

        return Built(Sep(), {"wav": torch.randn(1, 1, 4000)}, ["sources"], {"wav": {0: "batch"}})
    if which == "focus-stem":

        class Focus(nn.Module):
            """YOLOv5's first stem (space-to-depth by strided slices), then a small backbone."""

            def __init__(self) -> None:
                super().__init__()
                self.conv = nn.Sequential(
                    nn.Conv2d(12, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.SiLU()
                )
                self.body = nn.Sequential(
                    nn.Conv2d(16, 32, 3, 2, 1), nn.SiLU(), nn.Conv2d(32, 18, 1)
                )

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                x = torch.cat(
                    [x[..., ::2, ::2], x[..., 1::2, ::2], x[..., ::2, 1::2], x[..., 1::2, 1::2]], 1
                )
                y = self.body(self.conv(x))
                b, _, h, w = y.shape
                return torch.sigmoid(y.view(b, 3, 6, h, w).permute(0, 1, 3, 4, 2))

        return Built(
            Focus(), {"image": torch.randn(1, 3, 128, 128)}, ["pred"], {"image": {0: "batch"}}
        )
    if which == "scaled-head":

        class Head(nn.Module):
            """A mobile detector's head: scalar scales and offsets after convolutions."""

            def __init__(self) -> None:
                super().__init__()
                self.backbone = nn.Sequential(
                    nn.Conv2d(3, 16, 3, 2, 1),
                    nn.ReLU6(),
                    nn.Conv2d(16, 16, 3, 1, 1, groups=16),
                    nn.ReLU6(),
                )
                self.box = nn.Conv2d(16, 4 * 3, 1)
                self.cls = nn.Conv2d(16, 5 * 3, 1)

            def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                f = self.backbone(x * 0.017 - 1.8)
                box = self.box(f) * 0.1 + 0.0
                cls = torch.sigmoid(self.cls(f) * 1.0) * 2.0
                return box.flatten(2).transpose(1, 2), cls.flatten(2).transpose(1, 2)

        return Built(
            Head(),
            {"image": torch.rand(1, 3, 96, 96) * 255},
            ["boxes", "scores"],
            {"image": {0: "batch"}},
        )
    if which == "bert-legacy-mask":

        class Legacy(nn.Module):
            """An encoder written as BERT's first releases were: the additive mask
            ``(1 - mask[:, None, None, :]) * -10000`` and attention by explicit matmuls."""

            def __init__(self) -> None:
                super().__init__()
                self.emb = nn.Embedding(500, 64)
                self.qkv = nn.ModuleList(nn.Linear(64, 192) for _ in range(2))
                self.out = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))
                self.norm = nn.ModuleList(nn.LayerNorm(64) for _ in range(2))

            def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
                ext = mask[:, None, None, :].to(torch.float32)
                ext = (1.0 - ext) * -10000.0
                h = self.emb(ids)
                b, s, _ = h.shape
                for qkv, out, norm in zip(self.qkv, self.out, self.norm, strict=True):
                    q, k, v = qkv(h).view(b, s, 3, 4, 16).permute(2, 0, 3, 1, 4)
                    att = torch.matmul(q, k.transpose(-1, -2)) / 4.0 + ext
                    ctx = (
                        torch.matmul(torch.softmax(att, -1), v)
                        .permute(0, 2, 1, 3)
                        .reshape(b, s, 64)
                    )
                    h = norm(h + out(ctx))
                return h

        mask = torch.ones(2, 16, dtype=torch.int64)
        mask[1, 10:] = 0
        return Built(
            Legacy(),
            {"ids": torch.randint(0, 500, (2, 16)), "mask": mask},
            ["hidden"],
            {"ids": {0: "batch", 1: "seq"}, "mask": {0: "batch", 1: "seq"}},
        )
    raise ValueError(which)
