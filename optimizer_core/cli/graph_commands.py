"""``graphtrim optimize``, ``graphtrim verify`` and ``graphtrim passes``: the graph optimizer's
commands."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from graphtrim.cli.argtypes import csv as _csv
from graphtrim.cli.argtypes import (
    finite_nonneg_float,
    fraction,
    lazy_choices,
    literal_names,
    nonneg_int,
    positive_int,
)
from graphtrim.cli.exits import EXIT_MISMATCH, EXIT_OK
from graphtrim.errors import GraphtrimError, VerificationUnavailable


def _dims(items: Sequence[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not value.isdigit():
            raise GraphtrimError(f"--dim expects NAME=SIZE, got '{item}'")
        out[name] = int(value)
    return out


def _bytes(text: str) -> int:
    units = {"k": 1024, "m": 1024**2, "g": 1024**3}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    mult = units.get(t[-1:], 1)
    number = t[:-1] if t[-1:] in units else t
    try:
        value = int(float(number) * mult)
    except (ValueError, OverflowError) as exc:  # OverflowError: inf
        raise argparse.ArgumentTypeError(
            f"not a byte size: {text!r} (e.g. 4096, 64KiB, 1MiB)"
        ) from exc
    if value < 0:
        raise argparse.ArgumentTypeError(f"a byte size cannot be negative: {text!r}")
    return value


def _add_verify_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--rtol",
        type=finite_nonneg_float,
        default=1e-4,
        help="relative tolerance per element (default 1e-4)",
    )
    p.add_argument(
        "--atol",
        type=finite_nonneg_float,
        default=1e-5,
        help="absolute tolerance per element (default 1e-5)",
    )
    p.add_argument(
        "--trials",
        type=positive_int,
        default=3,
        help="random input sets to compare, at least 1 (default 3)",
    )
    p.add_argument(
        "--dim",
        action="append",
        default=[],
        metavar="NAME=SIZE",
        help="size for a symbolic input dim when making random inputs (repeatable; default 2)",
    )
    p.add_argument(
        "--inputs",
        metavar="FEEDS.npz",
        help="compare on these inputs instead of random ones: one array per model input, "
        "named like it, whose first axis runs over samples (up to --trials batches of them "
        "are compared), or, for inputs that do not take samples on their first axis, one set "
        "of feeds as they are fed. For models whose inputs must hold meaningful values "
        "(lengths, sample rates, indices) that random inputs cannot give",
    )


def _feeds(path: str | None, model: str, trials: int) -> list[dict[str, Any]] | None:
    """The first ``trials`` batches of ``--inputs``, checked against ``model``'s inputs."""
    if path is None:
        return None
    from graphtrim.data import load_feeds
    from graphtrim.verify import declared_input_specs

    return load_feeds(path, declared_input_specs(model), limit=trials)


def _preset_names() -> list[str]:
    return sorted(literal_names("graphtrim.graph.presets", "PRESETS"))


def _target_names() -> list[str]:
    return literal_names("graphtrim.graph.framework", "TARGETS")


