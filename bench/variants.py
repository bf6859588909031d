"""``python -m bench.variants`` (or ``make bench-variants``): every variant of two models, side by
side with the fp32 original and with onnxruntime's plain ``quantize_dynamic`` applied to the
unoptimized model.

Models: the digits CNN (trained in seconds on scikit-learn's digits; accuracy on held-out
images) and a BERT-like encoder from a ``transformers`` config (6 layers, hidden 384, 12 heads,
random weights; sequence 128; agreement with the fp32 output). For each variant: size ratio,
p50 speedup over the fp32 original (all models interleaved in one process, onnxruntime
optimizations on, one thread unless told), and accuracy delta / output cosine. The gate
verdicts come from graphtrim's built-in policy.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from bench import publish

ROOT = Path(__file__).resolve().parent
log = logging.getLogger("bench.variants")

SEQ = 128


def _bert(cache: Path) -> tuple[Path, Path, Path]:
    """The encoder, its calibration and its evaluation data (random token ids, fixed seed)."""
    model = cache / "bert-384x6.onnx"
    calib = cache / "bert-384x6.calibration.npz"
    evald = cache / "bert-384x6.eval.npz"
    rng = np.random.default_rng(0)
    if not calib.exists():
        np.savez(calib, input_ids=rng.integers(0, 8192, size=(16, SEQ), dtype=np.int64))
    if not evald.exists():
        np.savez(evald, input_ids=rng.integers(0, 8192, size=(32, SEQ), dtype=np.int64))
    if model.exists():
        return model, calib, evald
    import torch

    from bench.suite import bert_encoder

    torch.manual_seed(0)
    net = bert_encoder(8192, 384, 6, 12, 1536, 512).eval()
    log.info("exporting the BERT-like encoder to %s", model)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        batch = torch.export.Dim("batch", min=1, max=64)
        seq = torch.export.Dim("seq", min=2, max=512)
        torch.onnx.export(
            net,
            (torch.randint(0, 8192, (1, SEQ)),),
            str(model),
            dynamo=True,
            external_data=False,
            dynamic_shapes=({0: batch, 1: seq},),
            input_names=["input_ids"],
            output_names=["last_hidden_state"],
        )
    return model, calib, evald


def _digits(cache: Path) -> tuple[Path, Path, Path]:
    from graphtrim.examples.digits import make_digits_task

    folder = cache / "digits"
    if not (folder / "digits_cnn.onnx").exists():
        log.info("training the digits CNN")
        make_digits_task(folder)
    return folder / "digits_cnn.onnx", folder / "calibration.npz", folder / "eval.npz"


MODELS = {"digits": _digits, "bert": _bert}


def run_model(
    name: str,
    cache: Path,
    out: Path,
    variants: list[str],
    runs: int,
    threads: int,
) -> dict[str, Any]:
    from onnxruntime.quantization import quantize_dynamic

    from graphtrim.data import input_specs, load_npz
    from graphtrim.gates import GatePolicy, evaluate
    from graphtrim.quantize import QuantizeConfig, build_variant

    src, calib_path, eval_path = MODELS[name](cache)
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    specs = input_specs(src)
    batch = 32 if name == "digits" else 1
    calib = load_npz(calib_path, specs, batch_size=batch)
    data = load_npz(eval_path, specs, batch_size=batch)
    paths: dict[str, Path] = {}
    builds: dict[str, dict[str, Any]] = {}
    build_seconds: dict[str, float] = {}
    for variant in variants:
        dst = folder / f"{variant}.onnx"
        log.info("%s: building %s", name, variant)
        t0 = time.perf_counter()
        b = build_variant(
            src, dst, variant, config=QuantizeConfig(tune_device="cpu"), calibration=calib.batches
        )
        build_seconds[variant] = time.perf_counter() - t0
        builds[variant] = b.to_json()
        paths[variant] = dst
    plain = folder / "ort-quantize-dynamic.onnx"
    t0 = time.perf_counter()
    quantize_dynamic(src, plain)
    build_seconds["ort-quantize-dynamic"] = time.perf_counter() - t0
    paths["ort-quantize-dynamic"] = plain
    policy = GatePolicy(
        {
            "defaults": {
                "latency": {"runs": runs, "warmup": max(5, runs // 10), "threads": threads}
            },
            "variants": {"ort-quantize-dynamic": {"size": {"max_ratio": 0.35}}},
        }
    )
    log.info("%s: measuring %d variants (%d interleaved runs)", name, len(paths), runs)
    evaluation = evaluate(src, paths, policy=policy, data=data, threads=threads)
    evaluation.write(folder, stem="evaluation")
    rows = []
    for v in evaluation.variants:
        size = v.gate("size")
        lat = v.gate("latency")
        acc = v.gate("accuracy")
        am = acc.measured if acc else {}
        rows.append(
            {
                "variant": v.name,
                "passed": v.passed,
                "size_ratio": size.measured.get("ratio") if size else None,
                "p50_ms": lat.measured.get("p50_ms") if lat else None,
                "p50_speedup": lat.measured.get("speedup_p50") if lat else None,
                "baseline_p50_ms": (lat.measured.get("baseline") or {}).get("p50_ms")
                if lat
                else None,
                "cosine": am.get("cosine"),
                "metric_drop": am.get("metric_drop"),
                "reference_metric": am.get("reference_metric"),
                "variant_metric": am.get("variant_metric"),
                "build_seconds": build_seconds.get(v.name),
                "failed": [f"{g.gate}: {'; '.join(g.reasons)}" for g in v.gates if not g.passed],
            }
        )
    return {"model": name, "source": str(src), "rows": rows, "fingerprint": evaluation.fingerprint}


def _f(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def render(results: list[dict[str, Any]]) -> str:
    lines = []
    for res in results:
        base = next((r["baseline_p50_ms"] for r in res["rows"] if r["baseline_p50_ms"]), None)
        lines += [
            f"## {res['model']} (fp32 p50 {_f(base, '.3f')} ms)",
            "",
            "| variant | size ratio | smaller | p50 ms | p50 speedup | cosine | metric drop | gates |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in res["rows"]:
            smaller = 1 / r["size_ratio"] if r["size_ratio"] else None
            lines.append(
                f"| {r['variant']} | {_f(r['size_ratio'], '.3f')} | {_f(smaller, '.2f')}x "
                f"| {_f(r['p50_ms'], '.3f')} | {_f(r['p50_speedup'], '.2f')}x "
                f"| {_f(r['cosine'], '.6f')} | {_f(r['metric_drop'], '+.4f')} "
                f"| {'pass' if r['passed'] else 'FAIL: ' + ' / '.join(r['failed'])} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = publish.parser(__doc__, "python -m bench.variants")
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument(
        "--variants",
        nargs="*",
        default=["graph", "int8-dynamic", "int8-static", "fp16"],
    )
    ap.add_argument("--runs", type=int, default=200, help="interleaved latency runs per model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache", type=Path, default=ROOT / "models")
    ap.add_argument("--out", type=Path, default=ROOT / "results-variants")
    publish.add_publish_argument(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="bench: %(message)s")
    for noisy in ("torch", "torch.onnx", "onnxruntime"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    args.cache.mkdir(parents=True, exist_ok=True)
    results = [
        run_model(m, args.cache, args.out, args.variants, args.runs, args.threads)
        for m in args.models
    ]
    publish.write(args.out / "results.json", "variants", results, args, publish=args.publish)
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
