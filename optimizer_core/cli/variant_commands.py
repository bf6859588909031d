"""``graphtrim quantize``, ``graphtrim evaluate``, ``graphtrim variants`` and ``graphtrim report``.

Exit codes as for ``optimize``: 0 success (every variant passed), 1 a variant failed a gate or its
accuracy check (``--allow-failed-variants``: only when none passed; see ``cli.exits``), 2 bad
input or arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from graphtrim.cli.argtypes import csv as _csv
from graphtrim.cli.argtypes import positive_int
from graphtrim.cli.exits import add_allow_failed, variants_exit
from graphtrim.cli.variant_args import (
    _add_quant_args,
    add_data_args,
    weight_settings,
)
from graphtrim.quantize.kinds import DEFAULT_VARIANTS, variants_help

EXIT_OK, EXIT_FAILED = 0, 1


def _progress(args: argparse.Namespace) -> Callable[[str], None] | None:
    if getattr(args, "quiet", False):
        return None
    started = time.perf_counter()

    def say(line: str) -> None:
        print(
            f"[graphtrim {time.perf_counter() - started:6.1f}s] {line}", file=sys.stderr, flush=True
        )

    return say


def add_parsers(sub: Any) -> None:
    from graphtrim.quantize import VARIANTS

    q = sub.add_parser(
        "quantize",
        help="build one variant (int8 / fp16 / graph) of a model",
        description=(
            "Build a variant of IN.onnx into OUT.onnx: graph optimization first, then the "
            f"conversion, then clean-up; variants: {variants_help()}. With --data or --policy the "
            "variant's accuracy gate is checked and, if it fails, the most sensitive nodes are "
            "kept in float and the variant rebuilt (--max-attempts)."
        ),
    )
    q.set_defaults(handler=cmd_quantize)
    q.add_argument("input")
    q.add_argument("-o", "--output", required=True)
    q.add_argument("--variant", choices=VARIANTS, default="int8-dynamic")
    q.add_argument(
        "--report", metavar="R.json", help="write the build record (attempts, exclusions)"
    )
    _add_quant_args(q)
    add_data_args(q)

    e = sub.add_parser(
        "evaluate",
        help="run the accuracy, latency and size gates on variants",
        description=(
            "Judge each VARIANT (NAME=PATH, or PATH whose file name says the variant, e.g. "
            "model.int8-static.onnx) against REFERENCE on the same data and device. Writes "
            "JSON, Markdown and HTML reports to --out. Models over 1 GiB in all are held one "
            "session at a time: the reference's outputs first, then each variant's, and the "
            "latency runs take turns block by block. Exit 1 when any variant fails a gate "
            "(with --allow-failed-variants: when none passed)."
        ),
    )
    e.set_defaults(handler=cmd_evaluate)
    add_allow_failed(e)
    e.add_argument("reference")
    e.add_argument("variants", nargs="+", metavar="VARIANT")
    e.add_argument("-o", "--out", default="graphtrim-evaluation", help="folder for the reports")
    e.add_argument(
        "--threads", type=positive_int, default=None, help="intra-op threads (default: policy's)"
    )
    add_data_args(e)

    v = sub.add_parser(
        "variants",
        help="build several variants and run every gate on them",
        description=(
            "Build --variants of IN.onnx into OUT_DIR, then judge them all against IN.onnx "
            "(the quantize and validate stages of the pipeline in one command). Exit 1 when "
            "any variant fails a gate (with --allow-failed-variants: when none passed)."
        ),
    )
    v.set_defaults(handler=cmd_variants)
    add_allow_failed(v)
    v.add_argument("input")
    v.add_argument("-o", "--out", required=True, help="folder for variants and reports")
    v.add_argument(
        "--variants",
        type=_csv,
        default=list(DEFAULT_VARIANTS),
        help=f"comma-separated: {', '.join(VARIANTS)}",
    )
    v.add_argument("--no-fallback", action="store_true", help="no sensitivity fallback")
    _add_quant_args(v)
    add_data_args(v)

    r = sub.add_parser(
        "report",
        help="render an evaluation JSON as HTML or Markdown",
        description="Re-render the reports of an evaluation from its JSON file.",
    )
    r.set_defaults(handler=cmd_report)
    r.add_argument("evaluation", metavar="EVALUATION.json")
    r.add_argument("-o", "--output", help="output file (.html or .md); default: print Markdown")


def _config(args: argparse.Namespace) -> Any:
    from graphtrim.quantize import QuantizeConfig

    return QuantizeConfig(
        preset=args.preset,
        per_channel=not args.per_tensor,
        method=args.method,
        activation_type=args.activation_type,
        weight_type=args.weight_type,
        quant_format=args.quant_format,
        calibration_batches=args.calibration_batches,
        nodes_to_exclude=list(args.exclude),
        max_attempts=args.max_attempts,
        keep_io_types=not args.fp16_io,
        tune_device=None if args.no_tune else args.device,
        **weight_settings(args),
    )


def _variant_name(item: str) -> tuple[str, str]:
    from graphtrim.quantize import VARIANTS

    name, sep, path = item.partition("=")
    if sep:
        return name, path
    stem = Path(item).name.removesuffix(".onnx")
    for v in sorted(VARIANTS, key=len, reverse=True):
        if stem == v or stem.endswith("." + v) or stem.endswith("_" + v):
            return v, item
    return stem, item


def cmd_quantize(args: argparse.Namespace) -> int:
    from graphtrim.data import input_specs, load_npz, random_data
    from graphtrim.gates.accuracy import accuracy_check
    from graphtrim.gates.policy import GatePolicy
    from graphtrim.graph.opset import passthrough_reason
    from graphtrim.modelio import read_proto
    from graphtrim.quantize import build_variant

    proto = read_proto(args.input)
    reason = passthrough_reason({o.domain: o.version for o in proto.opset_import})
    del proto
    if reason is not None:
        return _quantize_pass_through(args, reason)
    say = _progress(args)
    specs = input_specs(args.input)
    calib = (
        load_npz(args.calibration, specs, batch_size=args.batch_size, label_key=args.label_key)
        if args.calibration
        else None
    )
    check = None
    if args.data or args.policy:
        data = (
            load_npz(args.data, specs, batch_size=args.batch_size, label_key=args.label_key)
            if args.data
            else (calib or random_data(specs))
        )
        check = accuracy_check(
            args.input,
            data,
            GatePolicy.load(args.policy),
            args.variant,
            device=args.device,
            tensorrt=args.tensorrt,
        )
    # onnxruntime's own temporary files go into the build's staging folder (build_variant)
    build = build_variant(
        args.input,
        args.output,
        args.variant,
        config=_config(args),
        calibration=calib.batches if calib else None,
        accuracy_check=check,
        progress=say,
    )
    if args.report:
        Path(args.report).write_text(json.dumps(build.to_json(), indent=2))
    last = build.attempts[-1]
    print(
        f"wrote {args.output} ({args.variant}, {len(build.attempts)} attempt(s), "
        f"{len(build.excluded)} node(s) kept in float)"
    )
    if build.agreement is not None:
        print(f"agreement with the float model: {build.agreement.summary()}")
    if last.accuracy_passed is False:
        print(
            "accuracy check failed after every attempt: "
            + "; ".join(last.measured.get("broken", [])),
            file=sys.stderr,
        )
        if build.stopped:
            print(f"the fallback stopped: {build.stopped}", file=sys.stderr)
        advice = build.to_json()["advice"]
        if advice:
            print(f"{args.variant}: {advice}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _quantize_pass_through(args: argparse.Namespace, reason: str) -> int:
    """A model the converters cannot take (no default-domain opset, or one below the lowest
    the passes support) is written out unchanged, as ``graphtrim optimize`` does, with the
    same line; exit 0. The report records why."""
    from graphtrim.optimize_file import optimize_file

    report = optimize_file(args.input, args.output)  # the copy, written as optimize writes it
    if args.report:
        doc = {
            "variant": args.variant,
            "source": args.input,
            "output": args.output,
            "passed_through": reason,
            "attempts": [],
            "excluded": [],
            "optimize": report.to_json(),
        }
        Path(args.report).write_text(json.dumps(doc, indent=2))
    print(f"passed through: {reason}; the output is the input unchanged")
    print(f"wrote {args.output} ({args.variant} not applied)")
    return EXIT_OK


def _print_result(
    evaluation: Any, reports: dict[str, Path], quiet: bool, allow_failed: bool = False
) -> int:
    from graphtrim.gates.report import render_markdown

    doc = evaluation.to_json()
    if not quiet:
        print(render_markdown(doc))
    print(f"reports: {', '.join(str(p) for p in reports.values())}")
    failed = [v.name for v in evaluation.variants if not v.passed]
    if failed:
        print(f"failed gates: {', '.join(failed)}", file=sys.stderr)
    return variants_exit(evaluation.passed, failed, allow_failed)


def cmd_evaluate(args: argparse.Namespace) -> int:
    from graphtrim.data import input_specs, load_npz
    from graphtrim.errors import GraphtrimError
    from graphtrim.gates import GatePolicy, evaluate
    from graphtrim.modelio import read_proto

    read_proto(args.reference)
    named = [_variant_name(item) for item in args.variants]
    names = [n for n, _ in named]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise GraphtrimError(
            f"variant name(s) {', '.join(twice)} given more than once: name them NAME=PATH"
        )
    variants = dict(named)
    for path in variants.values():
        read_proto(path)
    policy = GatePolicy.load(args.policy)
    data = (
        load_npz(
            args.data,
            input_specs(args.reference),
            batch_size=args.batch_size,
            label_key=args.label_key,
        )
        if args.data
        else None
    )
    evaluation = evaluate(
        args.reference,
        variants,
        policy=policy,
        data=data,
        device=args.device,
        tensorrt=args.tensorrt,
        threads=args.threads,
        progress=_progress(args),
    )
    reports = evaluation.write(args.out)
    return _print_result(evaluation, reports, args.quiet, args.allow_failed_variants)


def cmd_variants(args: argparse.Namespace) -> int:
    from graphtrim.gates import GatePolicy
    from graphtrim.modelio import read_proto
    from graphtrim.stages.pipeline import build_and_evaluate

    read_proto(args.input)
    result = build_and_evaluate(
        args.input,
        args.out,
        args.variants,
        config=_config(args),
        calibration=args.calibration,
        eval_data=args.data,
        policy=GatePolicy.load(args.policy),
        device=args.device,
        tensorrt=args.tensorrt,
        batch_size=args.batch_size,
        label_key=args.label_key,
        fallback=not args.no_fallback,
        progress=_progress(args),
    )
    return _print_result(result.evaluation, result.reports, args.quiet, args.allow_failed_variants)


def cmd_report(args: argparse.Namespace) -> int:
    from graphtrim.errors import GraphtrimError
    from graphtrim.gates.report import render_html, render_markdown

    try:
        doc = json.loads(Path(args.evaluation).read_text())
        doc["variants"], doc["reference"]
    except FileNotFoundError as exc:
        raise GraphtrimError(f"{args.evaluation}: no such file") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise GraphtrimError(f"{args.evaluation}: not a graphtrim evaluation ({exc})") from exc
    out = Path(args.output) if args.output else None
    html = out is not None and out.suffix.lower() in (".html", ".htm")
    try:
        text = render_html(doc) if html else render_markdown(doc)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise GraphtrimError(
            f"{args.evaluation}: not a complete graphtrim evaluation (missing {exc})"
        ) from exc
    if out is None:
        print(text)
        return EXIT_OK
    out.write_text(text)
    print(f"wrote {out}")
    return EXIT_OK
