"""``graphtrim pipeline run|stage``, ``graphtrim promote`` and ``graphtrim rollback``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from graphtrim.cli.argtypes import csv as _csv
from graphtrim.cli.argtypes import (
    lazy_choices,
    literal_names,
    opset_arg,
    positive_float,
    tune_budget,
)
from graphtrim.cli.exits import add_allow_failed, variants_exit
from graphtrim.cli.variant_commands import add_weight_args, weight_settings
from graphtrim.errors import GraphtrimError
from graphtrim.redact import masked_command, redact

Command = Callable[[argparse.Namespace], int]


def _add_location_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tracking-uri",
        default=os.environ.get("MLFLOW_TRACKING_URI"),
        help="MLflow tracking/registry URI (default: $MLFLOW_TRACKING_URI)",
    )


def _stage_names() -> tuple[str, ...]:
    from graphtrim.stages import STAGE_NAMES

    return STAGE_NAMES


# the defaults the command line falls back on where a run parameter's environment variable is
# unset (an orchestrator always passes them)
_CLI_FALLBACK = {"artifacts": "graphtrim-artifacts"}
_METAVARS = {"integer": "N", "object": "JSON", "duration": "DURATION"}


def _add_run_param(p: Any, row: Any) -> None:
    """The ``graphtrim pipeline`` option of a run parameter (``graphtrim.run_params``)."""
    from graphtrim.run_params import REQUIRED, Names, parse_flag

    help_text = row.help
    kwargs: dict[str, Any] = {}
    default = row.default
    if row.type == "boolean":
        if default:  # on unless turned off: --no-NAME
            p.add_argument(row.flag, action="store_true", help=help_text)
            return
        # --NAME alone, or --NAME true|false (what an orchestrator renders a boolean as)
        kwargs |= {"nargs": "?", "const": True, "type": parse_flag, "metavar": "BOOL"}
    elif row.type == "array":
        kwargs["type"] = _csv
        help_text = f"{help_text}, comma-separated"
    elif row.type == "integer":
        kwargs["type"] = opset_arg
    elif row.type == "duration":
        kwargs["type"] = tune_budget
    if row.type in _METAVARS:
        kwargs["metavar"] = _METAVARS[row.type]
    if default is REQUIRED:
        default = None
        if row.env:
            default = os.environ.get(row.env, _CLI_FALLBACK.get(row.name))
            fallback = _CLI_FALLBACK.get(row.name)
            help_text += f" (default: ${row.env}" + (f", else {fallback})" if fallback else ")")
    elif row.env:
        default = os.environ.get(row.env, default)
        help_text += f" (default: ${row.env})"
    if isinstance(default, Names):
        default = default.load()
    if isinstance(row.choices, Names):
        names = row.choices
        if row.type == "array":
            help_text = f"{help_text}: {', '.join(names.load())}"
        else:
            action = p.add_argument(row.flag, default=default, help=help_text, **kwargs)
            lazy_choices(action, lambda: sorted(literal_names(names.module, names.name)))
            return
    elif row.choices:
        kwargs["choices"] = row.choices
    p.add_argument(row.flag, default=default, help=help_text, **kwargs)


def _add_pipeline_args(p: argparse.ArgumentParser) -> None:
    """The run parameters (``graphtrim.run_params``, the model aside: ``run`` and ``stage``
    take it each in their way), then the options of the command itself."""
    from graphtrim.run_params import on

    for row in on("cli"):
        if row.into == "source":
            continue
        if row.name == "policy":
            policy = p.add_mutually_exclusive_group()
            policy.add_argument(
                "--policy",
                metavar="GATES.yaml",
                help="gate and promotion policy file (default: the file $GRAPHTRIM_POLICY "
                "names, else the built-in policy)",
            )
            _add_run_param(policy, row)
            continue
        if row.name == "weights":
            add_weight_args(p)  # the same settings as flags, not with the JSON
        _add_run_param(p, row)
    p.add_argument("--workdir", help="scratch folder (default: the system's temporary folder)")
    p.add_argument(
        "--orchestrator-run-id",
        help="the orchestrator's run id, recorded in the lineage; a retry with the same id "
        "logs into the same MLflow run",
    )
    p.add_argument(
        "--child-timeout",
        type=positive_float,
        default=1800.0,
        metavar="SECONDS",
        help="limit for one variant's build or gates, each run in a child process (a crash "
        "or a hang there fails that variant only)",
    )
    p.add_argument(
        "-q", "--quiet", action="store_true", help="no progress lines, only the result table"
    )


def add_parsers(sub: Any) -> None:
    pipe = sub.add_parser(
        "pipeline",
        help="run the registry-to-registry pipeline (export .. promote)",
        description=(
            "Take a registered model version through export, optimize, quantize, validate, "
            "register and promote. Every stage is idempotent: re-running for the same source "
            "version and config registers nothing new."
        ),
    )
    pipe.set_defaults(handler=cmd_pipeline)
    psub = pipe.add_subparsers(dest="pipeline_command", required=True, metavar="SUBCOMMAND")
    run = psub.add_parser(
        "run",
        help="all stages in this process",
        description=(
            "Run all stages for --model and print a table of variants, their gates and the "
            "versions registered. Exit 0 when every variant passed its gates and is "
            "registered, 1 when any failed (those that passed are registered all the same; "
            "with --allow-failed-variants: 1 only when none passed), 2 on bad input (missing "
            "model, unreachable registry or store, unusable model)."
        ),
    )
    add_allow_failed(run)
    run.add_argument(
        "--model", required=True, help="source: models:/NAME/VERSION or models:/NAME@ALIAS"
    )
    _add_pipeline_args(run)
    run.add_argument("--json", metavar="FILE", help="write every stage's record here")

    st = psub.add_parser(
        "stage",
        help="one stage, records in and out as JSON (for orchestrators)",
        description=(
            "Run one stage. Inputs are the JSON records of earlier stages (--input NAME=FILE, "
            "repeatable: export needs --model; optimize needs export; quantize needs export and "
            "optimize; validate needs export and quantize; register needs optimize and "
            "validate; promote needs validate and register). The stage's record goes to --output."
        ),
    )
    lazy_choices(st.add_argument("stage"), _stage_names)
    st.add_argument("--model", help="source model URI (export only)")
    st.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="STAGE=FILE",
        help="record of an earlier stage",
    )
    st.add_argument("--output", required=True, metavar="FILE", help="where to write this record")
    st.add_argument(
        "--only", metavar="VARIANT", help="quantize: build this one variant (one task per variant)"
    )
    st.add_argument(
        "--tuned",
        metavar="FILE",
        help="quantize: the settings search `pipeline tune select` ended with (its --search "
        "output, a file or inline JSON): judge its best trials here",
    )
    _add_pipeline_args(st)

    tn = psub.add_parser(
        "tune",
        help="one step of the settings search over a worker pool (for orchestrators)",
        description=(
            "The settings search (--tune), a task per trial: `plan` (needs --input export= "
            "and optimize=) writes the search's state (--search-output) and its first round "
            "(--batch, a JSON list of trials); `trial` (the same inputs and --trial, one item "
            "of a round) builds and screens one trial on this worker, its model to the "
            "artifact store, its result to --output; `select` (--search, and --trials: the "
            "round's results, a JSON list) writes the state and the next round, empty when "
            "the search is done (--search-output and --batch: where plan and select write). "
            "Without --tune the plan has no search and the other steps end at once. Then "
            "`pipeline stage quantize --tuned SEARCH` judges each kind's best trials and builds "
            "the champion."
        ),
    )
    tn.add_argument("step", choices=("plan", "trial", "select"))
    tn.add_argument(
        "--input", action="append", default=[], metavar="STAGE=FILE", help="export, optimize"
    )
    tn.add_argument("--trial", metavar="JSON", help="trial: one trial of a round")
    tn.add_argument("--trials", metavar="FILE", help="select: the round's results (JSON list)")
    tn.add_argument("--search", metavar="FILE", help="select: the search's state (file or JSON)")
    tn.add_argument("--search-output", metavar="FILE", help="plan, select: where the state goes")
    tn.add_argument("--batch", metavar="FILE", help="plan, select: where the next round goes")
    tn.add_argument("--output", metavar="FILE", help="trial: where its result goes")
    tn.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="plan: the rounds the orchestrator lays out (default 5)",
    )
    _add_pipeline_args(tn)

    pr = sub.add_parser(
        "promote",
        help="point a registry alias at a version (with audit tags)",
        description=(
            "Move ALIAS of the registered model to VERSION. Versions graphtrim registered carry "
            "their gate results: one that failed a gate is refused unless --force. Both the "
            "new and the previous version get an audit tag (who, when, why)."
        ),
    )
    pr.add_argument("model", help="models:/NAME/VERSION")
    pr.add_argument(
        "--alias", required=True, help="the alias to move (champion, staging, ...): no default"
    )
    pr.add_argument("--why", required=True, help="reason, kept in the audit tags")
    pr.add_argument("--force", action="store_true", help="promote even if gates failed")
    _add_location_args(pr)
    pr.set_defaults(handler=cmd_promote)

    rb = sub.add_parser(
        "rollback",
        help="move an alias back to the version it pointed at before",
        description=(
            "Move ALIAS of NAME back to its previous version (graphtrim keeps each alias's "
            "history on the registered model). Both versions get an audit tag."
        ),
    )
    rb.add_argument("name", help="registered model name")
    rb.add_argument(
        "--alias", required=True, help="the alias to move back (champion, ...): no default"
    )
    rb.add_argument("--why", required=True, help="reason, kept in the audit tags")
    _add_location_args(rb)
    rb.set_defaults(handler=cmd_rollback)


def _tracking(args: argparse.Namespace) -> str:
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
        tracking_uri=_tracking(args),
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


@masked_command
def cmd_pipeline(args: argparse.Namespace) -> int:
    from graphtrim.stages import STAGE_NAMES, pipeline, stage
    from graphtrim.stages.records import ValidateRecord
    from graphtrim.stages.summary import table

    ctx, config = _context_and_config(args)
    if args.pipeline_command == "run":
        records = {
            name: record.to_json()
            for name, record in pipeline.run_pipeline(ctx, config, args.model).items()
        }
        if args.json:
            _write_json(Path(args.json), records)
        print(table(records))
        registered = records["register"]["registered"]
        failed = sorted(set(config.variants) - set(registered))
        if failed:
            print(f"failed gates: {', '.join(failed)}", file=sys.stderr)
        return variants_exit(registered, failed, args.allow_failed_variants)
    inputs: dict[str, Any] = {}
    for item in args.input:
        name, sep, path = item.partition("=")
        if not sep or name not in STAGE_NAMES:
            raise GraphtrimError(f"--input expects STAGE=FILE with a stage name, got '{item}'")
        inputs[name] = _record(item, path)
    if "export" in inputs and "config" in inputs["export"]:
        # the data hashes resolved by export keep the config hash stable across stages
        config = config.__class__.from_json({**config.to_json(), **_resolved(inputs["export"])})
    if args.pipeline_command == "tune":
        return _tune_step(args, ctx, config, inputs)
    step = stage(args.stage)
    need = step.args  # the records its function takes
    missing = [n for n in need if n not in inputs]
    if missing:
        raise GraphtrimError(
            f"stage {args.stage} needs --input for {', '.join(f'{m}=FILE' for m in missing)}"
        )
    if "validate" in inputs and isinstance(inputs["validate"], list):
        # one record per mapped gate task
        inputs["validate"] = ValidateRecord.merge(inputs["validate"])
    fn = step.load()
    if args.tuned and args.stage != "quantize":
        raise GraphtrimError("--tuned is for the stage quantize")
    if args.stage == "quantize" and (args.only or args.tuned):
        tuned = _json_or_null("--tuned", args.tuned) if args.tuned else None
        record = fn(
            ctx,
            config,
            *(inputs[n] for n in need),
            only=[args.only] if args.only else None,
            tuned=tuned or None,  # null: no search was asked
        )
    elif args.stage == "export":
        if not args.model:
            raise GraphtrimError("stage export needs --model models:/NAME/VERSION")
        record = fn(ctx, config, args.model)
    else:
        record = fn(ctx, config, *(inputs[n] for n in need))
    _write_json(Path(args.output), record.to_json())
    return 0


def _tune_step(args: argparse.Namespace, ctx: Any, config: Any, inputs: dict[str, Any]) -> int:
    """``pipeline tune STEP``: one step of the settings search (:mod:`graphtrim.stages.tune`)."""
    from graphtrim.stages import tune

    def need(*flags: str) -> None:
        missing = [f"--{f.replace('_', '-')}" for f in flags if not getattr(args, f)]
        missing += [f"--input {n}=FILE" for n in ("export", "optimize") if n not in inputs]
        if args.step == "select":
            missing = [m for m in missing if not m.startswith("--input")]
        if missing:
            raise GraphtrimError(f"pipeline tune {args.step} needs {', '.join(missing)}")

    if args.step == "trial":
        need("trial", "output")
        trial = _record("--trial", args.trial)
        if not isinstance(trial, dict):
            raise GraphtrimError("--trial: one trial (a JSON object) of a round")
        if config.tune is None:
            raise GraphtrimError("pipeline tune trial needs --tune (the search's budget)")
        _write_json(
            Path(args.output),
            tune.tune_trial(ctx, config, inputs["export"], inputs["optimize"], trial),
        )
        return 0
    if args.step == "plan":
        need("search_output", "batch")
        out = tune.tune_plan(ctx, config, inputs["export"], inputs["optimize"], rounds=args.rounds)
    else:
        need("search", "trials", "search_output", "batch")
        search = _json_or_null("--search", args.search)
        trials = _record("--trials", args.trials)
        if not isinstance(trials, list):
            raise GraphtrimError("--trials: the round's results, a JSON list")
        out = tune.tune_select(ctx, config, search or None, trials)
    _write_json(Path(args.search_output), out["search"])
    # each trial as a JSON string: a ParallelFor hands each item to a string parameter
    _write_json(Path(args.batch), [json.dumps(t) for t in out["batch"]])
    return 0


def _json_or_null(item: str, value: str) -> Any:
    """A record (see :func:`_record`), or None for ``null`` (a step that had nothing)."""
    return None if value.strip() == "null" else _record(item, value)


def _record(item: str, value: str) -> Any:
    """A stage record from a file, or inline JSON (an orchestrator's rendered parameter); a
    JSON list of records (or of JSON strings of records) for mapped tasks' outputs."""
    text = value
    if not value.lstrip().startswith(("{", "[")):
        try:
            text = Path(value).read_text()
        except OSError as exc:
            raise GraphtrimError(f"--input {item}: cannot read the record ({exc})") from exc
    try:
        doc = json.loads(text)
        if isinstance(doc, list):
            doc = [json.loads(d) if isinstance(d, str) else d for d in doc]
    except ValueError as exc:
        raise GraphtrimError(f"--input {item}: not a JSON record ({exc})") from exc
    return doc


def _resolved(export_record: dict[str, Any]) -> dict[str, Any]:
    cfg = export_record["config"]
    return {"data_sha256": cfg.get("data_sha256")}


def _write_json(path: Path, doc: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str))
    os.replace(tmp, path)


