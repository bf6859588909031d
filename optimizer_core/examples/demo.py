"""The main job: optimize the bundled example model and print the before/after table, then
build int8 / fp16 variants of a CNN trained on scikit-learn's digits and judge them with the
accuracy, latency and size gates (reports in JSON, Markdown and HTML).

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
    rc = cli_main(["optimize", str(src), "-o", str(dst), "--verify", "--report", str(report)])
    if rc != 0:
        return rc

    from optimizer_core.examples.digits import make_digits_task

    print("\ntraining a small CNN on scikit-learn's digits (a real accuracy task, a few seconds)")
    task = make_digits_task(out_dir / "digits")
    print(f"fp32 accuracy on held-out digits: {task.torch_accuracy:.4f} ({task.model})")
    variants_dir = out_dir / "digits" / "variants"
    print(f"building variants and running the gates into {variants_dir}\n")
    rc = cli_main(
        [
            "variants",
            str(task.model),
            "-o",
            str(variants_dir),
            "--variants",
            "graph,int8-dynamic,int8-static,fp16",
            "--calibration",
            str(task.calibration),
            "--data",
            str(task.eval),
        ]
    )
    # a variant refused by its gates is the gates working, not a failed demo
    return 0 if rc in (0, 1) else rc


if __name__ == "__main__":
    sys.exit(main())
