"""Build one variant of a model: ``graph``, ``int8-dynamic``, ``int8-static`` or ``fp16``.

Every variant starts from graphtrim's optimized model (verified against the source). int8 and
fp16 conversions run on it, then graphtrim's exact passes clean up after them, verified against
the converted model. Every built variant is compared with the float model it came from (on the
calibration feeds, else on seeded random inputs): the build record's ``agreement`` holds the
numbers, or says why they could not be measured. With an accuracy check, a failing int8/fp16
variant is rebuilt with the nodes that add the most error kept in float, up to
``max_attempts`` builds; every attempt is recorded. The output appears at its path only when
complete, built in a staging folder beside it (:func:`graphtrim.modelio.staging_dir`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import onnx

from graphtrim.data import Feeds
from graphtrim.errors import (
    GraphtrimError,
    InvalidModelError,
    PassFailure,
    VerificationError,
)
from graphtrim.quantize.agreement import measure_agreement

# the names callers have imported from here
from graphtrim.quantize.config import CALIBRATION_METHODS as CALIBRATION_METHODS
from graphtrim.quantize.config import QuantizeConfig as QuantizeConfig
from graphtrim.quantize.convert import Conversion, ProgressFn
from graphtrim.quantize.convert import say as _say
from graphtrim.quantize.errors import NothingToQuantize as NothingToQuantize
from graphtrim.quantize.errors import QuantizeError as QuantizeError
from graphtrim.quantize.fp16 import fp16_overflow_nodes
from graphtrim.quantize.kinds import VARIANTS as VARIANTS
from graphtrim.quantize.kinds import kind
from graphtrim.quantize.order import sorted_output
from graphtrim.quantize.records import RUNTIME_DEFECTS, Attempt, VariantBuild
from graphtrim.quantize.sensitivity import fallback_nodes, node_errors

logger = logging.getLogger("graphtrim.quantize")

# returns (passed, measured numbers) for a candidate model file
AccuracyCheck = Callable[[Path], tuple[bool, dict[str, Any]]]


def _name_nodes(path: Path) -> None:
    """Give every node a unique name: exclusion lists and sensitivity reports refer to them."""
    model = onnx.load(str(path), load_external_data=False)
    seen: set[str] = set()
    changed = False
    for i, node in enumerate(model.graph.node):
        if not node.name or node.name in seen:
            base = f"{node.op_type}_{i}"
            name = base
            k = 0
            while name in seen:
                k += 1
                name = f"{base}_{k}"
            node.name = name
            changed = True
        seen.add(node.name)
    if changed:
        # external data references stay valid: the file keeps its name and folder
        onnx.save(model, str(path))


class _DropPreprocessAdvice(logging.Filter):
    """onnxruntime's quantizer advises ``quant_pre_process`` on the root logger; graphtrim's
    optimizer has already done that pre-processing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "pre-processing before quantization" not in record.getMessage()


