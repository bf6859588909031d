"""How closely a built variant agrees with the float model it came from.

Every variant build measures it, whatever else it is asked to do: on the calibration feeds when
there are any, else on seeded random inputs (which show agreement, not task accuracy). Both
models run in onnxruntime with its graph optimizations off, so the numbers describe the models
as written. For every output: max absolute error, max relative error (max |a-b| over max |a|),
cosine similarity of the flattened outputs and, for ``[batch, classes]`` outputs, top-1
agreement; the summary holds the worst of each over the outputs.

When agreement cannot be measured (an input type random inputs cannot fill, a model that fails
on the inputs) the result says so and why: ``measured`` is False and ``reason`` holds one line.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from graphtrim.data import Feeds

# calibration batches used at most; seeded random input sets without calibration data
MAX_BATCHES = 8
RANDOM_TRIALS = 3


@dataclasses.dataclass
class Agreement:
    """The variant's agreement with the float model (``measured`` False: not measurable)."""

    measured: bool
    inputs: str
    feeds: int = 0
    outputs: dict[str, dict[str, float | None]] = dataclasses.field(default_factory=dict)
    reason: str = ""

    @property
    def min_cosine(self) -> float | None:
        values = [o["cosine"] for o in self.outputs.values() if o["cosine"] is not None]
        return min(values) if values else None

    @property
    def max_abs_error(self) -> float | None:
        values = [o["max_abs_error"] for o in self.outputs.values()]
        return max((v for v in values if v is not None), default=None)

    @property
    def max_rel_error(self) -> float | None:
        values = [o["max_rel_error"] for o in self.outputs.values()]
        return max((v for v in values if v is not None), default=None)

    @property
    def min_top1_agreement(self) -> float | None:
        values = [o["top1_agreement"] for o in self.outputs.values()]
        return min((v for v in values if v is not None), default=None)

    def summary(self) -> str:
        if not self.measured:
            return f"not measured ({self.reason})"
        parts = [
            f"cosine {_fmt(self.min_cosine, '.6f')}",
            f"max abs error {_fmt(self.max_abs_error, '.4g')}",
            f"max rel error {_fmt(self.max_rel_error, '.4g')}",
        ]
        if self.min_top1_agreement is not None:
            parts.append(f"top-1 agreement {self.min_top1_agreement:.4f}")
        return f"{', '.join(parts)} on {self.inputs}"

    def to_json(self) -> dict[str, Any]:
        return {
            "measured": self.measured,
            "inputs": self.inputs,
            "feeds": self.feeds,
            "cosine": self.min_cosine,
            "max_abs_error": self.max_abs_error,
            "max_rel_error": self.max_rel_error,
            "top1_agreement": self.min_top1_agreement,
            "outputs": self.outputs,
            "reason": self.reason or None,
        }