@masked_command
def cmd_promote(args: argparse.Namespace) -> int:
    from graphtrim.integrations.registry import Registry, parse_models_uri
    from graphtrim.promotion import promote_version

    name, version, _ = parse_models_uri(args.model)
    if version is None:
        raise GraphtrimError(f"promote takes models:/NAME/VERSION, not an alias ({args.model})")
    result = promote_version(
        Registry(_tracking(args)), name, version, args.alias, why=args.why, force=args.force
    )
    before = f" (was v{result['previous']})" if result["previous"] else ""
    print(f"{name}@{args.alias} -> v{version}{before}")
    print(_held_line(result.get("held_until_source_after")))
    return 0


@masked_command
def cmd_rollback(args: argparse.Namespace) -> int:
    from graphtrim.integrations.registry import Registry
    from graphtrim.promotion import rollback_alias

    result = rollback_alias(Registry(_tracking(args)), args.name, args.alias, why=args.why)
    print(f"{args.name}@{args.alias}: v{result['from']} -> v{result['to']}")
    print(_held_line(result["held"].get("since_source")))
    return 0


def _held_line(since: str | None) -> str:
    return (
        "held there: pipeline runs leave it until a source version newer than "
        f"v{since} arrives (or --force-promotion)"
        if since
        else "held there: pipeline runs leave it unless --force-promotion"
    )
