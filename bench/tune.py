"""``python -m bench.tune`` (or ``make bench-tune``): the settings search against the fixed
recipes, on six models of different kinds, and the registry memory on a second version of each.

Per model (built offline with torch, random or briefly trained weights, fixed seeds):

1. **fixed**: ``graphtrim variants`` of the searched kinds, each with its fixed recipe (the
   sensitivity fallback included); the best is the fastest that passes every gate.
2. **tuned**: ``graphtrim tune`` with ``--budget`` (default 5 min) and a fresh memory file.
3. **head to head**: the fixed best and the champion judged again by ``graphtrim evaluate``,
   interleaved in one run against the reference: the ratio of their p50 speedups is the
   number quoted (both had to pass the same gates).
4. **memory**: a second version of the architecture (other seed: other weights, same graph
   signature) tuned with the first version's memory; its search time against the first's, and
   its champion's speedup against the first champion's (the same computation).

Results go to ``bench/results-tune/`` (``results.json``, ``results.md``, each search's reports).
Timings are of this machine, measured as ratios in the same run; absolute times are noisy.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench import publish

ROOT = Path(__file__).resolve().parent
log = logging.getLogger("bench.tune")

# gates both sides are held to: the built-in policy, with an output-agreement bar that a
# random-weight model can meet (its logits carry no task to measure a drop on)
POLICY: dict[str, Any] = {
    "defaults": {"accuracy": {"min_cosine": 0.99, "min_top1_agreement": None}},
}


# -- models ------------------------------------------------------------------------------------


def _export(module: Any, example: Any, path: Path, names: list[str]) -> None:
    import torch

    from bench.corpus.torch_export import quiet_fd1

    module.eval()
    with warnings.catch_warnings(), torch.no_grad(), quiet_fd1():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            (example,),
            str(path),
            dynamo=False,
            opset_version=17,
            input_names=names,
            output_names=["output"],
        )


def _images(shape: tuple[int, ...], n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *shape[1:])).astype(np.float32)


def _detector(seed: int) -> Any:
    """A YOLO-style detector: strided conv backbone with residual blocks, a head per cell
    (box, objectness, 8 classes, 3 anchors) decoded onto the grid (sigmoid, grid offsets,
    anchor scales) and concatenated."""
    import torch
    from torch import nn

    def cbs(cin: int, cout: int, stride: int = 1) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.SiLU()
        )

    class Res(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.a, self.b = cbs(c, c), cbs(c, c)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.b(self.a(x))

    class Detector(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Sequential(
                cbs(3, 16, 2), cbs(16, 32, 2), Res(32), cbs(32, 64, 2), Res(64), cbs(64, 96, 2)
            )
            self.anchors, self.classes = 3, 8
            self.head = nn.Conv2d(96, self.anchors * (5 + self.classes), 1)
            self.register_buffer("scale", torch.tensor([[10.0, 13.0], [16.0, 30.0], [33.0, 23.0]]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            f = self.head(self.backbone(x))
            b, _, h, w = f.shape
            f = f.view(b, self.anchors, 5 + self.classes, h, w).permute(0, 1, 3, 4, 2).sigmoid()
            gy, gx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            grid = torch.stack((gx, gy), -1).view(1, 1, h, w, 2).float()
            xy = (f[..., :2] * 2 - 0.5 + grid) * 16.0
            wh = (f[..., 2:4] * 2) ** 2 * self.scale.view(1, self.anchors, 1, 1, 2)
            out = torch.cat((xy, wh, f[..., 4:]), -1)
            return out.view(b, -1, 5 + self.classes)

    torch.manual_seed(seed)
    return Detector()


def _resnet(seed: int) -> Any:
    import torch

    from bench.suite import _resnet as resnet

    torch.manual_seed(seed)
    return resnet()[0]


def _mobilenet_v2(seed: int) -> Any:
    """MobileNetV2 at width 0.5: inverted residual blocks (1x1 expand, 3x3 depthwise, 1x1
    project, residual add where shapes allow), ReLU6, the paper's stage table."""
    import torch
    from torch import nn

    def cbr(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, act: bool = True) -> Any:
        layers: list[Any] = [
            nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
            nn.BatchNorm2d(cout),
        ]
        return nn.Sequential(*layers, *([nn.ReLU6()] if act else []))

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
            super().__init__()
            mid = cin * expand
            self.residual = stride == 1 and cin == cout
            self.body = nn.Sequential(
                *([cbr(cin, mid, 1)] if expand != 1 else []),
                cbr(mid, mid, 3, stride, groups=mid),
                cbr(mid, cout, 1, act=False),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.body(x)
            return x + y if self.residual else y

    class MobileNetV2(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            table = [
                (1, 8, 1, 1),
                (6, 12, 2, 2),
                (6, 16, 3, 2),
                (6, 32, 4, 2),
                (6, 48, 3, 1),
                (6, 80, 3, 2),
                (6, 160, 1, 1),
            ]
            layers: list[Any] = [cbr(3, 16, 3, 2)]
            cin = 16
            for t, c, n, stride in table:
                for i in range(n):
                    layers.append(Block(cin, c, stride if i == 0 else 1, t))
                    cin = c
            layers.append(cbr(cin, 640, 1))
            self.features = nn.Sequential(*layers)
            self.fc = nn.Linear(640, 100)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.features(x).mean(dim=(2, 3)))

    torch.manual_seed(seed)
    return MobileNetV2()


def _encoder(seed: int) -> Any:
    import torch
    from transformers import BertConfig, BertModel

    from bench.suite import _LastHidden

    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=4096,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        max_position_embeddings=128,
    )
    return _LastHidden(BertModel(cfg).eval())


