"""``python -m bench.llm_pipeline`` (or ``make bench-llm-pipeline``): a language model over 2 GB
through the whole pipeline, each stage in its own process, with its wall time and peak RSS.

A Llama-like causal LM (default: hidden 2048, 22 layers, 32 query heads over 4 key/value heads,
intermediate 5632, vocabulary 32000: 1.1 B parameters, 4.4 GB in fp32; random weights) is
logged with MLflow's ``transformers`` flavor to a local SQLite tracking store and registered.
Then ``graphtrim pipeline stage`` runs export, optimize, quantize, validate, register and promote
one after another (``--variants graph,int4-weight,int8-dynamic`` by default; the int4
accuracy gate loosened for random weights, everything else as the pipeline's defaults,
sensitivity fallback included), and finally a
process loads the registered ``int4-weight`` variant with ``mlflow.pyfunc.load_model`` and
generates greedily through its KV cache. The exported file is also optimized by
``graphtrim optimize``, OnnxSlim and onnxsim, each as a user runs it, for their wall time, peak
RSS and node counts.

Peak RSS is ``ru_maxrss`` of each stage's process tree as ``wait4`` reports it (the largest
single process: a stage's children build the variants and run the gates). Results go to
``<out>/pipeline.json`` and a Markdown table on stdout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import publish

ROOT = Path(__file__).resolve().parent
STAGES = ("export", "optimize", "quantize", "validate", "register", "promote")
NEEDS = {
    "optimize": ("export",),
    "quantize": ("export", "optimize"),
    "validate": ("export", "quantize"),
    "register": ("optimize", "validate"),
    "promote": ("validate", "register"),
}


def _timed(cmd: list[str], log: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run ``cmd``; its wall time, exit code and peak RSS (bytes)."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    return {
        "seconds": round(time.perf_counter() - t0, 1),
        "rc": os.waitstatus_to_exitcode(status),
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        "log": str(log),
    }


_SOURCE = """
import sys, json, numpy as np, mlflow
from graphtrim.examples import language
out, tracking, name = sys.argv[1], sys.argv[2], sys.argv[3]
hidden, layers, heads, kv, inter = (int(x) for x in sys.argv[4:9])
mlflow.set_tracking_uri(tracking)
exp = mlflow.set_experiment("llm-source")
model = language.llama(vocab_size=32000, hidden=hidden, layers=layers, heads=heads,
                       kv_heads=kv, intermediate=inter)
tok = language.tokenizer()
with mlflow.start_run():
    mlflow.transformers.log_model({"model": model, "tokenizer": tok}, name="model",
        task="text-generation", registered_model_name=name,
        pip_requirements=["transformers", "torch"])
ids = tok(language.zen_text())["input_ids"]
np.savez(out + "/tokens.npz", input_ids=np.array(ids[: 4 * 24]).reshape(4, 24))
print(json.dumps({"parameters": sum(p.numel() for p in model.parameters())}))
"""

_GENERATE = """
import sys, json, numpy as np, mlflow
tracking, uri, layers, kv, head = sys.argv[1], sys.argv[2], *(int(x) for x in sys.argv[3:6])
mlflow.set_tracking_uri(tracking)
served = mlflow.pyfunc.load_model(uri)
cache = {f"past_key_values.{i}.{k}": np.zeros((1, kv, 0, head), np.float32)
         for i in range(layers) for k in ("key", "value")}
ids, tokens = np.array([[5, 17, 42, 7]], dtype=np.int64), []
for _ in range(8):
    past = cache["past_key_values.0.key"].shape[2]
    out = served.predict({"input_ids": ids,
        "attention_mask": np.ones((1, past + ids.shape[1]), np.int64), **cache})
    tokens.append(int(np.asarray(out["logits"])[0, -1].argmax()))
    cache = {n: np.asarray(out[n.replace("past_key_values", "present")]) for n in cache}
    ids = np.array([[tokens[-1]]], dtype=np.int64)
