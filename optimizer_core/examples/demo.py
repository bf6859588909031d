"""The main job for now: optimize the bundled example model and print the before/after table.

Run with ``make demo`` (or ``python -m optimizer_core.examples.demo [OUT_DIR]``).
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    out_dir = Path(argv[0] if argv else "out/demo")
    import logging

    import torch

    # the exporter warns about optional packages (torchvision) the example does not use
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)

    from optimizer_core.cli import main as cli_main
    from optimizer_core.examples.models import export, simple_cnn

    src = out_dir / "simple_cnn.onnx"
    print(
        f"exporting the example CNN (dynamo exporter without its optimizer, dynamic batch) to {src}"
    )
    export(simple_cnn(), torch.randn(1, 3, 32, 32), src, dynamo=True)
    dst = out_dir / "simple_cnn.optimized.onnx"
    report = out_dir / "simple_cnn.report.json"
    print(f"optimizing into {dst} (report: {report})\n")
    return cli_main(["optimize", str(src), "-o", str(dst), "--verify", "--report", str(report)])


if __name__ == "__main__":
    sys.exit(main())
