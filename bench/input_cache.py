"""What a settings search's trial tasks save with the per-worker input cache.

Every trial task of a search reads the same inputs: the reference model, the optimized model
and the data. Without the cache each task fetches them from the artifact store again; with it
(:class:`graphtrim.integrations.input_cache.InputCache`) the first task of a worker fetches them and
the others link them. This bench stores a model of ``--gb`` GB (MatMul layers of 4096 x 4096
float32 weights in external data, 64 MiB each) in S3 (a moto server on 127.0.0.1: an S3 endpoint
on the same machine, so a real bucket over a network takes longer, not shorter; transfers are
whole objects, since moto copies the whole object for each ranged part) and times the
inputs' fetch of ``--trials`` trial tasks both ways. Reported: each task's seconds, and the sum.

    python -m bench.input_cache [--gb 1] [--trials 6] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

N = 4096  # a layer's weight: N x N float32, 64 MiB


def _model(folder: Path, gb: float) -> Path:
    import numpy as np
    import onnx
    import onnx.helper as oh
    import onnx.numpy_helper as onh

    folder.mkdir(parents=True, exist_ok=True)
    layers = max(1, round(gb * 1024 / 64))
    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], "x"
    for i in range(layers):
        w = (rng.standard_normal((N, N), dtype=np.float32) / N).astype(np.float32)
        inits.append(onh.from_array(w, f"w{i}"))
        nodes.append(oh.make_node("MatMul", [prev, f"w{i}"], [f"h{i}"]))
        prev = f"h{i}"
    graph = oh.make_graph(
        nodes,
        "chain",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, N])],
        [oh.make_tensor_value_info(prev, onnx.TensorProto.FLOAT, [1, N])],
        inits,
    )
    path = folder / "model.onnx"
    onnx.save(
        oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]),
        str(path),
        save_as_external_data=True,
        location="model.onnx.data",
    )
    return path


def run(gb: float, trials: int, root: Path) -> dict[str, Any]:
    import boto3

    from graphtrim.integrations.artifacts import S3Store
    from graphtrim.integrations.input_cache import InputCache
    from tests.servers import fake_aws_credentials, moto_server

    with fake_aws_credentials(), moto_server(root / "s3") as endpoint:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench-inputs")
        src = _model(root / "src", gb)
        size = sum(p.stat().st_size for p in src.parent.iterdir())
        # whole-object transfers: moto copies the whole object for each ranged GET of a part
        store = S3Store("bench-inputs", "p", endpoint_url=endpoint, multipart_threshold=64 << 30)
        stored = store.put_model(src, model="m", version="1", stage="optimized")
        shutil.rmtree(src.parent)

        def task(i: int, cache: InputCache | None) -> float:
            dest = root / f"task{i}"
            started = time.perf_counter()
            if cache is None:
                store.fetch_model(stored.uri, dest)
            else:
                cache.model(stored.uri, stored.sha256, dest, store.fetch_model)
            took = time.perf_counter() - started
            shutil.rmtree(dest)  # a task's scratch folder goes when it ends
            return took

        plain = [task(i, None) for i in range(trials)]
        cache = InputCache(root / "cache")
        cached = [task(i, cache) for i in range(trials)]
    return {
        "model_bytes": size,
        "trials": trials,
        "without_cache_s": [round(t, 3) for t in plain],
        "with_cache_s": [round(t, 3) for t in cached],
        "saved_s": round(sum(plain) - sum(cached), 3),
        "load_average": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.input_cache", description=__doc__)
    parser.add_argument("--gb", type=float, default=1.0, help="the model's size in GB")
    parser.add_argument("--trials", type=int, default=6, help="trial tasks on one worker")
    parser.add_argument("--json", help="write the numbers here too")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="graphtrim-bench-inputs-"))
    try:
        doc = run(args.gb, args.trials, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"model: {doc['model_bytes'] / 2**30:.2f} GiB in S3 (moto on 127.0.0.1)")
    print(f"{'task':>4}  {'without cache s':>15}  {'with cache s':>12}")
    for i, (a, b) in enumerate(zip(doc["without_cache_s"], doc["with_cache_s"], strict=True)):
        print(f"{i:>4}  {a:>15.2f}  {b:>12.2f}")
    total_a, total_b = sum(doc["without_cache_s"]), sum(doc["with_cache_s"])
    print(f"{'sum':>4}  {total_a:>15.2f}  {total_b:>12.2f}  saved {doc['saved_s']:.1f} s")
    print(f"load average (1 min): {doc['load_average']:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
