"""argparse ``type=`` functions shared by the commands: a count must be a count, a tolerance
finite, a timeout positive. A bad value is argparse's own one-line error and exit 2."""

from __future__ import annotations

import argparse
import json
import math


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse ``type=``: an integer of at least 1 (a count of trials, attempts, threads)."""
    return _int_at_least(text, 1)


def nonneg_int(text: str) -> int:
    """argparse ``type=``: an integer of at least 0."""
    return _int_at_least(text, 0)


def finite_nonneg_float(text: str) -> float:
    """argparse ``type=``: a finite number of at least 0 (a tolerance); nan and inf refused."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse ``type=``: a finite number greater than 0 (a timeout, an interval)."""
    value = finite_nonneg_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text!r}")
    return value


def csv(text: str) -> list[str]:
    """argparse ``type=``: ``a,b,c``, or a JSON list (what orchestrators render a list parameter
    as)."""
    if text.strip().startswith("["):
        try:
            return [str(t) for t in json.loads(text)]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {text!r}") from exc
    return [t.strip() for t in text.split(",") if t.strip()]