def _kws(seed: int) -> Any:
    from graphtrim.examples.kws import kws_net, make_kws_data, train_kws

    x, y = make_kws_data(1024, seed=100 + seed)
    return train_kws(kws_net(seed), x, y, epochs=2, seed=seed)


class Model:
    """A bench model: how to build a version of it and its data."""

    def __init__(
        self,
        name: str,
        kind: str,
        build: Callable[[int, Path], None],
        data: Callable[[Path, Path], None],
        kinds: tuple[str, ...],
        calibrated: bool = True,
    ) -> None:
        self.name, self.kind, self.build, self.data = name, kind, build, data
        self.kinds, self.calibrated = kinds, calibrated

    def files(self, cache: Path, version: int) -> tuple[Path, Path, Path]:
        cache.mkdir(parents=True, exist_ok=True)
        model = cache / f"{self.name}-v{version}.onnx"
        calib, evald = cache / f"{self.name}.calibration.npz", cache / f"{self.name}.eval.npz"
        if not model.exists():
            log.info("%s: building version %d", self.name, version)
            self.build(version, model)
        if not evald.exists():
            self.data(calib, evald)
        return model, calib, evald


def _image_model(name: str, kind: str, make: Callable[[int], Any], shape: tuple[int, ...]) -> Model:
    def build(version: int, path: Path) -> None:
        import torch

        _export(make(version), torch.randn(*shape), path, ["input"])

    def data(calib: Path, evald: Path) -> None:
        np.savez(calib, input=_images(shape, 32, 1))
        np.savez(evald, input=_images(shape, 32, 2))

    return Model(name, kind, build, data, ("graph", "int8-dynamic", "int8-static"))


def _token_data(calib: Path, evald: Path, *, vocab: int, samples: int) -> None:
    """Random token ids, 64 per sample, for calibration and evaluation (one seed for both)."""
    rng = np.random.default_rng(0)
    for path in (calib, evald):
        np.savez(path, input_ids=rng.integers(0, vocab, (samples, 64), dtype=np.int64))


def _encoder_model() -> Model:
    def build(version: int, path: Path) -> None:
        import torch

        _export(_encoder(version), torch.randint(0, 4096, (1, 64)), path, ["input_ids"])

    return Model(
        "bert-256x4",
        "transformer encoder",
        build,
        lambda calib, evald: _token_data(calib, evald, vocab=4096, samples=16),
        ("graph", "int8-dynamic", "int8-static", "int8-weight"),
    )


def _kws_model() -> Model:
    def build(version: int, path: Path) -> None:
        import torch

        from graphtrim.examples.models import export

        # TorchScript's exporter takes no fused multi-head attention: dynamo's, batch 1
        export(_kws(version), torch.randn(1, 40, 49), path, dynamo=True, dynamic_batch=False)

    def data(calib: Path, evald: Path) -> None:
        from graphtrim.examples.kws import make_kws_data

        x, _ = make_kws_data(64, seed=7)
        np.savez(calib, input=x)
        x, y = make_kws_data(256, seed=8)
        np.savez(evald, input=x, labels=y)

    return Model(
        "kws-audio",
        "audio (keyword spotter, trained)",
        build,
        data,
        ("graph", "int8-dynamic", "int8-static"),
    )


