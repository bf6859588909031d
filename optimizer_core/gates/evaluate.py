"""Run every gate on every variant against the reference model and record the verdicts.

A gate passes, fails, is undecided (a latency measurement too noisy to decide) or errors (its
measurement failed). Only ``pass`` lets a variant through: the gates fail closed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from graphtrim.data import EvalData, input_specs, random_data
from graphtrim.gates import accuracy as acc
from graphtrim.gates import latency as lat
from graphtrim.gates.fingerprint import fingerprint
from graphtrim.gates.policy import GatePolicy, LatencyThresholds
from graphtrim.gates.verdicts import Evaluation, GateResult, ModelInfo, VariantResult
from graphtrim.runtime import open_session, providers_for

ProgressFn = Callable[[str], None]
_BASELINE = "\x00reference"
# the most bytes of models (on disk) whose sessions :func:`evaluate` holds open at once; a
# session of a float model costs about its weights' size (onnxruntime prepacks them)
MAX_OPEN_BYTES = 1 << 30


def _error(gate: str, exc: BaseException, thresholds: dict[str, Any]) -> GateResult:
    return GateResult(
        gate, "error", {}, thresholds, [f"measurement failed: {type(exc).__name__}: {exc}"]
    )


def evaluate(
    reference: str | os.PathLike[str],
    variants: Mapping[str, str | os.PathLike[str]],
    *,
    policy: GatePolicy | None = None,
    data: EvalData | None = None,
    device: str = "cpu",
    tensorrt: bool = False,
    threads: int | None = None,
    builds: Mapping[str, dict[str, Any]] | None = None,
    progress: ProgressFn | None = None,
    kinds: Mapping[str, str] | None = None,
    max_open_bytes: int | None = MAX_OPEN_BYTES,
) -> Evaluation:
    """Judge each variant (``name -> model path``; the name selects its policy entry, or
    ``kinds[name]`` where given: two builds of one kind under their own names) against
    ``reference`` on ``device``. Raises only for problems shared by all variants (the device is
    missing, the reference cannot run); a variant's own failure is a failed gate.

    ``max_open_bytes``: when the reference and the variants hold more than this on disk, one
    session is open at a time (None: never). The reference's outputs (and a language model's greedy
    continuations) are taken first and its session let go; each variant's accuracy is measured
    against them in its own session; the latency runs alternate block by block, each model's
    session opened afresh for its turn (:func:`graphtrim.gates.latency.measure_alternating`).
    The peak memory is then the largest model's session, not the sum of them."""
    say = progress or (lambda _line: None)
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    policy = policy or GatePolicy()
    builds = builds or {}
    kinds = kinds or {}

    def entry(name: str) -> Any:
        return policy.for_variant(kinds.get(name, name))

    providers = providers_for(device, tensorrt=tensorrt)
    defaults = policy.for_variant("__defaults__")
    lat_settings = defaults.latency or LatencyThresholds()
    n_threads = threads if threads is not None else lat_settings.threads
    specs = input_specs(reference)
    from graphtrim.gates.language import is_decoder

    decoder = is_decoder(specs)
    if data is None:
        data = random_data(specs, batches=8)
    ref_info = ModelInfo.of(reference)

    def opener(path: str | os.PathLike[str]) -> Callable[[], Any]:
        return lambda: open_session(path, device=device, threads=n_threads, providers=providers)

    one_at_a_time = (
        max_open_bytes is not None
        and ref_info.bytes
        + sum(ModelInfo.file_bytes(p) for p in variants.values() if Path(p).exists())
        > max_open_bytes
    )
    ref_sess = opener(reference)()
    ref_outputs: dict[str | None, tuple[str, Any]] = {}
    ref_greedy: dict[str | None, list[list[int]]] = {}
    ref_failed: dict[str | None, Exception] = {}

    def reference_results(key: str | None) -> None:
        """The reference's judged output (and greedy continuations) for output ``key``; what
        kept it from them is raised again for every variant that asks."""
        if key in ref_failed:
            raise ref_failed[key]
        if key in ref_outputs:
            return
        try:
            outputs = acc.run_outputs(ref_sess, data, key)
            if decoder and data.tokens is not None:
                from graphtrim.gates.language import greedy_continuations

                ref_greedy[key] = greedy_continuations(ref_sess, data.tokens)
        except Exception as exc:
            ref_failed[key] = exc
            raise
        ref_outputs[key] = outputs

    if one_at_a_time:
        say("one session at a time: the reference's outputs first, then each variant's")
        for name in variants:
            t = entry(name).accuracy
            if t is not None:
                # a failure is each asking variant's failed accuracy gate, as with the
                # sessions open together
                with contextlib.suppress(Exception):
                    reference_results(t.output)
        ref_sess = None  # let go before any variant's session opens

    results: list[VariantResult] = []
    # the reference's session under a key no variant name can take; with one session at a
    # time, the models the latency gate opens afresh
    sessions: dict[str, Any] = {_BASELINE: ref_sess}
    opens: dict[str, Callable[[], Any]] = {_BASELINE: opener(reference)}
    for name, path in variants.items():
        vp = entry(name)
        gates: list[GateResult] = []
        try:
            info = ModelInfo.of(path)
        except Exception as exc:
            gates.append(_error("load", exc, {}))
            results.append(VariantResult(name, None, gates, builds.get(name)))
            continue
        if vp.size is not None:
            t = dataclasses.asdict(vp.size)
            ratio = info.bytes / ref_info.bytes if ref_info.bytes else float("inf")
            reasons = []
            if vp.size.max_ratio is not None and not ratio <= vp.size.max_ratio:
                reasons.append(f"size ratio {ratio:.3f} > {vp.size.max_ratio:g}")
            if vp.size.max_bytes is not None and not info.bytes <= vp.size.max_bytes:
                reasons.append(f"{info.bytes} bytes > {vp.size.max_bytes}")
            gates.append(
                GateResult(
                    "size",
                    "fail" if reasons else "pass",
                    {"bytes": info.bytes, "reference_bytes": ref_info.bytes, "ratio": ratio},
                    t,
                    reasons,
                )
            )
        try:
            opens[name] = opener(path)
            sess = opens[name]()
            sessions[name] = None if one_at_a_time else sess
        except Exception as exc:
            gates.append(_error("accuracy", exc, {}))
            results.append(VariantResult(name, info, gates, builds.get(name)))
            continue
        if vp.accuracy is not None:
            t = dataclasses.asdict(vp.accuracy)
            say(f"{name}: accuracy on {data.samples} sample(s)")
            try:
                key = vp.accuracy.output
                reference_results(key)
                m = acc.measure(
                    None,
                    sess,
                    data,
                    output=key,
                    metric=vp.accuracy.metric,
                    reference_outputs=ref_outputs[key],
                    language=decoder,
                    reference_greedy=ref_greedy.get(key),
                )
                broken = acc.judge(m, vp.accuracy)
                gates.append(
                    GateResult("accuracy", "fail" if broken else "pass", m.to_json(), t, broken)
                )
            except Exception as exc:
                gates.append(_error("accuracy", exc, t))
        del sess  # with one session at a time, the variant's goes here
        results.append(VariantResult(name, info, gates, builds.get(name)))

    timed = [r.name for r in results if r.name in sessions and entry(r.name).latency]
    samples: dict[str, list[float]] = {}
    if timed:
        models = [_BASELINE, *timed]
        # the judged workload; a language model's is a decode step after a cache, and a
        # prefill is timed beside it
        phases = {"run": lat.Phase(next(iter(data)), lat_settings.runs, lat_settings.warmup)}
        prefill: dict[str, Any] | None = None
        try:
            if decoder:
                from graphtrim.gates import language

                phases = {
                    "prefill": lat.Phase(
                        language.prefill_feeds(specs, data.tokens, lat_settings.prefill_tokens),
                        max(lat_settings.blocks, lat_settings.runs // 4),
                        min(lat_settings.warmup, 5),
                    ),
                    "run": lat.Phase(
                        language.step_feeds(specs, data.tokens, lat_settings.decode_past),
                        lat_settings.runs,
                        lat_settings.warmup,
                    ),
                }
            if one_at_a_time:
                say(
                    f"latency: {len(models)} models take turns in {lat_settings.blocks} blocks, "
                    "one session open at a time"
                )
                runs = lat.measure_alternating(
                    {n: opens[n] for n in models},
                    phases,
                    baseline=_BASELINE,
                    blocks=lat_settings.blocks,
                    progress=lambda line: say(line.replace(_BASELINE, "reference")),
                )
            else:
                runs = {}
                for key, phase in phases.items():
                    say(
                        f"latency: {'a prefill' if key == 'prefill' else 'the judged run'}: "
                        f"{phase.runs} interleaved runs after {phase.warmup} warm-up"
                    )
                    runs[key] = lat.measure_latency(
                        {n: sessions[n] for n in models},
                        phase.feeds,
                        baseline=_BASELINE,
                        runs=phase.runs,
                        warmup=phase.warmup,
                        blocks=lat_settings.blocks,
                        progress=say,
                    )
            run = runs["run"]
            if "prefill" in runs:
                pre = runs["prefill"]
                prefill = {
                    n: {
                        "tokens": lat_settings.prefill_tokens,
                        "p50_ms": pre.stats[n].to_json().get("p50_ms"),
                        "speedup_p50": pre.speedup(n),
                    }
                    for n in timed
                }
            label = "reference" if "reference" not in variants else "reference (baseline)"
            samples = {(label if n == _BASELINE else n): s.samples_ms for n, s in run.stats.items()}
            for r in results:
                if r.name not in timed:
                    continue
                lt = entry(r.name).latency
                assert lt is not None
                status, reasons = lat.judge(run, r.name, lt)
                measured = {
                    **run.stats[r.name].to_json(),
                    "baseline": run.stats[_BASELINE].to_json(),
                    "speedup_p50": run.speedup(r.name),
                    "block_speedups": run.block_speedups(r.name),
                    "spread": run.spread(r.name),
                    "settings": {**run.settings, "threads": n_threads},
                }
                if prefill is not None:
                    p50 = run.stats[r.name].to_json().get("p50_ms")
                    measured["decode"] = {
                        "past": lat_settings.decode_past,
                        "tokens_per_s": 1000.0 / p50 if p50 else None,
                    }
                    measured["prefill"] = prefill[r.name]
                r.gates.append(
                    GateResult("latency", status, measured, dataclasses.asdict(lt), reasons)
                )
        except Exception as exc:
            for r in results:
                if r.name in timed:
                    lt = entry(r.name).latency
                    r.gates.append(_error("latency", exc, dataclasses.asdict(lt) if lt else {}))
    return Evaluation(
        ref_info,
        device,
        results,
        fingerprint(providers=providers, threads=n_threads, data_digest=data.digest, device=device),
        policy.to_json(),
        policy.digest(),
        data.source,
        samples,
        started,
        time.perf_counter() - t0,
    )


def evaluate_job(variants: Mapping[str, str], **job: Any) -> Evaluation:
    """:func:`evaluate` as a child process runs it (:mod:`graphtrim.isolation`), from
    plain values: ``reference``, ``policy`` (the parsed :class:`GatePolicy`, a policy document,
    or None for the built-in policy), ``data``, ``device``, ``tensorrt``, and optionally
    ``max_open_bytes``."""
    from graphtrim.isolation import step

    policy = job["policy"]
    if not isinstance(policy, GatePolicy):
        policy = GatePolicy(policy, source="pipeline policy") if policy else GatePolicy()
    step(f"measuring {', '.join(variants)} against the reference")
    return evaluate(
        job["reference"],
        dict(variants),
        policy=policy,
        data=job["data"],
        device=job["device"],
        tensorrt=job["tensorrt"],
        progress=lambda line: step(f"gates: {line}"),
        max_open_bytes=job.get("max_open_bytes", MAX_OPEN_BYTES),
    )
