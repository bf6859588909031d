"""The converter signature: every variant's converter takes one :class:`Conversion`.

A converter turns the optimized float model at ``source`` into the variant at ``target``
(with its external data beside it) and returns what it wants recorded about the conversion
(``VariantBuild.conversion``), or None. The variant table (:mod:`graphtrim.quantize.kinds`)
names each kind's converter as ``module:function``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from graphtrim.data import Feeds
from graphtrim.quantize.config import QuantizeConfig

logger = logging.getLogger("graphtrim.quantize")

ProgressFn = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class Conversion:
    """One converter call: the model, where the variant goes, and how it is built."""

    source: Path
    target: Path
    config: QuantizeConfig
    # node names kept in float (``nodes_to_exclude`` and the accuracy fallback's)
    excluded: Sequence[str] = ()
    # calibration feeds (int8-static reads them; others ignore them)
    calibration: Sequence[Feeds] = ()
    progress: ProgressFn | None = None

    def say(self, line: str) -> None:
        say(self.progress, line)


class Converter(Protocol):
    def __call__(self, job: Conversion) -> dict[str, Any] | None: ...


def say(progress: ProgressFn | None, line: str) -> None:
    """A progress line: to ``progress`` when given, and to the log."""
    if progress is not None:
        progress(line)
    logger.info("%s", line)


def model_files(path: Path) -> list[Path]:
    """The model file and its ``.data`` file when there is one."""
    out = [path]
    data = path.with_name(path.name + ".data")
    if data.exists():
        out.append(data)
    return out


def model_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in model_files(path))
