"""The errors of a variant build (re-exported by :mod:`graphtrim.quantize.build`)."""

from __future__ import annotations

from graphtrim.errors import GraphtrimError


class QuantizeError(GraphtrimError):
    """A variant could not be built (missing calibration data, a conversion that failed)."""


class NothingToQuantize(QuantizeError):
    """Every node the converter would change is kept in float."""