def build_variant(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    variant: str,
    *,
    config: QuantizeConfig | None = None,
    calibration: Iterable[Feeds] | None = None,
    accuracy_check: AccuracyCheck | None = None,
    progress: ProgressFn | None = None,
    probe: bool = True,
    probe_timeout: float = 600.0,
) -> VariantBuild:
    """Build ``variant`` of the model at ``src`` into ``dst``.

    Args:
        calibration: feeds for static quantization (required for ``int8-static``), the fp16
            range check and the sensitivity measurement.
        accuracy_check: judges a candidate file; when it fails, the most sensitive nodes are
            kept in float and the variant rebuilt (``config.max_attempts`` builds at most). The
            last attempt's file is written either way; ``accuracy_passed`` says how it went.
        probe: before anything else loads a candidate, open it in a child process as it will
            be served (onnxruntime's default optimization level on ``config.tune_device``,
            else the CPU) and run it once; a candidate that crashes or hangs the runtime is
            never written (:class:`QuantizeError` names the signal and the step).
    """
    from graphtrim.data import input_specs
    from graphtrim.modelio import publish_model, staging_dir
    from graphtrim.optimize_file import optimize_file

    cfg = config or QuantizeConfig()
    cfg.validate()
    if variant not in VARIANTS:
        raise QuantizeError(f"unknown variant '{variant}': use one of {', '.join(VARIANTS)}")
    spec = kind(variant)
    from graphtrim.modelio import read_proto, refuse_overwrite

    source, target = Path(src), Path(dst)
    proto = read_proto(source)  # an unusable input is an InvalidModelError, as ever
    try:
        refuse_overwrite(source, target, proto)  # the model file, or a data file it reads
    except InvalidModelError as exc:
        raise QuantizeError(f"refusing to overwrite the input model: {exc}") from exc
    del proto
    input_specs(source)  # a model onnxruntime cannot load is refused before any work
    feeds = list(calibration) if calibration is not None else []
    if spec.needs_calibration and not feeds:
        raise QuantizeError(f"{variant} needs calibration data (an .npz file or feeds)")
    t0 = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    stage = staging_dir(target)  # what a killed build left beside the target goes first
    # the temporary files libraries make for themselves (onnxruntime's quantize_static writes
    # ``ort.quant.*``, the augmented model and calibration tensors, as large as the model) go
    # into the staging folder, which a killed build's successor removes; one setting per process
    system_temp = tempfile.tempdir
    tempfile.tempdir = str(stage)
    try:
        _say(progress, f"{variant}: optimizing the graph ({cfg.preset})")
        pre_dir = stage / "pre"
        pre_dir.mkdir()
        pre = pre_dir / target.name
        # the residual form is left to the tuning below: the converters see the plain Add
        opt = optimize_file(source, pre, preset=cfg.preset, skip=_TUNED_REWRITES, check=True)

        def finish(
            built: Path, attempts: list[Attempt], cleanup: dict[str, Any] | None
        ) -> VariantBuild:
            tuning = None
            if cfg.tune_device is not None:
                _say(progress, f"{variant}: timing runtime-specific rewrites on {cfg.tune_device}")
                # fp16 inputs (``keep_io_types=False``) cannot take the float32 calibration feeds
                fp16_io = spec.float16 and not cfg.keep_io_types
                tuning = _tune(built, cfg.tune_device, [] if fp16_io else feeds)
            _say(progress, f"{variant}: comparing with the float model")
            agreement = measure_agreement(source, built, feeds)
            _say(progress, f"{variant}: agreement with the float model: {agreement.summary()}")
            publish_model(built, target)
            return VariantBuild(
                variant,
                str(source),
                str(target),
                time.perf_counter() - t0,
                cfg,
                attempts,
                opt.to_json(),
                cleanup,
                tuning,
                agreement=agreement,
            )

        _name_nodes(pre)
        # fp16 inputs (``keep_io_types=False``) cannot take the float32 calibration feeds
        fp16_io = spec.float16 and not cfg.keep_io_types
        probe_feeds = feeds[0] if feeds and not fp16_io else None

        def probed(candidate: Path, what: str) -> None:
            if probe:
                _say(progress, f"{variant}: loading {what} as it will be served (child process)")
                _probe(candidate, variant, cfg.tune_device or "cpu", probe_feeds, probe_timeout)

        if spec.converter is None:
            probed(pre, "the optimized model")
            only = Attempt(1, [], None, {})
            if accuracy_check is not None:
                only.accuracy_passed, only.measured = accuracy_check(pre)
            return finish(pre, [only], None)

        excluded = list(cfg.nodes_to_exclude)
        if spec.float16:
            overflow = fp16_overflow_nodes(pre, feeds[:8], workdir=stage)
            if overflow:
                _say(
                    progress,
                    f"{variant}: {len(overflow)} node(s) exceed the fp16 range: kept in fp32",
                )
            excluded = sorted(set(excluded) | set(overflow))
        attempts: list[Attempt] = []
        defects: list[dict[str, Any]] = []
        final: Path | None = None
        cleanup: dict[str, Any] | None = None
        conversion: dict[str, Any] | None = None
        stopped: str | None = None
        build_cfg = cfg  # an avoided runtime defect keeps more ops in float from then on
        for number in range(1, cfg.max_attempts + 1):
            work = stage / f"attempt{number}"
            work.mkdir()

            def convert(
                work: Path, bcfg: QuantizeConfig, excluded: list[str]
            ) -> tuple[Path, dict[str, Any]]:
                nonlocal conversion
                raw = work / "raw.onnx"
                advice = _DropPreprocessAdvice()
                # onnxruntime calls logging.warning(): the root logger's filter sees the record
                logging.getLogger().addFilter(advice)
                try:
                    # onnxruntime's calibrators print their progress: it goes to stderr, with
                    # the rest of the progress, and stdout keeps the command's results
                    with contextlib.redirect_stdout(sys.stderr):
                        conversion = spec.convert()(
                            Conversion(pre, raw, bcfg, excluded, feeds, progress)
                        )
                except GraphtrimError:
                    raise
                except Exception as exc:
                    raise QuantizeError(
                        f"{variant} conversion failed: {type(exc).__name__}: {exc}"
                    ) from exc
                finally:
                    logging.getLogger().removeFilter(advice)
                try:
                    raw = sorted_output(raw)
                except Exception as exc:  # the converter wrote something onnx cannot parse
                    raise QuantizeError(
                        f"{variant}: the converted model is unusable: {exc}"
                    ) from exc
                clean = work / target.name
                _say(progress, f"{variant}: cleaning up after the conversion")
                try:
                    cleaned = optimize_file(
                        raw, clean, preset="safe", skip=_TUNED_REWRITES, check=True
                    )
                except (VerificationError, PassFailure):
                    raise  # a pass changed results or crashed: graphtrim's fault, said as such
                except GraphtrimError as exc:
                    # the converter wrote a model that cannot be read or loaded: this variant
                    # cannot be built (the others of a ``variants`` run go on)
                    raise QuantizeError(
                        f"{variant}: the converted model is unusable: {exc}"
                    ) from exc
                return clean, cleaned.to_json()

            _say(progress, f"{variant}: attempt {number}, {len(excluded)} node(s) kept in float")
            try:
                clean, cleanup = convert(work, build_cfg, excluded)
            except NothingToQuantize as exc:
                if final is None:
                    raise
                # the fallback kept every weight in float: the last attempt's file stands
                stopped = f"{exc}: attempt {number - 1}'s variant is kept, failing its check"
                _say(progress, f"{variant}: {stopped}")
                break
            try:
                probed(clean, f"attempt {number}")
            except QuantizeError as crash:
                avoided = None
                for known in RUNTIME_DEFECTS.get(variant, ()):
                    if set(known.keep_float) <= set(build_cfg.fp16_keep_float):
                        continue
                    _say(progress, f"{variant}: {crash}; building it {known.form}")
                    trial_cfg = dataclasses.replace(
                        build_cfg,
                        fp16_keep_float=sorted({*build_cfg.fp16_keep_float, *known.keep_float}),
                    )
                    trial = work / known.name
                    trial.mkdir()
                    clean_t, cleanup_t = convert(trial, trial_cfg, excluded)
                    try:
                        probed(clean_t, f"attempt {number} {known.form}")
                    except QuantizeError:
                        continue
                    build_cfg, clean, cleanup, avoided = trial_cfg, clean_t, cleanup_t, known
                    break
                if avoided is None:
                    raise
                defects.append({**avoided.to_json(), "seen": str(crash)})
            final = clean
            if accuracy_check is None:
                attempts.append(Attempt(number, list(excluded), None, {}))
                break
            passed, measured = accuracy_check(clean)
            attempt = Attempt(number, list(excluded), passed, measured)
            attempts.append(attempt)
            if passed or number == cfg.max_attempts:
                break
            sens_feeds = feeds[:8]
            if not sens_feeds:
                from graphtrim.data import input_specs, random_data

                sens_feeds = random_data(input_specs(pre), batches=4).batches
            _say(progress, f"{variant}: accuracy check failed; measuring per-node error")
            ranked = [
                e for e in node_errors(pre, clean, sens_feeds) if not set(e.nodes) <= set(excluded)
            ]
            attempt.most_sensitive = ranked[:10]
            picked = fallback_nodes(ranked, spec.converts, cfg.fallback_fraction, number)
            if not picked:
                break
            excluded = sorted(set(excluded) | set(picked))
        assert final is not None
        built = finish(final, attempts, cleanup)
        built.runtime_defects = defects
        built.conversion = conversion
        built.config = build_cfg  # what was built: with the ops an avoided defect kept in float
        built.stopped = stopped
        return built
    finally:
        tempfile.tempdir = system_temp
        shutil.rmtree(stage, ignore_errors=True)