def add_parsers(sub: Any) -> None:
    # the choices of --preset and --target are read when used, from the modules' source: neither
    # building the parser nor showing the help imports the passes or onnx_ir
    opt = sub.add_parser(
        "optimize",
        help="optimize an ONNX model",
        description=(
            "Optimize IN.onnx into OUT.onnx. The input is never modified. Passes run to a fixed "
            "point; --verify compares the result with the input in onnxruntime and fails (exit 1, "
            "no output written) on any difference beyond the tolerances, or exits 2 (no output "
            "written) when the input itself cannot be run in onnxruntime. Outputs computed from a "
            "random op are compared by shape and dtype only."
        ),
    )
    opt.add_argument("input", help="model to optimize (.onnx; external data beside it is followed)")
    opt.add_argument("-o", "--output", required=True, help="where to write the optimized model")
    lazy_choices(
        opt.add_argument(
            "--preset", default="default", help="pass preset; 'safe' = exact rewrites only"
        ),
        _preset_names,
    )
    opt.add_argument(
        "--passes",
        type=_csv,
        default=None,
        help="comma-separated passes to run instead of the preset",
    )
    opt.add_argument("--skip", type=_csv, default=[], help="comma-separated passes to leave out")
    opt.add_argument(
        "--verify",
        action="store_true",
        help="compare outputs with the input model after optimizing",
    )
    opt.add_argument(
        "--verify-each-pass",
        action="store_true",
        help="check equivalence after every pass and name the first pass that changed results (slow)",
    )
    opt.add_argument(
        "--report", metavar="R.json", help="write the JSON change log and statistics here"
    )
    opt.add_argument(
        "--max-iterations",
        type=positive_int,
        default=10,
        help="cap of the fixed-point loop (at least 1)",
    )
    opt.add_argument(
        "--fold-max-growth",
        type=_bytes,
        default="4KiB",
        help="bytes constant folding may add per folded value beyond the constants it frees",
    )
    opt.add_argument(
        "--fold-max-growth-ratio",
        type=fraction,
        default=0.05,
        help="beyond --fold-max-growth, the folded values of the run may together grow the "
        "model by this share of its weights' bytes (0 to 1; 0 turns it off)",
    )
    opt.add_argument(
        "--fold-max-tensor", type=_bytes, default="256MiB", help="largest tensor folding may create"
    )
    lazy_choices(
        opt.add_argument(
            "--target",
            default="portable",
            help="runtime to optimize for: 'portable' emits standard ONNX only; "
            "'ort-cpu'/'ort-cuda' may add onnxruntime contrib fusions; 'tensorrt' avoids ops "
            "TensorRT does not parse",
        ),
        _target_names,
    )
    opt.add_argument(
        "--opset",
        type=positive_int,
        default=None,
        metavar="N",
        help="raise the model's opset to N first, so fusions into newer ops can fire "
        "(Gelu needs 20; RMSNormalization, Attention and RotaryEmbedding 23); never lowered",
    )
    opt.add_argument(
        "--allow-lossy",
        action="store_true",
        help="permit rewrites that change numbers beyond rounding (QuantizeLinear -> "
        "DequantizeLinear pairs removed); --verify then reports by how much",
    )
    opt.add_argument(
        "--max-unroll",
        type=nonneg_int,
        default=16,
        help="unroll Loops whose constant trip count is at most this (0 disables unrolling)",
    )
    opt.add_argument(
        "--keep-metadata",
        action="store_true",
        help="keep the exporter's debug metadata (per-node metadata_props such as torch's "
        "stack traces, doc strings); by default it is removed. The model's own "
        "metadata_props are always kept",
    )
    opt.add_argument(
        "--keep-shapes",
        action="store_true",
        help="keep the type and shape annotations (value_info) of intermediate values; by "
        "default only the graph's inputs and outputs (and values of ops from domains "
        "onnxruntime does not know) keep theirs: onnxruntime infers its own, and measured "
        "faster on the output without them",
    )
    opt.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    opt.add_argument(
        "--progress",
        action="store_true",
        help="print a line per pass (default when stderr is a terminal)",
    )
    _add_verify_args(opt)
    opt.set_defaults(handler=cmd_optimize)

    ver = sub.add_parser(
        "verify",
        help="compare two models' outputs in onnxruntime",
        description="Run both models on the same seeded random inputs and compare every output.",
    )
    ver.add_argument("reference")
    ver.add_argument("candidate")
    ver.add_argument("--json", action="store_true", help="print the record as JSON")
    _add_verify_args(ver)
    ver.set_defaults(handler=cmd_verify)

    pas = sub.add_parser(
        "passes",
        help="list passes and presets (--rules: every rewrite rule)",
        description="List the passes and presets; with --rules, every rule of every pass from "
        "the passes' rule tables, with the math it relies on.",
    )
    pas.add_argument("--rules", action="store_true", help="list every rule of every pass")
    pas.set_defaults(handler=cmd_passes)


def _check_report_path(report: str, model_paths: Sequence[str]) -> None:
    """Refuse a ``--report`` path that cannot be written, before anything is optimized: a
    folder, a path under a file, or one of the models (the input, the output, its data file)."""
    target = Path(report)
    if target.is_dir():
        raise GraphtrimError(f"report {report} is a directory; give a file path")
    folder = next((p for p in target.absolute().parents if p.exists()), None)
    if folder is not None and not folder.is_dir():
        raise GraphtrimError(f"cannot write report {report}: {folder} is not a folder")
    if folder is not None and not os.access(folder, os.W_OK | os.X_OK):
        raise GraphtrimError(f"cannot write report {report}: {folder} is not writable")
    resolved = target.resolve()
    for path in model_paths:
        if resolved == Path(path).resolve():
            raise GraphtrimError(f"report {report} would overwrite the model {path}")


