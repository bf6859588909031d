"""Evaluation and calibration data: ``.npz`` files or seeded random inputs.

An ``.npz`` file holds one array per model input, named like the input, whose first axis runs
over samples; an optional array of labels (key ``labels`` unless told otherwise) has one entry
per sample. Samples are fed in batches: of the model's batch size when its first dim is fixed
(the samples that do not fill a last batch are left out), else of ``batch_size`` with a smaller
last batch for the remainder. Without a file, seeded random inputs of the right types stand in
(they check agreement with the reference model, not a task metric).

:func:`~graphtrim.data_check.check_data` checks a file against the model's inputs before any
heavy work, reading only the arrays the model needs; :func:`load_npz` runs the same checks. The model's inputs come from
the ONNX model (:func:`input_specs`) or, before export, from an MLflow signature
(:func:`specs_from_signature`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from graphtrim.data_check import (
    _NP_TYPES,
    DataError,
    InputSpec,
    _check,
    _token_specs,
)
from graphtrim.data_check import (
    check_data as check_data,  # graphtrim.data.check_data, as before it moved
)
from graphtrim.npz import READ_ERRORS

Feeds = dict[str, np.ndarray]


@dataclasses.dataclass
class EvalData:
    """Batches of feeds, optional labels per batch, and a hash identifying the data."""

    batches: list[Feeds]
    labels: list[np.ndarray] | None
    digest: str
    source: str
    # a KV-cache decoder's evaluation text: the token ids [samples, sequence] the batches
    # feed (as prefills); None for other data
    tokens: np.ndarray | None = None

    @property
    def samples(self) -> int:
        return sum(len(next(iter(b.values()))) for b in self.batches if b)

    def __iter__(self) -> Iterator[Feeds]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)

    def all_labels(self) -> np.ndarray | None:
        return None if self.labels is None else np.concatenate(self.labels)


def _hash_arrays(arrays: Mapping[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for key in sorted(arrays):
        arr = np.ascontiguousarray(arrays[key])
        h.update(key.encode())
        h.update(str(arr.dtype).encode())
        h.update(str(arr.shape).encode())
        h.update(arr.tobytes())
    return h.hexdigest()


# numpy dtype names of MLflow tensor signatures -> onnxruntime type strings
_SIGNATURE_TYPES = {
    "float32": "tensor(float)",
    "float64": "tensor(double)",
    "float16": "tensor(float16)",
    "int64": "tensor(int64)",
    "int32": "tensor(int32)",
    "int16": "tensor(int16)",
    "int8": "tensor(int8)",
    "uint64": "tensor(uint64)",
    "uint32": "tensor(uint32)",
    "uint16": "tensor(uint16)",
    "uint8": "tensor(uint8)",
    "bool": "tensor(bool)",
}


def specs_from_signature(mlmodel: Mapping[str, Any]) -> list[InputSpec] | None:
    """The model's inputs from an MLflow ``MLmodel`` document (the parsed YAML), in the form
    :func:`input_specs` gives; None without a tensor signature (none at all, or columns).

    ``-1`` dims are symbolic (None). An unnamed input is called ``input_<i>``, the name the
    export stage gives it in the ONNX model."""
    sig = mlmodel.get("signature")
    raw = sig.get("inputs") if isinstance(sig, Mapping) else None
    if not raw:
        return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return None
    if not isinstance(raw, list) or not raw:
        return None
    specs: list[InputSpec] = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, Mapping) or entry.get("type") != "tensor":
            return None
        tensor = entry.get("tensor-spec")
        if not isinstance(tensor, Mapping):
            return None
        dtype = str(tensor.get("dtype", ""))
        shape = [
            d if isinstance(d, int) and not isinstance(d, bool) and d >= 0 else None
            for d in tensor.get("shape") or []
        ]
        name = entry.get("name") or f"input_{i}"
        specs.append((str(name), _SIGNATURE_TYPES.get(dtype, f"tensor({dtype})"), shape))
    return specs


def load_npz(
    path: str | os.PathLike[str],
    specs: Sequence[InputSpec],
    *,
    batch_size: int = 32,
    label_key: str = "labels",
    max_samples: int | None = None,
) -> EvalData:
    """Read ``path`` and cut it into batches that fit the model's inputs ``specs``.

    The file passes the checks of :func:`check_data` first. With a fixed batch dim the samples
    that do not fill a last batch are left out; with a dynamic one they form a smaller last
    batch."""
    if batch_size < 1:
        raise DataError(f"{path}: batch size {batch_size}: it must be at least 1")
    tokens = _token_specs(specs)
    if tokens is not None:
        return _load_tokens(path, specs, tokens, batch_size=batch_size, max_samples=max_samples)
    checked = _check(path, specs, role=None, label_key=label_key, read=True)
    arrays, names = checked.arrays, checked.names
    labels = arrays.get(checked.label_key) if checked.label_key else None
    n = checked.samples
    if max_samples is not None:
        n = min(n, max_samples)
    step = checked.batch or batch_size
    used = (n // step) * step if checked.batch else n  # a fixed batch dim takes full batches
    if used == 0:
        raise DataError(f"{checked.path}: {n} samples, fewer than one batch of {step}")
    batches: list[Feeds] = []
    label_batches: list[np.ndarray] | None = [] if labels is not None else None
    for start in range(0, used, step):
        stop = min(start + step, used)
        batches.append({name: arrays[name][start:stop] for name in names})
        if label_batches is not None and labels is not None:
            label_batches.append(labels[start:stop])
    digest = _hash_arrays({k: v[:used] for k, v in arrays.items()})
    return EvalData(batches, label_batches, digest, str(checked.path))


def load_feeds(
    path: str | os.PathLike[str],
    specs: Sequence[InputSpec],
    *,
    limit: int,
    batch_size: int = 32,
) -> list[Feeds]:
    """Inputs to compare two models on: the first ``limit`` batches of the file, read as
    :func:`load_npz` reads evaluation data (samples on the first axis). Where the model's
    inputs do not take samples on their first axis (a scalar sample rate, a recurrent state
    whose batch is its second axis), the file's arrays are one set of feeds, each fed as it
    is: named like the input, of its rank, type and fixed dims."""
    if limit < 1:
        raise DataError(f"{path}: {limit} input sets: at least 1 is needed")
    try:
        # a fixed batch dim takes the model's batches, whatever ``batch_size`` says
        return load_npz(path, specs, batch_size=batch_size).batches[:limit]
    except DataError as as_samples:
        try:
            return [_as_fed(Path(path), specs)]
        except DataError as as_fed:
            raise DataError(f"{as_samples}; read as one set of feeds: {as_fed}") from None


def _as_fed(path: Path, specs: Sequence[InputSpec]) -> Feeds:
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {s[0]: npz[s[0]] for s in specs if s[0] in npz.files}
    except READ_ERRORS as exc:
        raise DataError(f"cannot read the archive's arrays ({type(exc).__name__})") from exc
    for name, type_str, dims in specs:
        if name not in arrays:
            raise DataError(f"no array for model input '{name}'")
        arr = arrays[name]
        if len(dims) != arr.ndim:
            raise DataError(f"array '{name}' has {arr.ndim} axes, the input takes {len(dims)}")
        fixed = [(a, d) for a, d in enumerate(dims) if isinstance(d, int) and d >= 0]
        for axis, want in fixed:
            if arr.shape[axis] != want:
                raise DataError(f"array '{name}': axis {axis} is {arr.shape[axis]}, not {want}")
        want_type = _NP_TYPES.get(str(type_str))
        if want_type is not None and arr.dtype != want_type:
            raise DataError(f"array '{name}' is {arr.dtype}, the model wants {type_str}")
    return arrays


def _load_tokens(
    path: str | os.PathLike[str],
    specs: Sequence[InputSpec],
    tokens: Sequence[InputSpec],
    *,
    batch_size: int,
    max_samples: int | None,
) -> EvalData:
    """A decoder's evaluation text (``input_ids``), each batch fed as a prefill."""
    from graphtrim.errors import GraphtrimError
    from graphtrim.runtime import decoder_feeds

    checked = _check(path, tokens, role=None, label_key="", read=True)
    ids = checked.arrays["input_ids"]
    if ids.ndim != 2:
        raise DataError(f"{checked.path}: 'input_ids' must be [samples, sequence], got {ids.shape}")
    if (ids < 0).any():
        raise DataError(f"{checked.path}: 'input_ids' holds negative token ids")
    if ids.shape[1] < 2:
        raise DataError(f"{checked.path}: sequences of {ids.shape[1]} token: nothing to predict")
    n = ids.shape[0] if max_samples is None else min(ids.shape[0], max_samples)
    ids = ids[:n].astype(np.int64)
    batches: list[Feeds] = []
    for start in range(0, n, batch_size):
        try:
            batches.append(decoder_feeds(specs, ids[start : start + batch_size]))
        except GraphtrimError as exc:
            raise DataError(f"{checked.path}: {exc}") from exc
    digest = _hash_arrays({"input_ids": ids})
    return EvalData(batches, None, digest, str(checked.path), tokens=ids)


