"""The exit codes of every ``graphtrim`` command, and the one rule for commands that judge
variants (``evaluate``, ``variants``, ``pipeline run``, ``trigger --wait``): 0 when every
variant asked for passed its gates, 1 when any failed (what passed is still written or
registered), 0 again with ``--allow-failed-variants`` as long as at least one passed."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

EXIT_OK, EXIT_MISMATCH, EXIT_BAD_INPUT, EXIT_PASS_FAILURE = 0, 1, 2, 3

ALLOW_FAILED_HELP = (
    "exit 0 when at least one variant passed its gates, even if others failed (default: "
    "every variant must pass)"
)


def add_allow_failed(parser: Any) -> None:
    """The ``--allow-failed-variants`` switch of a command that judges variants."""
    parser.add_argument("--allow-failed-variants", action="store_true", help=ALLOW_FAILED_HELP)


def variants_exit(passed: Collection[str], failed: Collection[str], allow_failed: bool) -> int:
    """The exit code of a command that judged ``passed`` and ``failed`` variants."""
    if not failed and passed:
        return EXIT_OK
    return EXIT_OK if allow_failed and passed else EXIT_MISMATCH
