"""``graphtrim pipeline run|stage``, ``graphtrim promote`` and ``graphtrim rollback``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from graphtrim.cli.argtypes import add_command_group, lazy_choices
from graphtrim.cli.exits import add_allow_failed, variants_exit
from graphtrim.cli.pipeline_args import _add_pipeline_args
from graphtrim.cli.pipeline_context import _context_and_config, add_tracking_uri, tracking_uri
from graphtrim.errors import GraphtrimError
from graphtrim.redact import masked_command

Command = Callable[[argparse.Namespace], int]


def _stage_names() -> tuple[str, ...]:
    from graphtrim.stages import STAGE_NAMES

    return STAGE_NAMES


def add_parsers(sub: Any) -> None:
    psub = add_command_group(
        sub,
        "pipeline",
        "pipeline_command",
        help="run the registry-to-registry pipeline (export .. promote)",
        description=(
            "Take a registered model version through export, optimize, quantize, validate, "
            "register and promote. Every stage is idempotent: re-running for the same source "
            "version and config registers nothing new."
        ),
        handler=cmd_pipeline,
    )
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
    _add_alias_move(pr, "the alias to move (champion, staging, ...): no default")
    pr.add_argument("--force", action="store_true", help="promote even if gates failed")
    add_tracking_uri(pr)
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
    _add_alias_move(rb, "the alias to move back (champion, ...): no default")
    add_tracking_uri(rb)
    rb.set_defaults(handler=cmd_rollback)


def _add_alias_move(p: argparse.ArgumentParser, alias_help: str) -> None:
    """The alias a command moves and why (``promote``, ``rollback``), both required."""
    p.add_argument("--alias", required=True, help=alias_help)
    p.add_argument("--why", required=True, help="reason, kept in the audit tags")


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
        Registry(tracking_uri(args)), name, version, args.alias, why=args.why, force=args.force
    )
    before = f" (was v{result['previous']})" if result["previous"] else ""
    print(f"{name}@{args.alias} -> v{version}{before}")
    print(_held_line(result.get("held_until_source_after")))
    return 0


@masked_command
def cmd_rollback(args: argparse.Namespace) -> int:
    from graphtrim.integrations.registry import Registry
    from graphtrim.promotion import rollback_alias

    result = rollback_alias(Registry(tracking_uri(args)), args.name, args.alias, why=args.why)
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
