"""``graphtrim tune``: search variant settings by measurement, under a time budget.

Exit codes: 0 a champion passed every gate, 1 no candidate passed, 2 bad input or arguments.
"""

from __future__ import annotations

import argparse
from typing import Any

from graphtrim.cli.argtypes import csv as _csv
from graphtrim.cli.argtypes import duration, lazy_choices, literal_names
from graphtrim.cli.exits import EXIT_MISMATCH, EXIT_OK
from graphtrim.cli.variant_args import add_data_args


def add_parsers(sub: Any) -> None:
    t = sub.add_parser(
        "tune",
        help="search variant settings for the fastest model that passes every gate",
        description=(
            "Build and measure variants of IN.onnx with other settings than the fixed recipe "
            "(activation and weight types, per-channel scales, calibration, op types, forms, "
            "block sizes: graphtrim.tune.space), within --budget: candidates are screened with "
            "a short interleaved timing and the accuracy gate on a subset of the data, the best "
            "ones' neighbours tried next, the finalists judged with every gate on all of it. "
            "The champion is written to OUT/<name>.tuned.onnx, every trial to OUT/tune.json, "
            "tune.md and tune.html (with the speed/size Pareto front). With --memory, the "
            "winning settings are kept per graph signature and device: the next version of the "
            "same architecture starts from them and re-checks only their neighbourhood. Exit 0 "
            "with a champion, 1 when no candidate passed its gates."
        ),
    )
    t.set_defaults(handler=cmd_tune)
    t.add_argument("input", metavar="IN.onnx")
    t.add_argument("-o", "--out", required=True, help="folder for the champion and the reports")
    t.add_argument(
        "--budget",
        type=duration,
        default=600.0,
        help="time for the search, e.g. 90s, 10m, 1h (it ends within it plus one trial; "
        "default 10m)",
    )
    t.add_argument(
        "--kinds",
        type=_csv,
        default=None,
        help="variant kinds searched, comma-separated (default: those for --device: graph, "
        "int8-dynamic, int8-static with --calibration, the weight-only kinds, fp16 on gpu)",
    )
    objective = t.add_argument(
        "--objective",
        default=None,
        help="what the champion is best at among those that pass every gate: p50 latency, "
        "size, or balanced: speedup x (1/size)^size_weight (default: the policy's "
        "tune.objective and tune.size_weight, else latency and 0.25)",
    )
    # read when used, from the source: the policy module imports the variant table
    lazy_choices(objective, lambda: literal_names("graphtrim.gates.policy", "TUNE_OBJECTIVES"))
    t.add_argument(
        "--memory",
        metavar="M.json",
        help="a file keeping the winning settings per graph signature and device (read "
        "first, written when a champion is found)",
    )
    t.add_argument(
        "--calibration",
        metavar="C.npz",
        help="calibration data (int8-static is searched only with it)",
    )
    add_data_args(t)
    t._option_string_actions["--data"].help = (
        "evaluation data: one array per model input (+ optional labels); default: the "
        "calibration data, else seeded random inputs"
    )
    t.add_argument(
        "--keep-trials",
        action="store_true",
        help="keep every trial's model in OUT/<name>.trials (default: only the champion)",
    )


def cmd_tune(args: argparse.Namespace) -> int:
    from graphtrim.cli.variant_commands import _progress
    from graphtrim.data import input_specs, load_npz
    from graphtrim.gates import GatePolicy
    from graphtrim.modelio import read_proto
    from graphtrim.tune.memory import FileMemory
    from graphtrim.tune.report import summary
    from graphtrim.tune.search import TuneError, TuneSettings, tune, write_result

    read_proto(args.input)
    specs = input_specs(args.input)

    def npz(path: str | None) -> Any:
        if not path:
            return None
        return load_npz(path, specs, batch_size=args.batch_size, label_key=args.label_key)

    if args.kinds:
        from graphtrim.tune.space import check_kinds

        try:
            check_kinds(args.kinds)
        except KeyError as exc:
            raise TuneError(str(exc.args[0])) from exc
    result = tune(
        args.input,
        args.out,
        device=args.device,
        tensorrt=args.tensorrt,
        policy=GatePolicy.load(args.policy),
        data=npz(args.data),
        calibration=npz(args.calibration),
        kinds=args.kinds,
        settings=TuneSettings(budget_s=args.budget, objective=args.objective),
        memory=FileMemory(args.memory) if args.memory else None,
        keep_trials=args.keep_trials,
        progress=_progress(args),
    )
    doc = result.to_json()
    reports = write_result(result, args.out)
    print(summary(doc))
    if result.output:
        print(f"wrote {result.output}")
    print(f"reports: {', '.join(str(p) for p in reports.values())}")
    return EXIT_OK if result.champion is not None else EXIT_MISMATCH
