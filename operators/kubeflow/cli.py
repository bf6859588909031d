"""``graphtrim kfp compile`` and ``graphtrim kfp step``: commands the graphtrim CLI finds through
the ``graphtrim.commands`` entry point, so that the core never imports KFP. ``step`` (what the
compiled pipeline's reporting steps run) imports no KFP either: the step images need none."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from graphtrim.cli.argtypes import add_command_group
from graphtrim.errors import GraphtrimError


def register(sub: Any) -> dict[str, Callable[[argparse.Namespace], int]]:
    ksub = add_command_group(
        sub,
        "kfp",
        "kfp_command",
        help="Kubeflow Pipelines: compile the optimize pipeline",
        description="Kubeflow Pipelines (KFP v2) support.",
    )
    comp = ksub.add_parser(
        "compile",
        help="compile the optimize pipeline to a KFP v2 YAML file (offline)",
        description=(
            "Write the pipeline export -> optimize -> settings search -> quantize/gate per "
            "variant -> register -> promote as KFP v2 YAML, its steps running IMAGE. Upload it with the KFP UI or "
            "client; run parameters: model_uri, tracking_uri, artifacts, s3_endpoint_url, "
            "variants, preset, opset (raised to before the graph passes), policy (JSON), "
            "calibration, eval_data, weights (JSON: the "
            "weight-only variants' settings), tune (a budget such as "
            "10m: the settings search, a step per trial, before the variants are built)."
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
    comp.add_argument(
        "--credentials-secret",
        default="graphtrim-credentials",
        metavar="NAME",
        help="Kubernetes Secret whose keys every step gets as environment variables, each "
        "optional: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, "
        "MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD, MLFLOW_TRACKING_TOKEN; an empty "
        "NAME for none (each pod's own identity)",
    )
    step = ksub.add_parser(
        "step",
        help="run one stage as a KFP step: its record, plus its report and metrics artifacts",
        description=(
            "Run `graphtrim pipeline stage STAGE ...` (the arguments after --executor-input), "
            "then write what KFP shows of it: the stage's HTML report as the step's 'report' "
            "artifact and its numbers as the 'metrics' artifact (scalar metrics in the KFP UI), "
            "where KFP's executor input asks for them. The compiled pipeline's steps run this."
        ),
    )
    step.add_argument(
        "--executor-input",
        required=True,
        metavar="JSON",
        help="KFP's executor input (the {{$}} placeholder)",
    )
    step.add_argument(
        "stage_args",
        nargs=argparse.REMAINDER,
        metavar="STAGE ...",
        help="the arguments of `graphtrim pipeline stage`",
    )
    return {"kfp": cmd_kfp}


def cmd_kfp(args: argparse.Namespace) -> int:
    if args.kfp_command == "step":
        return cmd_step(args)
    # kfp is imported only when the command runs: every other command starts without it
    from graphtrim.kubeflow.pipeline import DEFAULT_IMAGE, compile_pipeline

    path = compile_pipeline(
        args.output,
        image=args.image or DEFAULT_IMAGE,
        device=args.device,
        credentials_secret=args.credentials_secret or None,
    )
    print(f"wrote {path}")
    return 0


def cmd_step(args: argparse.Namespace) -> int:
    from graphtrim.cli.main import build_parser
    from graphtrim.kubeflow.outputs import write_outputs

    try:
        executor_input = json.loads(args.executor_input)
    except ValueError as exc:
        raise GraphtrimError(f"--executor-input: not KFP's executor input JSON ({exc})") from exc
    if not isinstance(executor_input, dict):
        raise GraphtrimError("--executor-input: not KFP's executor input JSON (an object)")
    argv = ["pipeline", "stage", *args.stage_args]
    stage = build_parser(argv).parse_args(argv)
    code = int(stage.handler(stage))
    if code != 0:
        return code
    record = json.loads(Path(stage.output).read_text())
    write_outputs(record, executor_input, endpoint_url=stage.s3_endpoint_url or None)
    return 0
