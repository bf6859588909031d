"""Evaluation and calibration data: ``.npz`` files or seeded random inputs.

An ``.npz`` file holds one array per model input, named like the input, whose first axis runs
over samples; an optional array of labels (key ``labels`` unless told otherwise) has one entry
per sample. Samples are fed in batches: of the model's batch size when its first dim is fixed
(the samples that do not fill a last batch are left out), else of ``batch_size`` with a smaller
last batch for the remainder. Without a file, seeded random inputs of the right types stand in
(they check agreement with the reference model, not a task metric).

:func:`check_data` checks a file against the model's inputs before any heavy work, reading only
the arrays the model needs; :func:`load_npz` runs the same checks. The model's inputs come from
the ONNX model (:func:`input_specs`) or, before export, from an MLflow signature
(:func:`specs_from_signature`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from graphtrim.errors import GraphtrimError
from graphtrim.npz import NPY_MAGIC, READ_ERRORS, ZIP_MAGIC, format_shape, read_header

logger = logging.getLogger("graphtrim.data")

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
    "tensor(int16)": np.int16,
    "tensor(int8)": np.int8,
    "tensor(uint64)": np.uint64,
    "tensor(uint32)": np.uint32,
    "tensor(uint16)": np.uint16,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


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


_HOW = "write it with numpy.savez(path, <input name>=array, ...)"


@dataclasses.dataclass
class _Checked:
    """A data file that passed the checks: the arrays it needs (not read without ``read``)."""

    path: Path
    names: list[str]
    label_key: str | None
    samples: int
    batch: int | None  # the model's fixed batch size, None when dynamic
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, np.dtype[Any]]
    arrays: dict[str, np.ndarray]

    def summary(self, role: str) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "role": role,
            "samples": self.samples,
            "batch": self.batch,
            "arrays": {
                k: {"dtype": str(self.dtypes[k]), "shape": list(self.shapes[k])}
                for k in self.shapes
            },
            "labels": self.label_key,
        }


def _fixed_batch(specs: Sequence[InputSpec], fail: Callable[[str], DataError]) -> int | None:
    fixed = {d for d in (_batch_dim(s) for s in specs) if d is not None}
    if len(fixed) > 1:
        raise fail(f"the model's inputs have different fixed batch sizes {sorted(fixed)}")
    return next(iter(fixed), None)


def _check(
    path: str | os.PathLike[str],
    specs: Sequence[InputSpec],
    *,
    role: str | None,
    label_key: str,
    read: bool,
) -> _Checked:
    """Every check of a data file against ``specs``; the needed arrays when ``read``."""
    p = Path(path)
    where = f"{role} data {p}" if role else str(p)

    def fail(reason: str) -> DataError:
        return DataError(f"{where}: {reason}")

    if not p.exists():
        raise fail("no such data file")
    if not p.is_file():
        raise fail("not a regular file")
    try:
        archive_bytes = p.stat().st_size
        with open(p, "rb") as fh:
            head = fh.read(len(NPY_MAGIC))
    except OSError as exc:
        raise fail(f"cannot read the file: {exc.strerror or exc}") from exc
    if head.startswith(NPY_MAGIC):
        raise fail(f"a single .npy array, not an .npz archive of named arrays ({_HOW})")
    if not head.startswith(ZIP_MAGIC):
        raise fail(f"not an .npz archive of arrays ({_HOW})")
    names = [s[0] for s in specs]
    batch = _fixed_batch(specs, fail)
    try:
        zf = zipfile.ZipFile(p)
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise fail(f"not a readable .npz archive (damaged zip file: {exc})") from exc
    with zf:
        members = {i.filename: i for i in zf.infolist() if not i.is_dir()}
        for member in members:
            if not member.endswith(".npy"):
                raise fail(f"member '{member}' is not a .npy array ({_HOW})")
        keys = sorted(m[: -len(".npy")] for m in members)
        missing = [n for n in names if n not in keys]
        source = {n: n for n in names}  # model input -> the array that feeds it
        others = [k for k in keys if k != label_key]
        if missing and len(names) == 1 and _placeholder(names[0]) and len(others) == 1:
            # an unnamed input (the exporter called it input_0): its name is graphtrim's, not
            # the user's, so the one array feeds it, and the log says so
            source[names[0]] = others[0]
            missing = []
            if (str(p), others[0]) not in _SAID:  # once per file, not once per stage
                _SAID.add((str(p), others[0]))
                logger.warning(
                    "%s: array '%s' feeds the model's unnamed input (%s)",
                    where,
                    others[0],
                    names[0],
                )
        if missing:
            raise fail(
                f"no array for model input(s) {', '.join(missing)} "
                f"(has {', '.join(keys) or 'no arrays'}); name each array like the model input "
                f"it feeds: {', '.join(names)}"
            )
        labels = label_key if label_key in keys and label_key not in names else None
        needed = [*names, *([labels] if labels else [])]
        shapes: dict[str, tuple[int, ...]] = {}
        dtypes: dict[str, np.dtype[Any]] = {}
        for key in needed:
            entry = members[source.get(key, key) + ".npy"]
            shapes[key], dtypes[key] = read_header(zf, entry, archive_bytes, fail)
    for key in needed:
        if not shapes[key]:
            what = f"'{key}'" if key == labels else f"array '{key}'"
            raise fail(f"{what} is a scalar; samples (entries) go on its first axis")
    n = shapes[names[0]][0] if names else 0
    for spec in specs:
        name, shape, dims = spec[0], shapes[spec[0]], list(spec[2])
        if dims and len(shape) != len(dims):
            raise fail(
                f"array '{name}' has shape {format_shape(shape)} ({len(shape)} axes); model input "
                f"'{name}' takes {len(dims)} axes {format_shape(dims)} with samples on the first"
            )
        for axis, (got, want) in enumerate(zip(shape, dims, strict=False)):
            if axis and isinstance(want, int) and want >= 0 and got != want:
                raise fail(
                    f"array '{name}' has shape {format_shape(shape)}: axis {axis} is {got}, model "
                    f"input '{name}' {format_shape(dims)} wants {want}"
                )
        if shape[0] != n:
            raise fail(
                f"array '{name}' does not have {n} samples on its first axis "
                f"(has {shape[0]}, array '{names[0]}' has {n})"
            )
        want_type = _NP_TYPES.get(str(spec[1]))
        if want_type is not None and dtypes[name] != want_type:
            raise fail(f"array '{name}' is {dtypes[name]}, the model wants {spec[1]}")
    if labels is not None and shapes[labels][0] != n:
        raise fail(f"'{labels}' has {shapes[labels][0]} entries for {n} samples")
    if names and n == 0:
        raise fail("the arrays hold no samples")
    if batch is not None and n < batch:
        raise fail(f"{n} samples, fewer than one batch of {batch}")
    arrays: dict[str, np.ndarray] = {}
    floats = [s[0] for s in specs if np.issubdtype(dtypes[s[0]], np.inexact)]
    wanted = needed if read else floats
    if wanted:
        try:
            with np.load(p, allow_pickle=False) as npz:
                for key in wanted:
                    arrays[key] = npz[source.get(key, key)]
        except READ_ERRORS as exc:
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise fail(f"cannot read the archive's arrays ({text})") from exc
    for name in floats:
        bad = int(arrays[name].size - np.count_nonzero(np.isfinite(arrays[name])))
        if bad:
            raise fail(
                f"array '{name}' (model input '{name}') holds {bad} non-finite value(s) "
                f"(NaN or inf) among {arrays[name].size}"
            )
    if not read:
        arrays = {}
    return _Checked(p, names, labels, n, batch, shapes, dtypes, arrays)


_SAID: set[tuple[str, str]] = set()


def _placeholder(name: str) -> bool:
    """Whether ``name`` is the name export gives an input the model's signature left unnamed."""
    return re.fullmatch(r"input_\d+", name) is not None


