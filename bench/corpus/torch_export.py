"""Torch export for the corpus, run in an export venv: one model, one exporter, one file (a
builder of another framework returns a function that writes the file with its own exporter).

``python -m bench.corpus.torch_export BUILD ARGS_JSON EXPORTER OUT`` builds the model with the
named builder and exports it, printing one JSON line (``dynamic``: whether the dynamic axes held,
``opset``). The dynamo exporter is tried with the builder's dynamic axes first and with static
shapes if that fails; the TorchScript exporter gets the axes as ``dynamic_axes``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any


@dataclasses.dataclass
class Built:
    """A torch module and how to call it. ``inputs`` are the example inputs in the order of the
    module's ``forward`` parameters; ``dynamic`` maps an input name to its dynamic axes."""

    module: Any
    inputs: dict[str, Any]
    outputs: list[str]
    dynamic: dict[str, dict[int, str]] = dataclasses.field(default_factory=dict)
    opset: int | None = None  # the TorchScript exporter's opset when the model needs one
    script: bool = False  # torch.jit.script the module before the TorchScript export


def resolve(build: str) -> Any:
    module, _, func = build.partition(":")
    return getattr(importlib.import_module(module), func)


@contextlib.contextmanager
def quiet_fd1():
    """Silence file descriptor 1: the TorchScript exporter prints whole graphs from C++."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)


TORCHSCRIPT_OPSETS = (11, 12, 13, 14, 15, 16, 17)


def torchscript_opset(name: str) -> int:
    """Spread the TorchScript exports over opsets 11-17, the same for a name on every build."""
    return TORCHSCRIPT_OPSETS[sum(name.encode()) % len(TORCHSCRIPT_OPSETS)]


def export(built: Built, exporter: str, out: Path, name: str) -> dict[str, Any]:
    import torch

    module = built.module.eval()
    args = tuple(built.inputs.values())
    names = list(built.inputs)
    info: dict[str, Any] = {}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            shapes = tuple(
                {ax: torch.export.Dim.DYNAMIC for ax in built.dynamic.get(n, {})} or None
                for n in names
            )

            def dynamo(dynamic_shapes: Any) -> None:
                torch.onnx.export(
                    module,
                    args,
                    str(out),
                    dynamo=True,
                    external_data=False,
                    input_names=names,
                    output_names=built.outputs,
                    dynamic_shapes=dynamic_shapes,
                )

            try:
                dynamo(shapes if any(shapes) else None)
                info["dynamic"] = any(shapes)
            except Exception:
                if not any(shapes):
                    raise
                dynamo(None)  # the static export where the dynamic one failed
                info["dynamic"] = False
        elif exporter == "torchscript":
            opset = built.opset or torchscript_opset(name)
            if built.script:
                module = torch.jit.script(module)
            axes: dict[str, dict[int, str]] = {n: a for n, a in built.dynamic.items() if a}
            with quiet_fd1():
                torch.onnx.export(
                    module,
                    args,
                    str(out),
                    dynamo=False,
                    opset_version=opset,
                    input_names=names,
                    output_names=built.outputs,
                    dynamic_axes=axes or None,
                )
            info["dynamic"] = bool(axes)
        else:
            raise ValueError(f"unknown torch exporter {exporter!r}")
    return info


def main(argv: list[str]) -> int:
    build, args_json, exporter, out = argv
    try:
        import torch
    except ImportError:  # an export environment of another framework: its builders seed it
        pass
    else:
        torch.manual_seed(0)
        torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    func = resolve(build)
    os.environ["CORPUS_EXPORTER"] = exporter  # builders may shape the model for their exporter
    result = func(**json.loads(args_json))
    if callable(result):  # a builder that writes its own file (another library's exporter)
        info = result(Path(out), exporter) or {}
    else:  # a Built (this module runs as __main__, so the class is checked by shape)
        info = export(result, exporter, Path(out), Path(out).stem)
        # the example's shapes: the sweep sizes the model's symbolic dims from them
        info["shapes"] = {n: list(t.shape) for n, t in result.inputs.items() if hasattr(t, "shape")}
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
