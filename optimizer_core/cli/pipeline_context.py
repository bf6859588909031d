"""The stage context and pipeline config that a ``graphtrim pipeline`` command line makes: the
tracking URI, the gate policy (a file or JSON), the weight-only settings, progress lines and
``-q``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from graphtrim.cli.variant_args import weight_settings
from graphtrim.errors import GraphtrimError
from graphtrim.redact import redact


def add_tracking_uri(p: argparse.ArgumentParser) -> None:
    """``--tracking-uri``, for the commands that take no other run parameter."""
    p.add_argument(
        "--tracking-uri",
        default=os.environ.get("MLFLOW_TRACKING_URI"),
        help="MLflow tracking/registry URI (default: $MLFLOW_TRACKING_URI)",
    )


def tracking_uri(args: argparse.Namespace) -> str:
    """The tracking URI given (or from the environment); refused when there is none."""
    if not args.tracking_uri:
        raise GraphtrimError("no tracking URI: pass --tracking-uri or set MLFLOW_TRACKING_URI")
    return str(args.tracking_uri)


def _context_and_config(args: argparse.Namespace) -> tuple[Any, Any]:
    import yaml

    from graphtrim.stages.context import PipelineConfig, StageContext

    started = time.perf_counter()

    terminal = sys.stderr.isatty()

    def progress(line: str) -> None:
        if not terminal and line.startswith("iteration "):
            return  # the optimizer's line per pass: for a terminal, not for a task's log
        line = redact(line)
        print(f"[graphtrim {time.perf_counter() - started:6.1f}s] {line}", file=sys.stderr)

    policy = None
    if args.policy:
        from graphtrim.gates.policy import GatePolicy
        from graphtrim.stages.context import parse_policy

        loaded = GatePolicy.load(args.policy)  # clear errors for a bad file
        policy = yaml.safe_load(Path(args.policy).read_text()) or {}
        parse_policy(policy, parsed=loaded)  # the config made below reads this parse
    elif getattr(args, "policy_json", None):
        try:
            policy = json.loads(args.policy_json)
        except ValueError as exc:
            raise GraphtrimError(f"--policy-json: not JSON ({exc})") from exc
        policy = policy or None
    if args.child_timeout <= 0:
        raise GraphtrimError("--child-timeout must be a positive number of seconds")
    if args.unreached_retries < 0:
        raise GraphtrimError("--unreached-retries must be 0 or more")
    ctx = StageContext(
        tracking_uri=tracking_uri(args),
        artifacts=args.artifacts,
        workdir=args.workdir,
        s3_endpoint_url=args.s3_endpoint_url,
        orchestrator_run_id=args.orchestrator_run_id,
        progress=None if args.quiet else progress,
        rejudge=args.rejudge,
        allow_variant_source=args.allow_variant_source,
        force_promotion=args.force_promotion,
        child_timeout=args.child_timeout,
        unreached_retries=args.unreached_retries,
    )
    if args.quiet:
        _quiet()
    config = PipelineConfig(
        variants=tuple(args.variants),
        preset=args.preset,
        device=args.device,
        tensorrt=args.tensorrt,
        policy=policy,
        calibration=args.calibration or None,  # "" from an orchestrator's empty parameter
        eval_data=args.eval_data or None,
        target_name=args.target_name or None,
        experiment=args.experiment,
        fallback=not args.no_fallback,
        fx_simplify=args.fx_simplify,
        weights=_weights(args),
        tune=args.tune,
        opset=args.opset,
    )
    return ctx, config


def _weights(args: argparse.Namespace) -> dict[str, Any] | None:
    """The weight-only settings: ``--weights-json`` or the flags, not both."""
    changed = _changed_weights(args)
    text = getattr(args, "weights_json", None)
    if not text:  # "" from an orchestrator's empty parameter
        return changed
    if changed:
        raise GraphtrimError(
            f"--weights-json and the weight flags ({', '.join(sorted(changed))}): give one"
        )
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise GraphtrimError(f"--weights-json: not JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise GraphtrimError("--weights-json: a JSON object of settings")
    return doc or None


def _changed_weights(args: argparse.Namespace) -> dict[str, Any] | None:
    """The weight-only settings given that differ from the defaults (None: all defaults, so
    that such a config hashes as before the settings existed)."""
    from graphtrim.quantize import QuantizeConfig

    defaults = QuantizeConfig()
    changed = {k: v for k, v in weight_settings(args).items() if getattr(defaults, k) != v}
    return changed or None


def _quiet() -> None:
    """``-q``: warnings and errors only, from graphtrim, MLflow and the exporters alike."""
    import logging
    import warnings

    os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"  # "View run ... at" links
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"  # download progress bars
    logging.getLogger().setLevel(logging.WARNING)
    for name in ("graphtrim", "mlflow", "torch", "onnxscript", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # the exporter's notes on optional packages it does without (torchvision ops)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
