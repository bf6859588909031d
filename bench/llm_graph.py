"""``python -m bench.llm_graph`` (or ``make bench-llm-graph``): the graph optimizer on a decoder
language model with its KV cache, against the anchors and onnxruntime-genai's model builder.

A Llama-like causal LM (default hidden 768, 12 layers, 12 query heads over 3 key/value heads,
vocabulary 32000: 124 M parameters, random weights) is logged with the transformers flavor
and exported by graphtrim's export stage (dynamo, opset 22, KV cache explicit). Then:

* ``export``: the export as it is (the baseline of every ratio);
* ``graphtrim``: ``graphtrim optimize`` with its defaults (opset 22 kept);
* ``graphtrim --opset 23``: the opset raised first, so that each layer's attention (KV cache,
  grouped-query heads, masked-row guard), rotary embeddings and RMS norms become the standard
  ``Attention``, ``RotaryEmbedding`` and ``RMSNormalization``;
* ``onnxslim`` and ``onnxsim`` on the export (their defaults);
* ``genai fp32``: the model builder's own fp32 graph of the same weights (its contrib
  ``GroupQueryAttention``, ``SkipSimplifiedLayerNormalization`` and ``RotaryEmbedding``), when
  the builder can be installed (``bench/.genai``, as ``bench.llm`` does).

Measured, all sessions open at once and timed interleaved (onnxruntime ORT_ENABLE_ALL, 1 and 2
threads, no spinning between runs): a decode step (one token after ``--past`` cached tokens)
and a prefill of ``--prompt`` tokens, p50; node counts; and for graphtrim's and the anchors'
outputs the largest difference from the export's outputs on a left-padded batch of two (rows
that attend to nothing included) and on a prefill. Results go to
``bench/results-llm/llm_graph.json`` and a Markdown table on stdout.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import publish
from bench.llm import ROOT, Decoder, _build, _llama, _time, add_decoder_arguments

log = logging.getLogger("bench.llm_graph")


def _export(folder: Path, hidden: int, layers: int, intermediate: int) -> tuple[Path, Path]:
    """The model saved for the builder (``hf``) and exported by graphtrim (``export``)."""
    from graphtrim.examples import language
    from graphtrim.exporter import to_onnx

    hf, onnx_path = folder / "hf", folder / "export" / "model.onnx"
    if onnx_path.exists():
        return hf, onnx_path
    model = _llama(hidden, layers, intermediate)
    tok = language.tokenizer(400)
    model.save_pretrained(hf)
    tok.save_pretrained(hf)
    saved = language.save_transformers(model, tok, folder / "mlflow", "text-generation")
    to_onnx(saved, onnx_path)
    return hf, onnx_path


def _graphtrim(src: Path, dst: Path, opset: int | None) -> tuple[Path, float]:
    from graphtrim.graph.framework import OptimizeOptions
    from graphtrim.optimize_file import optimize_file

    t0 = time.perf_counter()
    if not dst.exists():
        optimize_file(src, dst, options=OptimizeOptions(target_opset=opset), check=True)
    return dst, time.perf_counter() - t0


def _onnxslim(src: Path, dst: Path) -> tuple[Path, float]:
    import onnxslim

    t0 = time.perf_counter()
    if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        onnxslim.slim(str(src), str(dst), save_as_external_data=True)
    return dst, time.perf_counter() - t0


def _onnxsim(src: Path, dst: Path) -> tuple[Path, float]:
    import onnx
    import onnxsim

    t0 = time.perf_counter()
    if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        model, ok = onnxsim.simplify(str(src))
        if not ok:
            raise RuntimeError("onnxsim could not check its output")
        onnx.save(model, str(dst), save_as_external_data=True, location=dst.name + ".data")
    return dst, time.perf_counter() - t0


def _nodes(path: Path) -> int:
    import onnx

    return len(onnx.load(str(path), load_external_data=False).graph.node)


def _padded(decoder: Decoder, rng: np.random.Generator) -> dict[str, Any]:
    """A batch of two, three new tokens after five cached, the first row left-padded so that
    its first query rows attend to nothing."""
    feeds: dict[str, Any] = {"input_ids": rng.integers(3, 400, size=(2, 3)).astype(np.int64)}
    mask = np.ones((2, 8), dtype=np.int64)
    mask[0, :6] = 0
    feeds["attention_mask"] = mask
    for name, spec in decoder.inputs.items():
        if name.startswith("past_key_values"):
            feeds[name] = rng.standard_normal((2, spec.shape[1], 5, spec.shape[3])).astype(
                np.float32
            )
    return feeds


def render(results: dict[str, Any]) -> str:
    """The Markdown table of a run."""
    lines = [
        f"{results.get('model', 'Llama-like decoder')}, decode with {results['past']} cached "
        f"tokens, prefill {results['prompt']} tokens",
        "",
        "| model | nodes | threads | decode tok/s | decode vs export | prefill ms | "
        "prefill vs export | max abs diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for threads, row in results["threads"].items():
        for n, r in row.items():
            diff = results["parity"].get(n)
            lines.append(
                f"| {n} | {results['nodes'][n]} | {threads} | {r['tokens_per_s']:.1f} | "
                f"{r['decode_speedup']:.3f} | {r['prefill_ms']:.1f} | "
                f"{r['prefill_speedup']:.3f} | {'-' if diff is None else f'{diff:.1e}'} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = publish.parser(__doc__)
    add_decoder_arguments(ap, runs=60)
    ap.add_argument("--no-genai", action="store_true", help="leave the model builder out")
    ap.add_argument("--no-anchors", action="store_true", help="leave onnxslim and onnxsim out")
    ap.add_argument("--out", default=str(ROOT / "results-llm"))
    publish.add_publish_argument(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    out = Path(args.out) / f"llama-{args.hidden}x{args.layers}-graph"
    hf, export = _export(out, args.hidden, args.layers, args.intermediate)
    models: dict[str, Path] = {"export": export}
    seconds: dict[str, float] = {}
    made = {
        "graphtrim": lambda: _graphtrim(export, out / "graphtrim" / "model.onnx", None),
        "graphtrim --opset 23": lambda: _graphtrim(export, out / "opset23" / "model.onnx", 23),
    }
    if not args.no_anchors:
        made["onnxslim"] = lambda: _onnxslim(export, out / "onnxslim" / "model.onnx")
        made["onnxsim"] = lambda: _onnxsim(export, out / "onnxsim" / "model.onnx")
    for name, make in made.items():
        try:
            models[name], seconds[name] = make()
        except Exception as exc:  # an anchor that fails is reported, not fatal
            log.warning("%s failed: %s", name, exc)
    if not args.no_genai:
        try:
            models["genai fp32"] = _build(hf, out / "genai-fp32", "fp32")
        except Exception as exc:
            log.warning("the model builder failed: %s", exc)
    results: dict[str, Any] = {
        "past": args.past,
        "prompt": args.prompt,
        "runs": args.runs,
        "nodes": {n: _nodes(p) for n, p in models.items()},
        "optimize_seconds": seconds,
        "parity": {},
        "threads": {},
    }
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 400, size=(1, args.prompt))
    for threads in [int(t) for t in args.threads.split(",")]:
        decoders = {n: Decoder(p, threads) for n, p in models.items()}
        if not results["parity"]:
            ref = decoders["export"]
            padded = _padded(ref, np.random.default_rng(2))
            pre_ref = ref.feeds(prompt, 0, np.random.default_rng(1))
            want = ref.session.run(None, padded), ref.session.run(None, pre_ref)
            for n, d in decoders.items():
                if n in ("export", "genai fp32"):  # the builder's graph has its own names
                    continue
                got = d.session.run(None, padded), d.session.run(None, pre_ref)
                results["parity"][n] = max(
                    float(np.max(np.abs(a - b))) if a.size else 0.0
                    for w, g in zip(want, got, strict=True)
                    for a, b in zip(w, g, strict=True)
                )
        step = {
            n: d.feeds(prompt[:, -1:], args.past, np.random.default_rng(1))
            for n, d in decoders.items()
        }
        pre = {n: d.feeds(prompt, 0, np.random.default_rng(1)) for n, d in decoders.items()}
        decode = _time(decoders, step, args.runs)
        prefill = _time(decoders, pre, max(5, args.runs // 4))
        results["threads"][threads] = {
            n: {
                "decode_ms": decode[n] * 1e3,
                "tokens_per_s": 1.0 / decode[n],
                "decode_speedup": decode["export"] / decode[n],
                "prefill_ms": prefill[n] * 1e3,
                "prefill_speedup": prefill["export"] / prefill[n],
            }
            for n in decoders
        }
        del decoders
    results["model"] = f"Llama-like {args.hidden}x{args.layers}"
    publish.write(
        Path(args.out) / "llm_graph.json", "llm-graph", results, args, publish=args.publish
    )
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