def _probe(
    path: Path, variant: str, device: str, feeds: Feeds | None, timeout: float
) -> dict[str, Any]:
    """:func:`graphtrim.runtime.load_probe` in a child process; a crash or a hang there is
    a :class:`QuantizeError` saying what happened."""
    from graphtrim.isolation import ChildFailed, call_isolated
    from graphtrim.runtime import DeviceUnavailableError

    try:
        result: dict[str, Any] = call_isolated(
            "graphtrim.runtime:load_probe",
            str(path),
            common={"device": device, "feeds": feeds},
            timeout=timeout,
            what=f"{variant} candidate",
        )
    except ChildFailed as exc:
        raise QuantizeError(f"the {variant} model cannot be served: {exc}") from exc
    except DeviceUnavailableError:
        raise
    except InvalidModelError as exc:  # onnxruntime refused the candidate: this variant failed
        raise QuantizeError(f"the {variant} model cannot be served: {exc}") from exc
    return result


# runtime-specific forms a variant gets only where ``tune_device`` times them faster (``_tune``)
_TUNED_REWRITES = ("residual-sum",)


def _tune(built: Path, device: str, feeds: Sequence[Feeds]) -> dict[str, Any]:
    """Keep ``residual-sum`` in the built model where it is measurably faster on ``device``
    (timed on the first calibration batch, or random inputs without calibration data)."""
    from graphtrim.ort_target import tune_residual_sum
    from graphtrim.runtime import providers_for

    provider = providers_for(device)[0]
    try:
        return tune_residual_sum(built, provider, feeds=feeds[0] if feeds else None)
    except VerificationError:
        raise  # a rewrite that changed results: never a model to publish
    except Exception as exc:  # the timing itself failed: the variant stays as built
        logger.warning("tuning for %s skipped: %s", device, exc)
        return {
            "rewrite": "residual-sum",
            "kept": "original",
            "why": f"could not be timed: {type(exc).__name__}: {exc}",
        }