def _decoder_model() -> Model:
    def build(version: int, path: Path) -> None:
        from graphtrim.examples.language import llama
        from graphtrim.exporter import export_causal_lm

        model = llama(
            vocab_size=2048,
            hidden=256,
            layers=4,
            heads=8,
            kv_heads=4,
            intermediate=688,
            seed=version,
        )
        export_causal_lm(model, path)

    return Model(
        "llama-256x4",
        "decoder LM with KV cache",
        build,
        lambda calib, evald: _token_data(calib, evald, vocab=2048, samples=8),
        ("graph", "int8-dynamic", "int4-weight", "int8-weight"),
        calibrated=False,
    )


MODELS: dict[str, Model] = {
    m.name: m
    for m in (
        _image_model("resnet", "CNN, residual adds", _resnet, (1, 3, 96, 96)),
        _image_model(
            "mobilenet-v2",
            "mobile CNN, depthwise, inverted residuals",
            _mobilenet_v2,
            (1, 3, 160, 160),
        ),
        _encoder_model(),
        _image_model("detector", "YOLO-style detector", _detector, (1, 3, 160, 160)),
        _kws_model(),
        _decoder_model(),
    )
}


# -- the runs ----------------------------------------------------------------------------------


def _speedup(variant: Any) -> float | None:
    lat = variant.gate("latency") if variant is not None else None
    value = lat.measured.get("speedup_p50") if lat else None
    return float(value) if isinstance(value, int | float) else None


def run_model(m: Model, cache: Path, out: Path, budget: float) -> dict[str, Any]:
    from graphtrim.data import input_specs, load_npz
    from graphtrim.gates import GatePolicy, evaluate
    from graphtrim.quantize import QuantizeConfig
    from graphtrim.stages.pipeline import build_and_evaluate
    from graphtrim.tune.memory import FileMemory
    from graphtrim.tune.search import TuneSettings, tune, write_result

    folder = out / m.name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    v1, calib_path, eval_path = m.files(cache, 0)
    v2, _, _ = m.files(cache, 1)
    specs = input_specs(v1)
    # batch 1, as served
    calib = load_npz(calib_path, specs, batch_size=1) if m.calibrated else None
    data = load_npz(eval_path, specs, batch_size=1)
    policy = GatePolicy(POLICY)
    say = lambda line: log.info("%s: %s", m.name, line)  # noqa: E731

    log.info("%s: fixed recipes %s", m.name, ",".join(m.kinds))
    t0 = time.perf_counter()
    fixed = build_and_evaluate(
        v1,
        folder / "fixed",
        [k for k in m.kinds if k != "int8-static" or m.calibrated],
        config=QuantizeConfig(tune_device="cpu"),
        calibration=calib_path if m.calibrated else None,
        eval_data=eval_path,
        policy=policy,
        batch_size=1,
    )
    fixed_s = time.perf_counter() - t0
    passed = [v for v in fixed.evaluation.variants if v.passed]
    best = max(passed, key=lambda v: _speedup(v) or 0.0, default=None)

    memory = FileMemory(folder / "memory.json")

    def search(model: Path, name: str) -> tuple[Any, float]:
        t0 = time.perf_counter()
        result = tune(
            model,
            folder / name,
            policy=policy,
            data=data,
            calibration=calib,
            kinds=m.kinds,
            settings=TuneSettings(budget_s=budget),
            memory=memory,
            progress=say,
        )
        seconds = time.perf_counter() - t0
        write_result(result, folder / name)
        return result, seconds

    log.info("%s: tuning version 1 (budget %.0f s)", m.name, budget)
    first, first_s = search(v1, "tuned-v1")

    head: dict[str, Any] = {}
    if best is not None and first.output is not None:
        log.info("%s: head to head, fixed %s against the champion", m.name, best.name)
        champion_kind = first.champion.candidate.kind if first.champion else best.name
        ev = evaluate(
            v1,
            {"fixed": fixed.outputs[best.name], "tuned": Path(first.output)},
            policy=GatePolicy(
                {**POLICY, "defaults": {**POLICY["defaults"], "latency": {"runs": 400}}}
            ),
            data=data,
            kinds={"fixed": best.name, "tuned": champion_kind},
        )
        sf, st = _speedup(ev.variant("fixed")), _speedup(ev.variant("tuned"))
        head = {
            "fixed_speedup": sf,
            "tuned_speedup": st,
            "tuned_over_fixed": st / sf if sf and st else None,
            "fixed_passed": ev.variant("fixed").passed,
            "tuned_passed": ev.variant("tuned").passed,
        }

    log.info("%s: tuning version 2 from the memory", m.name)
    second, second_s = search(v2, "tuned-v2")

    # the two versions' champions in one timing run: the same graph with other weights times
    # as its first version does, so both are timed against version 1's reference, interleaved
    same_run: dict[str, Any] = {}
    if first.output is not None and second.output is not None:
        log.info("%s: the two versions' champions in one timing run", m.name)
        kind = lambda r: r.champion.candidate.kind  # noqa: E731
        ev = evaluate(
            v1,
            {"v1": Path(first.output), "v2": Path(second.output)},
            policy=GatePolicy(
                {**POLICY, "defaults": {**POLICY["defaults"], "latency": {"runs": 400}}}
            ),
            data=data,
            kinds={"v1": kind(first), "v2": kind(second)},
        )
        s1, s2 = _speedup(ev.variant("v1")), _speedup(ev.variant("v2"))
        same_run = {
            "v1_speedup": s1,
            "v2_speedup": s2,
            "v2_over_v1": s2 / s1 if s1 and s2 else None,
        }

    def champion(r: Any) -> dict[str, Any] | None:
        c = r.champion
        return (
            None
            if c is None
            else {"key": c.candidate.key, "speedup": c.speedup, "size": c.size_ratio}
        )

    return {
        "model": m.name,
        "kind": m.kind,
        "kinds": list(m.kinds),
        "fixed": {
            "seconds": fixed_s,
            "best": best.name if best else None,
            "best_speedup": _speedup(best),
            "passed": [v.name for v in passed],
            "speedups": {v.name: _speedup(v) for v in fixed.evaluation.variants},
        },
        "tuned": {
            "seconds": first_s,
            "trials": len(first.trials),
            "stopped": first.stopped,
            "champion": champion(first),
            "against_recipe": first.against_recipe(),
        },
        "head_to_head": head,
        "memory": {
            "seconds": second_s,
            "time_ratio": second_s / first_s if first_s else None,
            "trials": len(second.trials),
            "mode": second.mode,
            "champion": champion(second),
            "same_run": same_run,
        },
    }


