"""``python -m bench.llm`` (or ``make bench-llm``): weight-only variants of a decoder language
model with its KV cache, against onnxruntime-genai's model builder.

A Llama-like causal LM is built from a ``transformers`` config with random weights (default
hidden 768, 12 layers, 12 query heads over 3 key/value heads, vocabulary 32000: 124 M
parameters) and saved with a small byte-level BPE tokenizer trained on a text Python ships.
onnxruntime-genai's model builder (installed into ``bench/.genai`` with ``pip --target`` on
first use; the project's torch and transformers are reused) exports it twice: fp32, and its own
int4 (``-p int4 -e cpu``). Its ``SimplifiedLayerNormalization`` (in the default domain, which
onnx does not define) is written as the standard ``RMSNormalization`` first. graphtrim builds ``int4-weight`` (portable and ort forms) and
``int8-weight`` from the builder's fp32 model.

Measured for each model, all sessions open at once and timed interleaved, the order rotating
every round (onnxruntime ORT_ENABLE_ALL, 1 and 2 threads):

* decode: one token with a KV cache of ``--past`` tokens, p50 over ``--runs`` steps, as
  tokens/s and as the ratio to fp32 (thread pools do not spin between runs: the sessions take
  turns on the same cores);
* prefill: a prompt of ``--prompt`` tokens, p50;
* agreement with fp32 on the same prompt: next-token top-1 agreement over every position and
  the cosine of the last position's logits;
* size on disk;
* graphtrim's int4 decode speed over the builder's int4, with its range over 5 consecutive
  blocks of runs (the same integers and kernels: the range says whether a difference is more
  than the machine's noise).

Results go to ``bench/results-llm/llm.json`` and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import publish

ROOT = Path(__file__).resolve().parent
GENAI = ROOT / ".genai"
GENAI_PIN = "onnxruntime-genai==0.18.0"
log = logging.getLogger("bench.llm")


def _genai_path() -> Path:
    """onnxruntime-genai, installed without its dependencies (they are the project's)."""
    if not (GENAI / "onnxruntime_genai").is_dir():
        log.info("installing %s into %s", GENAI_PIN, GENAI)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--target",
                str(GENAI),
                GENAI_PIN,
            ],
            check=True,
        )
    return GENAI


def _llama(hidden: int, layers: int, intermediate: int) -> Any:
    """The bench's Llama-like decoder: heads of 64, a key/value head per four query heads
    (at least one), vocabulary 32000, random weights."""
    from graphtrim.examples import language

    return language.llama(
        vocab_size=32000,
        hidden=hidden,
        layers=layers,
        heads=hidden // 64,
        kv_heads=max(1, hidden // 256),
        intermediate=intermediate,
    )


def _hf_model(folder: Path, hidden: int, layers: int, intermediate: int) -> int:
    from graphtrim.examples import language

    model = _llama(hidden, layers, intermediate)
    model.save_pretrained(folder)
    language.tokenizer(400).save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def _build(hf: Path, out: Path, precision: str) -> Path:
    if (out / "model.onnx").exists():
        return out / "model.onnx"
    env = {**os.environ, "PYTHONPATH": str(_genai_path()), "HF_HUB_OFFLINE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "onnxruntime_genai.models.builder",
        "-i",
        str(hf),
        "-o",
        str(out),
        "-p",
        precision,
        "-e",
        "cpu",
        "-c",
        str(out.parent / "hf-cache"),
    ]
    log.info("model builder: %s", " ".join(cmd[3:]))
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return out / "model.onnx"


def _standard_norms(src: Path, dst: Path, head_dim: int) -> Path:
    """The builder's model with its ``SimplifiedLayerNormalization`` (an op onnxruntime
    registers in the default domain, unknown to onnx, whose checker refuses the model) written
    as the standard ``RMSNormalization`` of opset 23, which computes the same; and the head
    size of its KV cache, a named dim there (``kv_cache_dim``), written as the number it is."""
    import onnx

    if dst.exists():
        return dst
    model = onnx.load(str(src))
    for node in model.graph.node:
        if node.op_type == "SimplifiedLayerNormalization" and node.domain in ("", "ai.onnx"):
            node.op_type = "RMSNormalization"
            del node.output[1:]
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = max(opset.version, 23)
    model.ir_version = max(model.ir_version, 11)
    for value in [*model.graph.input, *model.graph.output]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param == "kv_cache_dim":
                dim.dim_value = head_dim
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(dst), save_as_external_data=True, location=dst.name + ".data")
    return dst


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


