"""Reading an ``.npz`` archive without trusting it: every member's size is bounded (absolutely
and against the archive's size), and a member's shape and dtype come from its ``.npy`` header
before any of its data is read."""

from __future__ import annotations

import zipfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

# a member of an archive may decompress to at most this much, and to at most this many times
# the archive's size once over the floor (real data compresses a few times, not hundreds)
MAX_MEMBER_BYTES = 8 * 1024**3
MAX_MEMBER_RATIO = 200
RATIO_FLOOR_BYTES = 64 * 1024**2

ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
NPY_MAGIC = b"\x93NUMPY"

# what reading a damaged, encrypted or oddly compressed member raises
READ_ERRORS = (
    ValueError,
    EOFError,
    OSError,
    RuntimeError,
    NotImplementedError,
    zipfile.BadZipFile,
)


def format_shape(shape: Sequence[Any]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def read_header(
    zf: zipfile.ZipFile, info: zipfile.ZipInfo, archive_bytes: int, fail: Callable[[str], Exception]
) -> tuple[tuple[int, ...], np.dtype[Any]]:
    """Shape and dtype of the .npy member ``info``, from its header alone."""
    size = int(info.file_size)
    if size > MAX_MEMBER_BYTES or (
        size > RATIO_FLOOR_BYTES and size > MAX_MEMBER_RATIO * max(1, archive_bytes)
    ):
        raise fail(
            f"member '{info.filename}' would decompress to {format_bytes(size)} "
            f"({size / max(1, archive_bytes):.0f}x the archive's {format_bytes(archive_bytes)}): "
            "refusing it"
        )
    try:
        with zf.open(info) as fh:
            if fh.read(len(NPY_MAGIC)) != NPY_MAGIC:
                raise fail(f"member '{info.filename}' is not a .npy array")
            major, minor = fh.read(2)
            reader = (
                np.lib.format.read_array_header_1_0
                if major == 1
                else np.lib.format.read_array_header_2_0
            )
            if major not in (1, 2, 3):
                raise ValueError(f"unknown .npy format version {major}.{minor}")
            shape, _, dtype = reader(fh)
    except READ_ERRORS as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise fail(f"member '{info.filename}' is not a readable .npy array ({text})") from exc
    if dtype.hasobject:
        raise fail(
            f"member '{info.filename}' holds Python objects, not numbers: "
            "only numeric arrays are read"
        )
    if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize > size:
        raise fail(f"member '{info.filename}' declares more data than it holds (truncated)")
    return tuple(int(d) for d in shape), dtype
