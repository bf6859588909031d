"""Checking a data file against the model's inputs before any heavy work: the archive's directory
and the headers of the arrays the model needs, then the float inputs' values, each problem as one
line naming the file (:class:`DataError`). :mod:`graphtrim.data` loads a file only after these
checks."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from graphtrim.errors import GraphtrimError
from graphtrim.npz import NPY_MAGIC, READ_ERRORS, ZIP_MAGIC, format_shape, read_header

logger = logging.getLogger("graphtrim.data")

InputSpec = tuple[str, Any, Sequence[int | str | None]]


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


class DataError(GraphtrimError):
    """Evaluation or calibration data that does not fit the model."""


def _batch_dim(spec: InputSpec) -> int | None:
    shape = list(spec[2])
    if not shape:
        return None
    first = shape[0]
    return first if isinstance(first, int) and first > 0 else None


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
