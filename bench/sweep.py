"""``python -m bench.sweep`` (or ``make sweep``): graphtrim's default settings on every corpus model
(``python -m bench.corpus``), beside onnxsim, OnnxSlim, onnxoptimizer, onnxruntime's basic
offline optimizer and onnxscript's optimizer, in the same run.

Per model:

- ``graphtrim optimize`` as a user runs it (a fresh process, the example's dims passed with
  ``--dim``), its output then compared with the input in onnxruntime by the verifier
  ``--verify`` uses; a crash is any exit but 0;
- the anchors in one long-lived worker (imports paid once), each output checked for parity with
  the input in onnxruntime; nodes (subgraphs included) and bytes of every output;
- optimize wall time as the user sees it: that ``graphtrim optimize`` run and ``onnxslim``'s own
  command, each a fresh process, interleaved, repeated when graphtrim's is the slower;
- latency of graphtrim's output against the input under onnxruntime ORT_ENABLE_ALL on CPU (one
  thread, interleaved runs, p50), measured again, longer, where the ratio is above 1.03.

Results are kept per model under ``--out`` (a model already swept against the same input file and
the same graphtrim source is not swept again; the anchors' results for the same input file under
the same anchor versions are reused unless ``--fresh-anchors``) and rendered as per-family tables.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import publish
from bench.__main__ import count_nodes, model_bytes, parity
from bench.corpus import DEFAULT_DIR, Manifest
from bench.sweep_measure import measure_latency, self_instability
from bench.sweep_models import FolderModels, dim_values
from bench.sweep_render import ANCHORS, best_anchor, render
from bench.sweep_tools import (
    _SCRATCH,
    AnchorWorker,
    _dim_args,
    _wall,
    anchor_versions,
    run_anchors,
)

ROOT = Path(__file__).resolve().parent
REPO = ROOT.parent
BIN = Path(sys.executable).parent
log = logging.getLogger("bench.sweep")


def source_digest() -> str:
    """A digest of graphtrim's optimizer source: results of another version are swept again."""
    import hashlib

    h = hashlib.sha256()
    for path in sorted((REPO / "optimizer_core").rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _digest_file(path: Path) -> str | None:
    """sha256 of a file (``None`` when it is not there)."""
    import hashlib

    if not path.exists():
        return None
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sweep_model(
    entry: dict[str, Any],
    src: Path,
    work: Path,
    worker: AnchorWorker,
    args: argparse.Namespace,
    kept_anchors: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One model's results; ``kept_anchors`` (the anchors' results of an earlier sweep of the
    same input under the same anchor versions) are reused instead of run again."""
    dims = entry.get("dims") or dim_values(src, entry.get("shapes"))
    res: dict[str, Any] = {
        "key": entry["key"],
        "family": entry["family"],
        "exporter": entry["exporter"],
        "opset": entry.get("opset"),
        "sha256": entry["sha256"],
        "original_nodes": count_nodes(src),
        "original_bytes": model_bytes(src),
        "dims": dims,
    }
    # 1. graphtrim and onnxslim as a user runs them: fresh processes, interleaved, repeated when
    # graphtrim's is the slower; graphtrim's output is then verified as --verify does
    dst = work / f"{entry['key']}.graphtrim.onnx"
    before = _digest_file(dst)  # the output an earlier sweep kept (its latency is for it)
    scratch = work / f"{entry['key']}.onnxslim-cli.onnx"
    gt_cmd = [str(BIN / "graphtrim"), "optimize", str(src), "-o", str(dst), "-q", *_dim_args(dims)]
    slim_cmd = [str(BIN / "onnxslim"), str(src), str(scratch)]
    walls: dict[str, list[float]] = {"graphtrim": [], "onnxslim": []}
    gt: dict[str, Any] = {}
    for _ in range(args.wall_repeat):
        dst.unlink(missing_ok=True)
        seconds, proc = _wall(gt_cmd, args.timeout)
        if proc is None:
            gt = {"exit": None, "error": f"timeout after {args.timeout} s"}
            break
        gt = {"exit": proc.returncode}
        if proc.returncode != 0:
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            gt["error"] = (lines[-1] if lines else f"exit {proc.returncode}")[:400]
            break
        walls["graphtrim"].append(seconds)
        scratch.unlink(missing_ok=True)
        t, p = _wall(slim_cmd, args.timeout)
        if p is not None and p.returncode == 0:
            walls["onnxslim"].append(t)
        if walls["onnxslim"] and statistics.median(walls["graphtrim"]) <= statistics.median(
            walls["onnxslim"]
        ):
            break  # no need to repeat a clear result
    scratch.unlink(missing_ok=True)
    res["wall"] = {k: statistics.median(v) for k, v in walls.items() if v}
    if gt.get("exit") == 0 and dst.exists():
        gt.update(nodes=count_nodes(dst), bytes=model_bytes(dst), ok=True)
        gt.update(parity(src, dst, dims))
        if gt.get("parity_error") and "reference model" in gt["parity_error"]:
            gt["cannot_run"] = True  # --verify exits 2 here: the input itself does not run
        elif not gt.get("parity_ok"):
            # does rounding alone (onnxruntime's own fusions) move this model's outputs as far?
            gt["input_unstable_abs"] = self_instability(src, dims)
    res["graphtrim"] = gt
    if gt.get("ok"):
        gt["output_sha256"] = _digest_file(dst)
        res["output_unchanged"] = before is not None and before == gt["output_sha256"]
    # 2. the anchors (they do not depend on graphtrim's source: kept results are reused)
    res["anchors"] = (
        kept_anchors
        if kept_anchors is not None
        else run_anchors(src, work, worker, dims, args, entry["key"])
    )
    # 4. latency under ORT_ENABLE_ALL
    if not args.no_latency and gt.get("ok"):
        measure_latency(res, src, dst, dims, args)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = publish.parser(__doc__, "python -m bench.sweep")
    ap.add_argument(
        "--corpus", type=Path, default=DEFAULT_DIR, help="corpus directory (its manifest.json)"
    )
    ap.add_argument(
        "--models",
        type=Path,
        help="sweep every .onnx file under this folder instead of the corpus (your own models)",
    )
    ap.add_argument(
        "--dim",
        action="append",
        default=[],
        metavar="NAME=SIZE",
        help="with --models: size of a symbolic input dim (repeatable; default 2)",
    )
    ap.add_argument(
        "--out", type=Path, default=ROOT / "results-sweep", help="per-model results and the tables"
    )
    ap.add_argument("--families", nargs="*")
    ap.add_argument("--match", help="only models whose key matches this regular expression")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per tool and model")
    ap.add_argument(
        "--wall-repeat",
        type=int,
        default=3,
        help="fresh-process timings per tool when graphtrim's first is the slower",
    )
    ap.add_argument(
        "--latency-seconds",
        type=float,
        default=1.5,
        help="seconds of interleaved runs per latency measurement (4x on re-measure)",
    )
    ap.add_argument("--no-latency", action="store_true")
    ap.add_argument("--force", action="store_true", help="sweep again models already swept")
    ap.add_argument(
        "--fresh-anchors",
        action="store_true",
        help="run the anchors again even where an earlier sweep of the same input under the "
        "same anchor versions kept their results",
    )
    ap.add_argument("--keep", action="store_true", help="keep the anchors' outputs too")
    ap.add_argument(
        "--latency-only",
        action="store_true",
        help="measure the latency of swept models that have none yet (graphtrim's kept output "
        "against the input), on a machine otherwise idle",
    )
    ap.add_argument(
        "--render",
        action="store_true",
        help="only render the tables from the results kept under --out (no corpus needed)",
    )
    ap.add_argument(
        "--name",
        default="sweep",
        help="the name the results are published under (docs/benchmarks/data/NAME.json): "
        "'sweep' for the corpus, another for a set of its own (its page section names it)",
    )
    publish.add_publish_argument(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="sweep: %(message)s")
    # the tools run in a scratch directory: every path handed to them is absolute
    args.corpus, args.out = args.corpus.resolve(), args.out.resolve()
    if args.render:
        return _render_kept(args)

    if args.models is not None:
        dims = {}
        for item in args.dim:
            name, _, size = item.partition("=")
            if not size.isdigit():
                ap.error(f"--dim expects NAME=SIZE, got {item!r}")
            dims[name] = int(size)
        manifest: Manifest | FolderModels = FolderModels(args.models.resolve(), dims)
    else:
        manifest = Manifest(args.corpus)
    per_model = args.out / "models"
    per_model.mkdir(parents=True, exist_ok=True)
    work = args.out / "work"
    work.mkdir(exist_ok=True)
    digest = source_digest()
    versions = anchor_versions()
    entries = sorted(
        (
            e
            for e in manifest.ok()
            if (not args.families or e["family"] in args.families)
            and (not args.match or re.search(args.match, e["key"]))
        ),
        key=lambda e: (e["family"], e["key"]),
    )
    worker = AnchorWorker()
    results = []
    try:
        for i, entry in enumerate(entries, 1):
            cached = per_model / f"{entry['key']}.json"
            if args.latency_only:
                if cached.exists():
                    old = json.loads(cached.read_text())
                    kept = work / f"{entry['key']}.graphtrim.onnx"
                    if (
                        "latency_ratio" not in old
                        and old["graphtrim"].get("ok")
                        and not kept.exists()
                    ):
                        src = manifest.model_path(entry)
                        cmd = [str(BIN / "graphtrim"), "optimize", str(src), "-o", str(kept), "-q"]
                        _wall([*cmd, *_dim_args(old["dims"])], args.timeout)
                    if "latency_ratio" not in old and old["graphtrim"].get("ok") and kept.exists():
                        measure_latency(old, manifest.model_path(entry), kept, old["dims"], args)
                        cached.write_text(json.dumps(old, indent=1))
                        log.info(
                            "[%d/%d] %s: latency %s",
                            i,
                            len(entries),
                            entry["key"],
                            old.get("latency_ratio"),
                        )
                    results.append(old)
                continue
            kept_anchors = None
            if cached.exists():
                old = json.loads(cached.read_text())
                if args.render or (
                    not args.force
                    and old.get("sha256") == entry["sha256"]
                    and old.get("graphtrim_source") == digest
                ):
                    results.append(old)
                    continue
                if (
                    not args.fresh_anchors
                    and old.get("sha256") == entry["sha256"]
                    and old.get("anchor_versions") == versions
                    and set(old.get("anchors", {})) == set(ANCHORS)
                ):
                    kept_anchors = old["anchors"]
            if args.render:
                continue
            t0 = time.monotonic()
            res = sweep_model(entry, manifest.model_path(entry), work, worker, args, kept_anchors)
            res["graphtrim_source"] = digest
            res["anchor_versions"] = versions
            if (
                res.get("output_unchanged")
                and cached.exists()
                and "latency_ratio" not in res
                and old.get("sha256") == entry["sha256"]
            ):
                # graphtrim wrote the very file the kept latency was measured on
                for k in ("latency_ratio", "latency_ratios", "p50_ms"):
                    if k in old:
                        res[k] = old[k]
            tmp = cached.with_suffix(".tmp")
            tmp.write_text(json.dumps(res, indent=1))
            os.replace(tmp, cached)
            results.append(res)
            g = res["graphtrim"]
            best, names, _ = best_anchor(res)
            log.info(
                "[%d/%d] %s: graphtrim %s (exit %s), best anchor %s %s, latency %s, wall %s (%.0f s)",
                i,
                len(entries),
                entry["key"],
                g.get("nodes"),
                g.get("exit"),
                "/".join(names),
                best,
                f"{res['latency_ratio']:.3f}" if "latency_ratio" in res else "-",
                {k: round(v, 2) for k, v in res["wall"].items()},
                time.monotonic() - t0,
            )
    finally:
        worker.close()
        if _SCRATCH is not None:
            shutil.rmtree(_SCRATCH, ignore_errors=True)
    text = render(results)
    (args.out / "sweep.md").write_text(text + "\n")
    publish.write(args.out / "sweep.json", args.name, results, args, publish=args.publish)
    print(text)
    return 0


def _render_kept(args: argparse.Namespace) -> int:
    """The tables from the per-model results under ``--out`` (``--families`` and ``--match``
    select), with the source digests they were measured at: the rendering's own date and
    commit are not the measurement's."""
    results = [
        json.loads(p.read_text())
        for p in sorted((args.out / "models").glob("*.json"))
        if p.suffix == ".json"
    ]
    results = [
        r
        for r in results
        if (not args.families or r["family"] in args.families)
        and (not args.match or re.search(args.match, r["key"]))
    ]
    if not results:
        raise SystemExit(f"no kept results under {args.out / 'models'}")
    results.sort(key=lambda r: (r["family"], r["key"]))
    args.measured_with = sorted({str(r.get("graphtrim_source")) for r in results})
    text = render(results)
    (args.out / "sweep.md").write_text(text + "\n")
    publish.write(args.out / "sweep.json", args.name, results, args, publish=args.publish)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