print(json.dumps({"generated": tokens}))
"""


def render(results: dict[str, Any]) -> str:
    """The Markdown table of a run: wall time and peak RSS per stage."""
    weights = results["fp32_weight_bytes"]
    lines = [
        f"{results['model']}: fp32 weights {weights / 2**30:.2f} GiB",
        "",
        "| stage | wall s | peak RSS GiB | x fp32 weights | exit |",
        "|---|---:|---:|---:|---:|",
    ]
    for stage, step in results["stages"].items():
        rss = step["peak_rss_bytes"]
        lines.append(
            f"| {stage} | {step['seconds']} | {rss / 2**30:.2f} | {rss / weights:.2f} | {step['rc']} |"
        )
    if results.get("optimizers"):
        lines += [
            "",
            "The exported file optimized as a user runs each tool:",
            "",
            "| tool | wall s | peak RSS GiB | nodes | exit |",
            "|---|---:|---:|---:|---:|",
        ]
        for tool, step in results["optimizers"].items():
            lines.append(
                f"| {tool} | {step['seconds']} | {step['peak_rss_bytes'] / 2**30:.2f} "
                f"| {step.get('nodes', '-')} | {step['rc']} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = publish.parser(__doc__)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--variants", default="graph,int4-weight,int8-dynamic")
    ap.add_argument("--out", default=str(ROOT / "results-llm-pipeline"))
    publish.add_publish_argument(ap)
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tracking = f"sqlite:///{out / 'mlflow.db'}"
    name = f"llama-{args.hidden}x{args.layers}"
    env = {
        **os.environ,
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "HF_HUB_OFFLINE": "1",
        "MLFLOW_TRACKING_URI": tracking,
    }
    py = sys.executable
    results: dict[str, Any] = {"model": name, "stages": {}}
    if not (out / "tokens.npz").exists():
        step = _timed(
            [
                py,
                "-c",
                _SOURCE,
                str(out),
                tracking,
                name,
                str(args.hidden),
                str(args.layers),
                str(args.heads),
                str(args.kv_heads),
                str(args.intermediate),
            ],
            out / "source.log",
            env,
        )
        results["stages"]["log + register source"] = step
        if step["rc"] != 0:
            print(f"logging the source model failed; see {step['log']}")
            return 1
    head_dim = args.hidden // args.heads
    weights = 4 * (
        2 * 32000 * args.hidden
        + args.layers
        * (
            args.hidden * args.hidden * 2
            + 2 * args.hidden * args.kv_heads * head_dim
            + 3 * args.hidden * args.intermediate
        )
    )
    results["fp32_weight_bytes"] = weights
    policy = {
        "defaults": {
            # a 1 B model on 2 cores: fewer timed runs, a short prefill
            "latency": {
                "runs": 30,
                "warmup": 3,
                "blocks": 3,
                "decode_past": 64,
                "prefill_tokens": 16,
                "min_speedup": None,
            },
        },
        "promotion": {"metric": "p50_ms"},
        # random weights spread the next-token choice thin: 4-bit agreement is loose here
        # (see bench.llm), and the stage timings are what this bench is for
        "variants": {
            "int4-weight": {
                "accuracy": {
                    "min_cosine": 0.5,
                    "min_top1_agreement": 0.1,
                    "max_perplexity_ratio": 2.0,
                    "max_metric_drop": None,
                }
            }
        },
    }
    common = [
        "--tracking-uri",
        tracking,
        "--artifacts",
        str(out / "artifacts"),
        "--variants",
        args.variants,
        "--eval-data",
        str(out / "tokens.npz"),
        "--policy-json",
        json.dumps(policy),
        "--workdir",
        str(out / "work"),
        "--child-timeout",
        "5400",
    ]
    records = out / "records"
    records.mkdir(exist_ok=True)
    for stage in STAGES:
        cmd = [
            py,
            "-m",
            "graphtrim.cli",
            "pipeline",
            "stage",
            stage,
            *common,
            "--output",
            str(records / f"{stage}.json"),
        ]
        if stage == "export":
            cmd += ["--model", f"models:/{name}/1"]
        for need in NEEDS.get(stage, ()):
            cmd += ["--input", f"{need}={records / f'{need}.json'}"]
        print(f"stage {stage} ...", flush=True)
        step = _timed(cmd, out / f"{stage}.log", env)
        results["stages"][stage] = step
        print(
            f"  {step['seconds']} s, peak RSS {step['peak_rss_bytes'] / 2**30:.2f} GiB, rc {step['rc']}",
            flush=True,
        )
        if step["rc"] not in (0, 1):
            break
    # the exported file optimized by graphtrim, OnnxSlim and onnxsim as a user runs them
    exported = records / "export.json"
    if exported.exists():
        uri = json.loads(exported.read_text())["model"]["model_uri"]
        src = Path(uri.removeprefix("file://"))
        bin_dir = Path(py).parent
        tools = {
            "graphtrim optimize": [py, "-m", "graphtrim.cli", "optimize", str(src), "-o"],
            "onnxslim": [str(bin_dir / "onnxslim"), str(src)],
            "onnxsim": [str(bin_dir / "onnxsim"), str(src)],
        }
        results["optimizers"] = {}
        for tool, cmd in tools.items():
            dst = out / "optimizers" / tool.split()[0] / "model.onnx"
            dst.parent.mkdir(parents=True, exist_ok=True)
            extra = ["--save-as-external-data"] if tool == "onnxsim" else []
            print(f"{tool} ...", flush=True)
            step = _timed([*cmd, str(dst), *extra], out / f"{tool.split()[0]}.log", env)
            if step["rc"] == 0:
                import onnx

                step["nodes"] = len(onnx.load(str(dst), load_external_data=False).graph.node)
            results["optimizers"][tool] = step
            print(
                f"  {step['seconds']} s, peak RSS {step['peak_rss_bytes'] / 2**30:.2f} GiB, rc {step['rc']}",
                flush=True,
            )
    registered = {}
    if (records / "register.json").exists():
        registered = json.loads((records / "register.json").read_text()).get("registered", {})
        results["registered"] = registered
        results["failed"] = json.loads((records / "register.json").read_text()).get("failed", {})
    pick = next((v for v in ("int4-weight", "graph") if v in registered), None)
    if pick:
        step = _timed(
            [
                py,
                "-c",
                _GENERATE,
                tracking,
                f"models:/{name}/{registered[pick]['version']}",
                str(args.layers),
                str(args.kv_heads),
                str(head_dim),
            ],
            out / "generate.log",
            env,
        )
        results["stages"][f"pyfunc load + generate ({pick})"] = step
    publish.write(out / "pipeline.json", "llm-pipeline", results, args, publish=args.publish)
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