class Decoder:
    """One onnxruntime session of a genai-layout decoder and feeds for it."""

    def __init__(self, path: Path, threads: int) -> None:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        # sessions run in turn: a pool thread spinning after its run would steal the next's core
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        self.inputs = {i.name: i for i in self.session.get_inputs()}

    def feeds(self, ids: np.ndarray, past: int, rng: np.random.Generator) -> dict[str, Any]:
        out: dict[str, Any] = {"input_ids": ids.astype(np.int64)}
        total = past + ids.shape[1]
        out["attention_mask"] = np.ones((1, total), dtype=np.int64)
        for name, spec in self.inputs.items():
            if name.startswith("past_key_values"):
                heads, dim = spec.shape[1], spec.shape[3]
                if not isinstance(dim, int):
                    dim = 64
                out[name] = rng.standard_normal((1, heads, past, dim)).astype(np.float32)
        return {k: v for k, v in out.items() if k in self.inputs}

    def logits(self, feeds: dict[str, Any]) -> np.ndarray:
        return self.session.run(["logits"], feeds)[0]


BLOCKS = 5


def _time(
    decoders: dict[str, Decoder], feeds: dict[str, dict[str, Any]], runs: int
) -> dict[str, list[float]]:
    """Seconds of every run of every decoder, interleaved; the order rotates every round."""
    for name, d in decoders.items():  # warm-up
        d.logits(feeds[name])
    names = list(decoders)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(runs):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            decoders[name].logits(feeds[name])
            times[name].append(time.perf_counter() - t0)
    return times


def _ratios(base: list[float], other: list[float]) -> tuple[float, float, float]:
    """median(base) / median(other) over all runs, and its smallest and largest value over
    :data:`BLOCKS` consecutive blocks of runs (how far the machine's noise moves it), as the
    latency gate computes them."""
    from graphtrim.gates.latency import LatencyRun, LatencyStats

    run = LatencyRun(
        "base", {"base": LatencyStats(base, 1), "other": LatencyStats(other, 1)}, BLOCKS, {}
    )
    blocks = run.block_speedups("other")
    return run.speedup("other"), min(blocks), max(blocks)


