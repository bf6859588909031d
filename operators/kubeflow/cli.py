"""``graphtrim kfp compile``: a command the graphtrim CLI finds through the ``graphtrim.commands``
entry point, so that the core never imports KFP."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def register(sub: Any) -> dict[str, Callable[[argparse.Namespace], int]]:
    kfp = sub.add_parser(
        "kfp",
        help="Kubeflow Pipelines: compile the optimize pipeline",
        description="Kubeflow Pipelines (KFP v2) support.",
    )
    ksub = kfp.add_subparsers(dest="kfp_command", required=True, metavar="SUBCOMMAND")
    comp = ksub.add_parser(
        "compile",
        help="compile the optimize pipeline to a KFP v2 YAML file (offline)",
        description=(
            "Write the pipeline export -> optimize -> quantize/gate per variant -> register -> "
            "promote as KFP v2 YAML, its steps running IMAGE. Upload it with the KFP UI or "
            "client; run parameters: model_uri, tracking_uri, artifacts, s3_endpoint_url, "
            "variants, preset, policy (JSON), calibration, eval_data."
        ),
    )
    comp.add_argument("-o", "--output", required=True, help="where to write the YAML")
    comp.add_argument(
        "--image",
        default=None,
        help="graphtrim image the steps run (default: $GRAPHTRIM_IMAGE, else "
        "ghcr.io/graphtrim/graphtrim:0.1.0)",
    )
    comp.add_argument(
        "--device", choices=("cpu", "gpu"), default="cpu", help="where quantize and gate run"
    )
    return {"kfp": cmd_kfp}


def cmd_kfp(args: argparse.Namespace) -> int:
    # kfp is imported only when the command runs: every other command starts without it
    from operators.kubeflow.pipeline import DEFAULT_IMAGE, compile_pipeline

    path = compile_pipeline(args.output, image=args.image or DEFAULT_IMAGE, device=args.device)
    print(f"wrote {path}")
    return 0
