"""Evaluation and calibration data: ``.npz`` files or seeded random inputs.

An ``.npz`` file holds one array per model input, named like the input, whose first axis runs
over samples; an optional array of labels (key ``labels`` unless told otherwise) has one entry
per sample. Samples are fed in batches: of the model's batch size when its first dim is fixed,
else of ``batch_size``. Without a file, seeded random inputs of the right types stand in (they
check agreement with the reference model, not a task metric).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from optimizer_core.errors import GraphtrimError

Feeds = dict[str, np.ndarray]
InputSpec = tuple[str, Any, Sequence[int | str | None]]


class DataError(GraphtrimError):
    """Evaluation or calibration data that does not fit the model."""


@dataclasses.dataclass
class EvalData:
    """Batches of feeds, optional labels per batch, and a hash identifying the data."""

    batches: list[Feeds]
    labels: list[np.ndarray] | None
    digest: str
    source: str

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


def _batch_dim(spec: InputSpec) -> int | None:
    shape = list(spec[2])
    if not shape:
        return None
    first = shape[0]
    return first if isinstance(first, int) and first > 0 else None


_NP_TYPES = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


def load_npz(
    path: str | os.PathLike[str],
    specs: Sequence[InputSpec],
    *,
    batch_size: int = 32,
    label_key: str = "labels",
    max_samples: int | None = None,
) -> EvalData:
    """Read ``path`` and cut it into batches that fit the model's inputs ``specs``."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: no such data file")
    try:
        with np.load(p, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except Exception as exc:  # zipfile, pickle refusal, truncated file
        raise DataError(f"{p}: not a readable .npz file ({exc})") from exc
    names = [s[0] for s in specs]
    missing = [n for n in names if n not in arrays]
    others = [k for k in arrays if k != label_key]
    if len(names) == 1 and missing and len(others) == 1:
        # one input, one array: the exporter's input name need not match the data's key
        arrays[names[0]] = arrays.pop(others[0])
        missing = []
    if missing:
        raise DataError(
            f"{p}: no array for model input(s) {', '.join(missing)} (has {', '.join(sorted(arrays))})"
        )
    labels = arrays.get(label_key) if label_key not in names else None
    for name in [*names, *([label_key] if labels is not None else [])]:
        if arrays[name].ndim == 0:
            raise DataError(f"{p}: array '{name}' is a scalar; samples go on its first axis")
    n = len(arrays[names[0]])
    for name in names:
        if arrays[name].ndim == 0 or len(arrays[name]) != n:
            raise DataError(f"{p}: array '{name}' does not have {n} samples on its first axis")
    if labels is not None and len(labels) != n:
        raise DataError(f"{p}: '{label_key}' has {len(labels)} entries for {n} samples")
    if max_samples is not None:
        n = min(n, max_samples)
    fixed = {_batch_dim(s) for s in specs}
    step = next(iter(fixed)) if len(fixed) == 1 and None not in fixed else batch_size
    if step is None or step <= 0:
        step = batch_size
    if n < step:
        raise DataError(f"{p}: {n} samples, fewer than one batch of {step}")
    used = (n // step) * step  # a fixed batch dim cannot take a partial batch
    batches: list[Feeds] = []
    label_batches: list[np.ndarray] | None = [] if labels is not None else None
    for spec in specs:
        want = _NP_TYPES.get(str(spec[1]))
        if want is not None and arrays[spec[0]].dtype != want:
            raise DataError(
                f"{p}: array '{spec[0]}' is {arrays[spec[0]].dtype}, the model wants {spec[1]}"
            )
    for start in range(0, used, step):
        batches.append({name: arrays[name][start : start + step] for name in names})
        if label_batches is not None and labels is not None:
            label_batches.append(labels[start : start + step])
    digest = _hash_arrays({k: v[:used] for k, v in arrays.items() if k in names or k == label_key})
    return EvalData(batches, label_batches, digest, str(p))


def random_data(specs: Sequence[InputSpec], *, batches: int = 8, seed: int = 0) -> EvalData:
    """Seeded random feeds (symbolic dims bound to small sizes), no labels."""
    from optimizer_core.verify import make_inputs

    feeds = [make_inputs(specs, seed=seed + i, default_dim=4) for i in range(batches)]
    merged = {f"{i}/{k}": v for i, f in enumerate(feeds) for k, v in f.items()}
    return EvalData(feeds, None, _hash_arrays(merged), f"random(seed={seed}, batches={batches})")


def input_specs(path: str | os.PathLike[str]) -> list[InputSpec]:
    """The model's inputs as onnxruntime sees them (initializer-backed inputs excluded)."""
    import onnxruntime as ort

    from optimizer_core.runtime import session_options

    sess = ort.InferenceSession(
        str(path), session_options(1, optimize=False), providers=["CPUExecutionProvider"]
    )
    return [(i.name, i.type, list(i.shape)) for i in sess.get_inputs()]


class CalibrationReader:
    """onnxruntime's ``CalibrationDataReader`` protocol over any iterable of feeds."""

    def __init__(self, feeds: Iterable[Feeds], *, progress: Any = None):
        self._all = list(feeds)
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
