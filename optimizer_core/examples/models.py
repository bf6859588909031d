"""Example models built offline with PyTorch (random weights, fixed seed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def simple_cnn() -> Any:
    """The CNN of the project's founding document, with BatchNorm and Dropout added."""
    import torch
    from torch import nn

    class SimpleModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, 16, kernel_size=3, padding=1)
            self.bn1 = nn.BatchNorm2d(16)
            self.pool1 = nn.MaxPool2d(2, 2)
            self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
            self.bn2 = nn.BatchNorm2d(32)
            self.pool2 = nn.MaxPool2d(2, 2)
            self.drop = nn.Dropout(0.1)
            self.fc1 = nn.Linear(32 * 8 * 8, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.pool1(torch.relu(self.bn1(self.conv1(x))))
            x = self.pool2(torch.relu(self.bn2(self.conv2(x))))
            x = x.view(x.shape[0], 32 * 8 * 8)
            return self.fc1(self.drop(x))

    torch.manual_seed(0)
    model = SimpleModel().eval()
    with torch.no_grad():  # non-trivial BatchNorm statistics
        for bn in (model.bn1, model.bn2):
            assert bn.running_mean is not None and bn.running_var is not None
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
    return model


def export(
    model: Any,
    example: Any,
    path: Path,
    *,
    dynamo: bool,
    dynamic_batch: bool = True,
    input_name: str = "input",
    optimize: bool = False,
) -> Path:
    """Export ``model`` to ONNX at ``path`` (one file, no external data)."""
    import warnings

    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            shapes = ({0: torch.export.Dim("batch", min=1, max=1024)},) if dynamic_batch else None
            torch.onnx.export(
                model,
                (example,),
                str(path),
                dynamo=True,
                external_data=False,
                dynamic_shapes=shapes,
                input_names=[input_name],
                output_names=["output"],
                optimize=optimize,
                verbose=False,
            )
        else:
            axes = {input_name: {0: "batch"}, "output": {0: "batch"}} if dynamic_batch else None
            torch.onnx.export(
                model,
                (example,),
                str(path),
                dynamo=False,
                input_names=[input_name],
                output_names=["output"],
                dynamic_axes=axes,
                opset_version=17,
            )
    return path
