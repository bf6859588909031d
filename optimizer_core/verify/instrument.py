"""Per-pass verification: an instrument that checks equivalence after every pass that changed
the model, and names the first pass (and its rules) that changed results.

Where the input model itself cannot be run in onnxruntime nothing can be checked:
:class:`VerificationUnavailable`, not a verification failure. Outputs computed from a random op
are compared by shape and dtype only."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from graphtrim.errors import VerificationError, VerificationUnavailable
from graphtrim.graph.framework import PassRecord
from graphtrim.verify.inputs import make_inputs
from graphtrim.verify.outputs import compare_outputs, random_outputs_of, reason_of
from graphtrim.verify.records import OutputComparison, Tolerance, shape_only_notes
from graphtrim.verify.session import Session

logger = logging.getLogger("graphtrim")


class VerifyEachPass:
    """Compares the model to the original after each modifying pass.

    The reference outputs are computed once, before the first pass, on ``trials`` seeded random
    feeds (or the given ``inputs``). Raises :class:`VerificationError` at the first mismatch, and
    :class:`VerificationUnavailable` before any pass when the input model cannot be run.
    ``shape_only`` lists the outputs compared by shape and dtype only (computed from a random op).
    """

    def __init__(
        self,
        *,
        inputs: Sequence[Mapping[str, np.ndarray]] | None = None,
        trials: int = 2,
        seed: int = 0,
        dim_values: Mapping[str, int] | None = None,
        tolerance: Tolerance | None = None,
    ):
        self.inputs = list(inputs) if inputs is not None else None
        self.trials = trials
        self.seed = seed
        self.dim_values = dim_values
        self.tolerance = tolerance or Tolerance()
        self.feeds: list[dict[str, np.ndarray]] = []
        self.expected: list[dict[str, np.ndarray]] = []
        self.shape_only: dict[str, str] = {}
        self.checked = 0
        if self.inputs is None and trials < 1:
            raise ValueError(f"trials must be at least 1, got {trials}")

    def notes(self) -> list[str]:
        """One line per output compared by shape and dtype only."""
        return shape_only_notes(self.shape_only)

    def before_run(self, model: ir.Model) -> None:
        try:
            ref = Session(model)
        except Exception as exc:
            raise VerificationUnavailable(
                f"cannot verify each pass: onnxruntime cannot load the input model: {reason_of(exc)}"
            ) from exc
        try:
            if self.inputs is not None:
                self.feeds = [dict(f) for f in self.inputs]
            else:
                self.feeds = [
                    make_inputs(ref.input_specs(), seed=self.seed + i, dim_values=self.dim_values)
                    for i in range(self.trials)
                ]
            self.expected = [ref.run(f) for f in self.feeds]
        except Exception as exc:  # no feeds for an input type, or the input model fails on them
            raise VerificationUnavailable(f"cannot verify each pass: {reason_of(exc)}") from exc
        finally:
            ref.close()
        self.shape_only = random_outputs_of(model)
        for note in self.notes():
            logger.warning("verify each pass: %s", note)

    def after_pass(
        self, model: ir.Model, record: PassRecord, history: Sequence[PassRecord]
    ) -> None:
        if not record.modified:
            return
        self.checked += 1
        before = [r.pass_name for r in history[:-1] if r.modified]

        def broken(
            what: str, *, iteration: bool = False, compared: OutputComparison | None = None
        ) -> VerificationError:
            where = f"iteration {record.iteration}, " if iteration else ""
            return VerificationError(
                f"pass '{record.pass_name}' ({where}rules {record.rules}) {what}",
                pass_name=record.pass_name,
                rules=record.rules,
                passes_before=before,
                record=compared,
            )

        try:
            session = Session(model)
        except Exception as exc:
            raise broken(f"produced a model onnxruntime cannot load: {reason_of(exc)}") from exc
        try:
            for feeds, expected in zip(self.feeds, self.expected, strict=True):
                try:
                    got = session.run(feeds)
                except Exception as exc:
                    raise broken(f"produced a model that fails to run: {reason_of(exc)}") from exc
                missing = [name for name in expected if name not in got]
                if missing:
                    raise broken(
                        f"removed or renamed output(s) {', '.join(repr(n) for n in missing)}",
                        iteration=True,
                    )
                for name, ref in expected.items():
                    cmp = compare_outputs(
                        name, ref, got[name], self.tolerance, shape_only=name in self.shape_only
                    )
                    if not cmp.ok:
                        raise broken(
                            f"changed output '{name}': {cmp.reason}", iteration=True, compared=cmp
                        )
        finally:
            session.close()