def _fmt(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def _first_line(exc: BaseException) -> str:
    from graphtrim.errors import first_line

    return first_line(exc)[:300]


def _session(path: str | os.PathLike[str]) -> Any:
    from graphtrim.runtime import create_session, session_options

    return create_session(path, session_options(1, optimize=False), ["CPUExecutionProvider"])


_FLOAT_FEEDS = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def _fit(feeds: Mapping[str, np.ndarray], session: Any) -> dict[str, np.ndarray]:
    """``feeds`` in the float types ``session`` takes: an fp16 variant built with fp16 inputs
    reads the float32 feeds of the float model as float16."""
    out = dict(feeds)
    for i in session.get_inputs():
        want = _FLOAT_FEEDS.get(str(i.type))
        if want is not None and i.name in out and out[i.name].dtype != want:
            out[i.name] = out[i.name].astype(want)
    return out


@dataclasses.dataclass
class _Sums:
    """Running sums of one output over the batches (no output is kept whole)."""

    max_abs: float = 0.0
    scale: float = 0.0  # max |reference|
    dot: float = 0.0
    ref_sq: float = 0.0
    cand_sq: float = 0.0
    rows: int = 0
    same_top1: int = 0
    classes: bool = True  # every batch was [batch, classes]

    def add(self, reference: np.ndarray, candidate: np.ndarray) -> None:
        a = np.asarray(reference).astype(np.float64)
        b = np.asarray(candidate).astype(np.float64)
        if a.shape != b.shape:
            raise ValueError(f"shape {list(b.shape)} against the float model's {list(a.shape)}")
        self.classes = self.classes and a.ndim == 2 and a.shape[-1] > 1
        if not a.size:
            return
        diff = np.abs(a - b)
        self.max_abs = max(
            self.max_abs, float("inf") if np.isnan(diff).any() else float(diff.max())
        )
        self.scale = max(self.scale, float(np.max(np.abs(a))))
        self.dot += float(np.dot(a.ravel(), b.ravel()))
        self.ref_sq += float(np.dot(a.ravel(), a.ravel()))
        self.cand_sq += float(np.dot(b.ravel(), b.ravel()))
        if self.classes:
            self.rows += a.shape[0]
            self.same_top1 += int(np.sum(a.argmax(axis=-1) == b.argmax(axis=-1)))

    def result(self) -> dict[str, float | None]:
        m = self.max_abs
        max_rel = m / self.scale if self.scale > 0 else (0.0 if m == 0 else float("inf"))
        cosine: float | None = None
        if self.ref_sq > 0 and self.cand_sq > 0:
            cosine = self.dot / float(np.sqrt(self.ref_sq) * np.sqrt(self.cand_sq))
        elif self.ref_sq == self.cand_sq == 0:
            cosine = 1.0  # both all zero
        if cosine is not None and not np.isfinite(cosine):
            cosine = None
        top1 = self.same_top1 / self.rows if self.classes and self.rows else None
        return {
            "max_abs_error": m,
            "max_rel_error": max_rel,
            "cosine": cosine,
            "top1_agreement": top1,
        }


def measure_agreement(
    reference: str | os.PathLike[str],
    candidate: str | os.PathLike[str],
    calibration: Sequence[Feeds] = (),
    *,
    seed: int = 0,
) -> Agreement:
    """Run ``reference`` (the float model) and ``candidate`` (a variant of it) on the same
    inputs and compare every output. Never raises for a model that cannot be measured: the
    result then says why."""
    from graphtrim.verify.inputs import make_inputs

    batches = list(calibration)[:MAX_BATCHES]
    inputs = (
        f"calibration data ({len(batches)} batch(es))"
        if batches
        else f"seeded random inputs ({RANDOM_TRIALS} sets, seed {seed})"
    )

    def failed(reason: str) -> Agreement:
        return Agreement(False, inputs, len(batches), reason=reason)

    # the float model first, its session let go before the variant's opens: a large model's
    # weights are never in memory twice (at most MAX_BATCHES batches of outputs are kept)
    try:
        ref = _session(reference)
    except Exception as exc:
        return failed(_first_line(exc))
    if not batches:
        specs = [(i.name, i.type, list(i.shape)) for i in ref.get_inputs()]
        try:
            batches = [make_inputs(specs, seed=seed + i) for i in range(RANDOM_TRIALS)]
        except ValueError as exc:  # an input type random inputs cannot fill
            return failed(f"{_first_line(exc)} (give calibration data to measure it)")
    names = [o.name for o in ref.get_outputs()]
    expected: list[list[Any]] = []
    for feeds in batches:
        try:
            expected.append(ref.run(names, dict(feeds)))
        except Exception as exc:
            return failed(f"the float model fails on these inputs: {_first_line(exc)}")
    del ref
    try:
        cand = _session(candidate)
    except Exception as exc:
        return failed(_first_line(exc))
    if [o.name for o in cand.get_outputs()] != names:
        return failed(
            f"the variant's outputs {[o.name for o in cand.get_outputs()]} are not the float "
            f"model's {names}"
        )
    sums = {n: _Sums() for n in names}
    numeric = set(names)
    for feeds, want in zip(batches, expected, strict=True):
        try:
            got = cand.run(names, _fit(feeds, cand))
        except Exception as exc:
            return failed(f"the variant fails on these inputs: {_first_line(exc)}")
        for name, e, g in zip(names, want, got, strict=True):
            if (
                not isinstance(e, np.ndarray)
                or not isinstance(g, np.ndarray)
                or e.dtype.kind not in "fciub"
                or g.dtype.kind not in "fciub"
            ):
                numeric.discard(name)  # strings, sequences and maps have no distance
                continue
            try:
                sums[name].add(e, g)
            except ValueError as exc:
                return failed(f"output '{name}': {_first_line(exc)}")
    outputs = {n: sums[n].result() for n in names if n in numeric}
    if not outputs:
        return failed("the model has no numeric output to compare")
    return Agreement(True, inputs, len(batches), outputs)