def olive_compare(
    m: Model, cache: Path, out: Path, *, max_samples: int, timeout: float
) -> dict[str, Any] | None:
    """Olive 0.13 on the same file: ``olive auto-opt`` and a JSON workflow whose search covers
    its quantization space (``bench.olive``), each a fresh process; then their outputs and the
    champion of this bench's search (``out/<model>/tuned-v1``) judged in one run against the
    reference, under the same gates."""
    from bench import olive
    from graphtrim.data import input_specs, load_npz
    from graphtrim.gates import GatePolicy, evaluate

    folder = out / m.name
    tuned = json.loads((folder / "tuned-v1" / "tune.json").read_text())
    if not tuned.get("output"):
        log.info("%s: no champion to compare with Olive", m.name)
        return None
    v1, calib_path, eval_path = m.files(cache, 0)
    shutil.rmtree(folder / "olive", ignore_errors=True)
    log.info("%s: olive auto-opt", m.name)
    auto = olive.run_auto_opt(v1, folder / "olive" / "auto-opt", timeout=timeout)
    log.info("%s: olive workflow search (%d samples at most)", m.name, max_samples)
    search = olive.run_workflow(
        v1,
        folder / "olive" / "workflow",
        calibration=calib_path if m.calibrated else None,
        data=calib_path,
        max_samples=max_samples,
        timeout=timeout,
    )
    outputs = {"graphtrim": Path(tuned["output"])}
    for name, run in (("olive-auto-opt", auto), ("olive-search", search)):
        if run.get("ok") and run.get("output"):
            outputs[name] = Path(run["output"])
    specs = input_specs(v1)
    data = load_npz(eval_path, specs, batch_size=1)
    kinds = {"graphtrim": tuned["champion"]["kind"]}
    # graphtrim's search again, its budget Olive's search's wall time
    timed: dict[str, Any] = {}
    if search.get("seconds"):
        from graphtrim.tune.search import TuneSettings, tune

        calib = load_npz(calib_path, specs, batch_size=1) if m.calibrated else None
        log.info("%s: graphtrim tune within Olive's %.0f s", m.name, search["seconds"])
        t0 = time.perf_counter()
        short = tune(
            v1,
            folder / "tuned-olive-time",
            policy=GatePolicy(POLICY),
            data=data,
            calibration=calib,
            kinds=m.kinds,
            settings=TuneSettings(budget_s=float(search["seconds"])),
        )
        timed = {
            "seconds": time.perf_counter() - t0,
            "stopped": short.stopped,
            "champion": short.champion.candidate.key if short.champion else None,
        }
        if short.output and short.champion:
            outputs["graphtrim-olive-time"] = Path(short.output)
            kinds["graphtrim-olive-time"] = short.champion.candidate.kind
    # the same gates for all: Olive's outputs are held to int8-static's, which int8-dynamic's
    # equal (size 0.35x, the accuracy defaults)
    kinds.update({n: "int8-static" for n in outputs if n not in kinds})
    ev = evaluate(
        v1,
        outputs,
        policy=GatePolicy({**POLICY, "defaults": {**POLICY["defaults"], "latency": {"runs": 400}}}),
        data=data,
        kinds=kinds,
    )
    judged = {
        v.name: {
            "passed": v.passed,
            "speedup": _speedup(v),
            "size_ratio": (v.gate("size").measured.get("ratio") if v.gate("size") else None),
            "failed": [f"{g.gate}: {'; '.join(g.reasons)}" for g in v.gates if not g.passed],
        }
        for v in ev.variants
    }
    return {
        "model": m.name,
        "graphtrim_tune_s": tuned["seconds"],
        "graphtrim_champion": tuned["champion"]["key"],
        "olive_auto_opt_s": auto.get("seconds"),
        "olive_auto_opt_error": auto.get("error"),
        "olive_search_s": search.get("seconds"),
        "olive_search_error": search.get("error"),
        "olive_search_samples": search.get("samples"),
        "olive_search_passes": search.get("passes"),
        "graphtrim_in_olive_time": timed,
        "judged": judged,
    }