def render(results: dict[str, Any]) -> str:
    """The Markdown table of a run, then graphtrim's int4 decode speed over the builder's."""
    lines = [
        f"{results['model']}, {results['params'] / 1e6:.0f} M parameters, decode with "
        f"{results['past']} cached tokens, prefill {results['prompt']} tokens",
        "",
        "| model | MB | threads | decode tok/s | vs fp32 | prefill ms | top-1 agreement | cosine |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for threads, row in results["threads"].items():
        for n, r in row.items():
            lines.append(
                f"| {n} | {results['sizes'][n] / 1e6:.1f} | {threads} | {r['tokens_per_s']:.1f} | "
                f"{r['decode_speedup']:.2f} | {r['prefill_ms']:.1f} | {r['top1_agreement']:.3f} | "
                f"{r['last_cosine']:.4f} |"
            )
    lines += [
        "",
        "graphtrim's int4 decode speed over the builder's int4 (all runs; range over blocks):",
        "",
    ]
    for threads, row in results["threads"].items():
        for n, r in row.items():
            v = r.get("decode_vs_genai_int4")
            if v:
                lines.append(
                    f"- {n}, {threads} thread(s): {v['ratio']:.3f}x "
                    f"({v['block_min']:.3f}-{v['block_max']:.3f} over {BLOCKS} blocks)"
                )
    return "\n".join(lines)


def add_decoder_arguments(ap: argparse.ArgumentParser, *, runs: int) -> None:
    """The decoder's size, its prompt and cache lengths, and the timed runs and threads: the
    options this benchmark and ``bench.llm_graph`` share."""
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--past", type=int, default=256, help="KV cache length of a decode step")
    ap.add_argument("--prompt", type=int, default=128, help="prefill length")
    ap.add_argument("--runs", type=int, default=runs)
    ap.add_argument("--threads", default="1,2")


def main(argv: list[str] | None = None) -> int:
    ap = publish.parser(__doc__)
    add_decoder_arguments(ap, runs=40)
    ap.add_argument("--out", default=str(ROOT / "results-llm"))
    publish.add_publish_argument(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from graphtrim.quantize import QuantizeConfig, build_variant

    out = Path(args.out)
    tag = f"llama-{args.hidden}x{args.layers}"
    hf = out / tag / "hf"
    if not (hf / "config.json").exists():
        params = _hf_model(hf, args.hidden, args.layers, args.intermediate)
        (out / tag / "params.txt").write_text(str(params))
    params = int((out / tag / "params.txt").read_text())
    fp32 = _standard_norms(
        _build(hf, out / tag / "genai-fp32", "fp32"), out / tag / "fp32" / "model.onnx", 64
    )
    models: dict[str, Path] = {
        "fp32": fp32,
        "genai-int4": _build(hf, out / tag / "genai-int4", "int4"),
    }
    builds: dict[str, Any] = {}
    for name, variant, form in (
        ("graphtrim-int4-portable", "int4-weight", "portable"),
        ("graphtrim-int4-ort", "int4-weight", "ort"),
        ("graphtrim-int8-portable", "int8-weight", "portable"),
    ):
        dst = out / tag / name / "model.onnx"
        if not dst.exists():
            t0 = time.perf_counter()
            built = build_variant(fp32, dst, variant, config=QuantizeConfig(weight_form=form))
            builds[name] = {"seconds": time.perf_counter() - t0, "conversion": built.conversion}
        models[name] = dst
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 400, size=(1, args.prompt))
    results: dict[str, Any] = {
        "model": tag,
        "params": params,
        "past": args.past,
        "prompt": args.prompt,
        "runs": args.runs,
        "builds": builds,
        "sizes": {n: _size(p) for n, p in models.items()},
        "threads": {},
    }
    for threads in [int(t) for t in args.threads.split(",")]:
        decoders = {n: Decoder(p, threads) for n, p in models.items()}
        step = {
            n: d.feeds(prompt[:, -1:], args.past, np.random.default_rng(1))
            for n, d in decoders.items()
        }
        pre = {n: d.feeds(prompt, 0, np.random.default_rng(1)) for n, d in decoders.items()}
        decode_runs = _time(decoders, step, args.runs)
        decode = {n: statistics.median(t) for n, t in decode_runs.items()}
        prefill = {
            n: statistics.median(t) for n, t in _time(decoders, pre, max(5, args.runs // 4)).items()
        }
        ref = decoders["fp32"].logits(pre["fp32"])[0]
        row: dict[str, Any] = {}
        for n, d in decoders.items():
            got = d.logits(pre[n])[0]
            last_ref, last = ref[-1], got[-1]
            row[n] = {
                "decode_ms": decode[n] * 1e3,
                "tokens_per_s": 1.0 / decode[n],
                "decode_speedup": decode["fp32"] / decode[n],
                "prefill_ms": prefill[n] * 1e3,
                "top1_agreement": float(np.mean(got.argmax(-1) == ref.argmax(-1))),
                "last_cosine": float(
                    last @ last_ref / (np.linalg.norm(last) * np.linalg.norm(last_ref))
                ),
            }
        # graphtrim's int4 over the builder's: decode speed, with the range over the blocks
        for n in row:
            if n.startswith("graphtrim-int4"):
                # the builder's time over graphtrim's: graphtrim's speed over the builder's
                whole, lo, hi = _ratios(decode_runs["genai-int4"], decode_runs[n])
                row[n]["decode_vs_genai_int4"] = {"ratio": whole, "block_min": lo, "block_max": hi}
        results["threads"][threads] = row
        del decoders
    publish.write(out / "llm.json", "llm", results, args, publish=args.publish)
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