def _tolerance(args: argparse.Namespace) -> Any:
    from graphtrim.verify import Tolerance

    return Tolerance(rtol=args.rtol, atol=args.atol)


def cmd_optimize(args: argparse.Namespace) -> int:
    from graphtrim.graph.framework import OptimizeOptions
    from graphtrim.optimize_file import optimize_file

    if args.report:
        _check_report_path(
            args.report, [args.input, args.output, args.output + ".data", args.input + ".data"]
        )
    show_progress = args.progress or (sys.stderr.isatty() and not args.quiet)
    started = time.perf_counter()

    def progress(line: str) -> None:
        print(
            f"[graphtrim {time.perf_counter() - started:6.1f}s] {line}", file=sys.stderr, flush=True
        )

    options = OptimizeOptions(
        max_iterations=args.max_iterations,
        fold_max_growth_bytes=args.fold_max_growth,
        fold_max_growth_ratio=args.fold_max_growth_ratio,
        fold_max_tensor_bytes=args.fold_max_tensor,
        target=args.target,
        allow_lossy=args.allow_lossy,
        max_unroll_trip_count=args.max_unroll,
        target_opset=args.opset,
    )
    if args.inputs and not (args.verify or args.verify_each_pass):
        raise GraphtrimError("--inputs gives the inputs --verify or --verify-each-pass compare on")
    try:
        report = optimize_file(
            args.input,
            args.output,
            preset=args.preset,
            passes=args.passes,
            skip=args.skip,
            options=options,
            check=args.verify,
            check_each_pass=args.verify_each_pass,
            tolerance=_tolerance(args) if args.verify or args.verify_each_pass else None,
            trials=args.trials,
            dim_values=_dims(args.dim),
            inputs=_feeds(args.inputs, args.input, args.trials),
            progress=progress if show_progress else None,
            keep_metadata=args.keep_metadata,
            keep_shapes=args.keep_shapes,
        )
    except VerificationUnavailable as exc:
        flag = "--verify-each-pass" if args.verify_each_pass else "--verify"
        raise VerificationUnavailable(
            f"{exc} (without {flag} the model is optimized, unverified)"
        ) from exc
    if args.report:
        try:
            report.write_json(args.report)
        except OSError as exc:
            raise GraphtrimError(
                f"wrote {args.output}, but not the report {args.report}: {exc}"
            ) from exc
    if not args.quiet:
        print(report.table())
        print()
        print(report.log.summary())
        if report.metadata_stripped is not None and report.metadata_stripped.items:
            print(
                f"debug metadata: removed {report.metadata_stripped.items} item(s), "
                f"{report.metadata_stripped.bytes} bytes (--keep-metadata keeps them)"
            )
        if report.verification is not None:
            print(f"verification: {report.verification.summary()}")
        print(f"wrote {args.output}")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from graphtrim.modelio import read_proto
    from graphtrim.verify import Tolerance, verify_isolated

    read_proto(args.reference)
    read_proto(args.candidate)
    record = verify_isolated(
        args.reference,
        args.candidate,
        trials=args.trials,
        dim_values=_dims(args.dim),
        inputs=_feeds(args.inputs, args.reference, args.trials),
        tolerance=Tolerance(rtol=args.rtol, atol=args.atol),
    )
    if args.json:
        print(json.dumps(record.to_json(), indent=2))
    if record.unverifiable:  # nothing was compared: not a difference
        raise VerificationUnavailable(record.summary())
    if not args.json:
        print(record.summary())
    return EXIT_OK if record.ok else EXIT_MISMATCH


def cmd_passes(args: argparse.Namespace) -> int:
    from graphtrim.graph.presets import PASSES, PRESETS, all_rules

    if args.rules:
        # every rule from the passes' tables: pass, rule, the op types it is tried on, its math
        for pass_name, rule in all_rules():
            ops = ",".join(rule.ops) or "(graph)"
            print(f"{pass_name:<18} {rule.name:<28} {ops:<24} {rule.math}")
        return EXIT_OK
    print("passes:")
    for name, cls in PASSES.items():
        print(f"  {name:<18} {'exact ' if cls.exact else 'rounds'}  {cls.summary}")
    print("presets:")
    for name, names in PRESETS.items():
        print(f"  {name:<10} {', '.join(names)}")
    return EXIT_OK