def render_olive(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | graphtrim search s | its champion | graphtrim within Olive's time: s | its "
        "champion | Olive auto-opt s | its output | Olive search s | its output | graphtrim "
        "(Olive's time) / best Olive that passed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(j: dict[str, Any] | None) -> str:
        if not j:
            return "failed"
        mark = "" if j["passed"] else " (fails gates)"
        return f"{_f(j['speedup'], '.2f')}x{mark}"

    for r in rows:
        j = r["judged"]
        best = max(
            (v["speedup"] or 0 for k, v in j.items() if k.startswith("olive") and v["passed"]),
            default=None,
        )
        short = j.get("graphtrim-olive-time") or {}
        ours = short.get("speedup") if short.get("passed") else None
        ratio = ours / best if ours and best else None
        lines.append(
            f"| {r['model']} | {r['graphtrim_tune_s']:.0f} | {cell(j.get('graphtrim'))} "
            f"| {_f((r.get('graphtrim_in_olive_time') or {}).get('seconds'), '.0f')} "
            f"| {cell(j.get('graphtrim-olive-time'))} "
            f"| {_f(r['olive_auto_opt_s'], '.0f')} | {cell(j.get('olive-auto-opt'))} "
            f"| {_f(r['olive_search_s'], '.0f')} | {cell(j.get('olive-search'))} "
            f"| {_f(ratio, '.2f') if best else 'no Olive output passed'} |"
        )
    return "\n".join(lines) + "\n"


def budget_check(m: Model, cache: Path, out: Path, budgets: list[float]) -> list[dict[str, Any]]:
    """Searches with budgets too short to converge: how far past its budget each ended, against
    its longest trial (a build plus its screening) and the finalists' judgement."""
    from graphtrim.data import input_specs, load_npz
    from graphtrim.gates import GatePolicy
    from graphtrim.tune.search import TuneSettings, tune

    v1, calib_path, eval_path = m.files(cache, 0)
    specs = input_specs(v1)
    calib = load_npz(calib_path, specs, batch_size=1) if m.calibrated else None
    data = load_npz(eval_path, specs, batch_size=1)
    rows = []
    for budget in budgets:
        log.info("%s: a search with a budget of %.0f s", m.name, budget)
        t0 = time.perf_counter()
        result = tune(
            v1,
            out / f"budget-{m.name}-{budget:.0f}",
            policy=GatePolicy(POLICY),
            data=data,
            calibration=calib,
            kinds=m.kinds,
            settings=TuneSettings(budget_s=budget),
        )
        wall = time.perf_counter() - t0
        rows.append(
            {
                "model": m.name,
                "budget_s": budget,
                "wall_s": wall,
                "over_s": wall - budget,
                "longest_build_s": max((t.build_s for t in result.trials), default=0.0),
                "trials": len(result.trials),
                "stopped": result.stopped,
                "champion": result.champion.candidate.key if result.champion else None,
            }
        )
    return rows


def _f(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def render(results: list[dict[str, Any]]) -> str:
    lines = [
        "| model | fixed best | fixed speedup | champion | tuned speedup | tuned / fixed "
        "(same run) | fixed s | tune s | trials | stopped | v2 tune s | v2 / v1 time | "
        "v2 champion speedup | v2 / v1 champion (same run) |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in results:
        h, t, mem = r["head_to_head"], r["tuned"], r["memory"]
        c, c2 = t["champion"] or {}, mem["champion"] or {}
        lines.append(
            f"| {r['model']} | {r['fixed']['best'] or 'none passed'} | {_f(h.get('fixed_speedup'), '.2f')}x "
            f"| `{c.get('key', 'none')}` | {_f(h.get('tuned_speedup'), '.2f')}x "
            f"| **{_f(h.get('tuned_over_fixed'), '.3f')}** | {r['fixed']['seconds']:.0f} "
            f"| {t['seconds']:.0f} | {t['trials']} | {t['stopped']} | {mem['seconds']:.0f} "
            f"| {_f(mem['time_ratio'], '.2f')} | {_f(c2.get('speedup'), '.2f')}x "
            f"| {_f((mem.get('same_run') or {}).get('v2_over_v1'), '.3f')} |"
        )
    return "\n".join(lines) + "\n"


def render_budget(checks: list[dict[str, Any]]) -> str:
    """The table of the budget checks (``--budget-check``); empty without them."""
    if not checks:
        return ""
    lines = [
        "",
        "| model | budget s | wall s | past the budget s | longest build s | trials | stopped |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    lines += [
        f"| {c['model']} | {c['budget_s']:.0f} | {c['wall_s']:.1f} | {c['over_s']:+.1f} "
        f"| {c['longest_build_s']:.1f} | {c['trials']} | {c['stopped']} |"
        for c in checks
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.tune",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--budget", type=float, default=300.0, help="seconds per search")
    ap.add_argument(
        "--budget-check",
        type=float,
        nargs="*",
        default=[20.0, 45.0],
        help="budgets (s) of the searches that check how far past its budget a search ends "
        "(on MobileNetV2, whose full search takes about 2 min here; none: skipped)",
    )
    ap.add_argument(
        "--olive",
        action="store_true",
        help="only the comparison with Olive 0.13 (installed into bench/.olive), on the "
        "champions of an earlier run in --out",
    )
    ap.add_argument("--olive-samples", type=int, default=16, help="Olive search's samples at most")
    ap.add_argument("--olive-timeout", type=float, default=900.0)
    ap.add_argument("--cache", type=Path, default=ROOT / "models" / "tune")
    ap.add_argument("--out", type=Path, default=ROOT / "results-tune")
    publish.add_publish_argument(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="bench: %(message)s")
    for noisy in ("torch", "torch.onnx", "onnxruntime", "graphtrim"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.olive:
        rows = []
        for name in args.models:
            if not MODELS[name].calibrated:
                # the Olive runner feeds the .npz's arrays as the model's inputs: a KV-cache
                # decoder's token data holds input_ids alone
                continue
            row = olive_compare(
                MODELS[name],
                args.cache,
                args.out,
                max_samples=args.olive_samples,
                timeout=args.olive_timeout,
            )
            if row is not None:
                rows.append(row)
            publish.write(args.out / "olive.json", "olive", rows, args)
            (args.out / "olive.md").write_text(render_olive(rows))
        if args.publish:
            publish.write(args.out / "olive.json", "olive", rows, args, publish=True)
        print(render_olive(rows))
        return 0
    results = []
    for name in args.models:
        results.append(run_model(MODELS[name], args.cache, args.out, args.budget))
        publish.write(args.out / "results.json", "tune", {"models": results}, args)
        (args.out / "results.md").write_text(render(results))
    checks: list[dict[str, Any]] = []
    if args.budget_check:
        checks = budget_check(MODELS["mobilenet-v2"], args.cache, args.out, args.budget_check)
        (args.out / "results.md").write_text(render(results) + render_budget(checks))
    publish.write(
        args.out / "results.json",
        "tune",
        {"models": results, "budget": checks},
        args,
        publish=args.publish,
    )
    print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