def random_data(specs: Sequence[InputSpec], *, batches: int = 8, seed: int = 0) -> EvalData:
    """Seeded random feeds (symbolic dims bound to small sizes), no labels."""
    from graphtrim.verify import make_inputs

    feeds = [make_inputs(specs, seed=seed + i, default_dim=4) for i in range(batches)]
    merged = {f"{i}/{k}": v for i, f in enumerate(feeds) for k, v in f.items()}
    return EvalData(feeds, None, _hash_arrays(merged), f"random(seed={seed}, batches={batches})")


def input_specs(path: str | os.PathLike[str]) -> list[InputSpec]:
    """The model's inputs as onnxruntime sees them (initializer-backed inputs excluded).

    Raises:
        ModelLoadError: onnxruntime cannot load the model (an :class:`InvalidModelError`)."""
    from graphtrim.runtime import create_session, session_options

    sess = create_session(path, session_options(1, optimize=False), ["CPUExecutionProvider"])
    return [(i.name, i.type, list(i.shape)) for i in sess.get_inputs()]


def _shapes(feeds: Feeds) -> dict[str, tuple[int, ...]]:
    return {k: tuple(np.shape(v)) for k, v in feeds.items()}


class CalibrationReader:
    """onnxruntime's ``CalibrationDataReader`` protocol over any iterable of feeds.

    A smaller last batch (the remainder :func:`load_npz` keeps for a dynamic batch dim) is left
    out when the batches before it all have one shape: onnxruntime's entropy and percentile
    calibrators stack every batch's values into one array and fail on a ragged last one."""

    def __init__(self, feeds: Iterable[Feeds], *, progress: Any = None):
        self._all = list(feeds)
        self.left_out = 0
        if len(self._all) > 1:
            first = _shapes(self._all[0])
            if _shapes(self._all[-1]) != first and all(
                _shapes(f) == first for f in self._all[1:-1]
            ):
                self._all.pop()
                self.left_out = 1
        self._it = iter(self._all)
        self._seen = 0
        self._progress = progress

    def get_next(self) -> Feeds | None:
        item = next(self._it, None)
        if item is not None:
            self._seen += 1
            if self._progress is not None:
                self._progress(f"calibration batch {self._seen}/{len(self._all)}")
        return item

    def rewind(self) -> None:
        self._it = iter(self._all)
        self._seen = 0

    def __len__(self) -> int:
        return len(self._all)