def check_data(
    path: str | os.PathLike[str],
    specs: Sequence[InputSpec],
    *,
    role: str,
    label_key: str = "labels",
) -> dict[str, Any]:
    """Check the data file ``path`` against the model's inputs ``specs`` before any heavy work.

    Reads the archive's directory and the headers of the arrays the model needs, then the
    float inputs' values (for NaN and inf); other members are never decompressed. ``role``
    ("calibration", "evaluation") names the file's use in messages.

    Returns a summary: ``path``, ``role``, ``samples``, ``batch`` (the model's fixed batch size
    or None), ``arrays`` (dtype and shape per input and labels), ``labels`` (their key or None).

    Raises:
        DataError: one line naming the file and what is wrong with it.
    """
    return _check(
        path, _token_specs(specs) or specs, role=role, label_key=label_key, read=False
    ).summary(role)


def _token_specs(specs: Sequence[InputSpec]) -> list[InputSpec] | None:
    """For a decoder with a KV cache, what its data file holds: ``input_ids`` alone (the
    token ids of texts, ``[samples, sequence]``); the mask and the empty cache of a prefill
    follow from them. None for other models."""
    from graphtrim.runtime import kv_cache_inputs

    if not kv_cache_inputs(specs):
        return None
    ids = next((s for s in specs if s[0] == "input_ids"), None)
    return [ids] if ids is not None else None


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
