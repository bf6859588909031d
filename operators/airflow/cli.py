"""``graphtrim trigger``: start the optimize DAG on an Airflow deployment, for CI. A command the
graphtrim CLI finds through the ``graphtrim.commands`` entry point, so that the core never
imports an Airflow client (the REST client is :mod:`graphtrim.airflow.rest`)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from graphtrim.airflow.params import variant_choices
from graphtrim.cli.argtypes import csv, positive_float
from graphtrim.cli.exits import add_allow_failed, variants_exit
from graphtrim.errors import GraphtrimError
from graphtrim.redact import masked_command

Command = Callable[[argparse.Namespace], int]


def register(sub: Any) -> dict[str, Command]:
    tr = sub.add_parser(
        "trigger",
        help="start graphtrim_optimize_model on an Airflow deployment (for CI)",
        description=(
            "Trigger the optimize DAG over Airflow's REST API v2 with the model version in conf. "
            "Credentials come from the environment: GRAPHTRIM_AIRFLOW_TOKEN, or "
            "GRAPHTRIM_AIRFLOW_USERNAME and GRAPHTRIM_AIRFLOW_PASSWORD; none where every user "
            "is an admin. With --wait: exit 0 when the run succeeded and every variant passed "
            "its gates (with --allow-failed-variants: at least one did), 1 otherwise, 2 on bad "
            "input, refused credentials or an unreachable API."
        ),
    )
    tr.add_argument(
        "--airflow-url",
        default=os.environ.get("GRAPHTRIM_AIRFLOW_URL"),
        help="Airflow API server, e.g. https://airflow.example.com (default: $GRAPHTRIM_AIRFLOW_URL)",
    )
    tr.add_argument("--model", required=True, help="registered model name")
    which = tr.add_mutually_exclusive_group(required=True)
    which.add_argument("--version", help="model version")
    which.add_argument("--alias", help="model alias")
    tr.add_argument("--dag", default="graphtrim_optimize_model", help="DAG to trigger")
    tr.add_argument("--variants", type=csv, help=f"comma-separated: {', '.join(variant_choices())}")
    tr.add_argument("--policy", metavar="GATES.yaml", help="gate policy file, sent in conf")
    tr.add_argument("--calibration", help=".npz URI the workers can read")
    tr.add_argument("--eval-data", help=".npz URI the workers can read")
    tr.add_argument("--artifacts", help="artifact store for this run (s3://... or a folder)")
    tr.add_argument("--wait", action="store_true", help="wait for the run and report its result")
    tr.add_argument(
        "--timeout", type=positive_float, default=3600.0, help="seconds to wait at most"
    )
    tr.add_argument(
        "--poll", type=positive_float, default=5.0, help="seconds between status checks"
    )
    add_allow_failed(tr)
    df = sub.add_parser(
        "dags-folder",
        help="print the folder of graphtrim's DAG files (for Airflow's DAGS_FOLDER)",
        description=(
            "Print the folder that holds graphtrim's DAG files as installed with the package "
            "(<prefix>/share/graphtrim/dags; the checkout's dags/ for an editable install). "
            "Point Airflow at it: export AIRFLOW__CORE__DAGS_FOLDER=$(graphtrim dags-folder), "
            "or copy its files into an existing DAGS_FOLDER. Exit 2 when there is none."
        ),
    )
    df.set_defaults(handler=cmd_dags_folder)
    return {"trigger": cmd_trigger, "dags-folder": cmd_dags_folder}


def dags_folder() -> Path | None:
    """Where graphtrim's DAG files are: the wheel's data files, else a checkout's ``dags/``."""
    import sysconfig

    for candidate in (
        Path(sysconfig.get_path("data")) / "share" / "graphtrim" / "dags",
        Path(__file__).resolve().parents[2] / "dags",
    ):
        if (candidate / "graphtrim_optimize_model.py").is_file():
            return candidate
    return None


def cmd_dags_folder(args: argparse.Namespace) -> int:
    folder = dags_folder()
    if folder is None:
        raise GraphtrimError("graphtrim's DAG files are not installed (reinstall graphtrim)")
    print(folder)
    return 0


def _client(url: str) -> Any:
    """The REST client of ``url``; a clear error where its library (an extra) is absent."""
    try:
        import airflow_client.client  # noqa: F401
    except ImportError as exc:
        raise GraphtrimError(
            f"graphtrim trigger needs apache-airflow-client ({exc}): "
            "pip install 'graphtrim[airflow-client]'"
        ) from exc
    from graphtrim.airflow.rest import AirflowClient

    return AirflowClient(url)


@masked_command
def cmd_trigger(args: argparse.Namespace) -> int:
    import yaml

    if not args.airflow_url:
        raise GraphtrimError("no Airflow URL: pass --airflow-url or set GRAPHTRIM_AIRFLOW_URL")
    conf: dict[str, Any] = {"model_name": args.model}
    conf.update({"version": args.version} if args.version else {"alias": args.alias})
    if args.variants:
        conf["variants"] = args.variants
    if args.policy:
        from graphtrim.gates.policy import GatePolicy

        GatePolicy.load(args.policy)  # refused here, not by a worker later
        conf["policy"] = yaml.safe_load(Path(args.policy).read_text()) or {}
    for key in ("calibration", "eval_data", "artifacts"):
        if getattr(args, key):
            conf[key] = getattr(args, key)
    client = _client(args.airflow_url)
    run = client.trigger(args.dag, conf)
    print(f"triggered {args.dag} run {run.run_id}")
    if not args.wait:
        return 0

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    run = client.wait(args.dag, run.run_id, timeout=args.timeout, poll=args.poll, progress=progress)
    states = client.task_states(args.dag, run.run_id)
    print("tasks: " + ", ".join(f"{k}={v}" for k, v in sorted(states.items())))
    summary = client.xcom(args.dag, run.run_id, "summary")
    if summary:
        print(summary)
    if run.state != "success":
        failed = sorted(k for k, v in states.items() if v in ("failed", "upstream_failed"))
        print(
            f"graphtrim: run {run.run_id} {run.state} (failed tasks: {', '.join(failed)})",
            file=sys.stderr,
        )
        return 1
    register_record = client.xcom(args.dag, run.run_id, "register") or {}
    failed_variants = sorted(register_record.get("failed") or {})
    if failed_variants:
        print(
            f"graphtrim: variant(s) failed their gates: {', '.join(failed_variants)}",
            file=sys.stderr,
        )
    return variants_exit(
        register_record.get("registered") or {}, failed_variants, args.allow_failed_variants
    )
