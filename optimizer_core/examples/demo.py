"""The main job: optimize the bundled example model and print the before/after table, then
train a CNN on scikit-learn's digits, register it in an embedded MLflow registry and run the
whole pipeline on it: export to ONNX, optimize, build int8 / fp16 variants, judge them with the
accuracy, latency and size gates, register the ones that pass with their lineage and move the
aliases.

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
    return _pipeline(out_dir.resolve(), task)


def _pipeline(out_dir: Path, task: object) -> int:
    """Register the trained CNN in an embedded MLflow registry (SQLite, local artifacts) as
    a PyTorch model, then run the whole pipeline on it: export, optimize, variants, gates,
    registration with lineage and alias promotion."""
    import os
    import warnings

    import numpy as np

    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import mlflow

    from optimizer_core.cli import main as cli_main

    home = out_dir / "mlflow"
    home.mkdir(parents=True, exist_ok=True)
    tracking = f"sqlite:///{home / 'mlflow.db'}"
    mlflow.set_tracking_uri(tracking)
    client = mlflow.MlflowClient(tracking)
    if client.get_experiment_by_name("models") is None:
        client.create_experiment("models", artifact_location=(home / "artifacts").as_uri())
    mlflow.set_experiment("models")
    example = np.load(task.eval)["image"][:2]  # type: ignore[attr-defined]
    print(f"\nregistering the CNN as a PyTorch model in the MLflow registry at {tracking}")
    with warnings.catch_warnings(), mlflow.start_run(run_name="train-digits-cnn"):
        warnings.simplefilter("ignore")
        info = mlflow.pytorch.log_model(
            task.module,  # type: ignore[attr-defined]
            name="model",
            input_example=example,
            registered_model_name="digits-cnn",
            pip_requirements=["torch"],
        )
    version = info.registered_model_version
    model_uri = f"models:/digits-cnn/{version}"
    print(f"running the pipeline on {model_uri}\n")
    rc = cli_main(
        [
            "pipeline",
            "run",
            "--model",
            model_uri,
            "--tracking-uri",
            tracking,
            "--artifacts",
            str(out_dir / "artifacts"),
            "--variants",
            "graph,int8-dynamic,int8-static,fp16",
            "--calibration",
            str(task.calibration),  # type: ignore[attr-defined]
            "--eval-data",
            str(task.eval),  # type: ignore[attr-defined]
            "--json",
            str(out_dir / "pipeline.json"),
        ]
    )
    print(f"\nrecords of every stage: {out_dir / 'pipeline.json'}")
    print(f"browse the registry: mlflow ui --backend-store-uri {tracking}")
    # no variant passing its gates is the gates working, not a failed demo
    return 0 if rc in (0, 1) else rc


if __name__ == "__main__":
    sys.exit(main())
