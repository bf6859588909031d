"""The fixed-point driver: the passes run in order until none changes the model, with shape
inference between iterations, the shape-resolving passes settled after a change, the repairs
after every changed pass and the finishing passes once at the end."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import onnx_ir as ir

from graphtrim.errors import GraphtrimError, PassFailure
from graphtrim.graph import _ir_utils as u
from graphtrim.graph.framework import (
    ChangeLog,
    GraphtrimPass,
    Instrument,
    OptimizeOptions,
    PassRecord,
    ProgressFn,
)

logger = logging.getLogger("graphtrim.optimizer")

# rounds of inference and the shape-resolving passes after one of them changed the model
SHAPE_ROUNDS = 64


def _node_count(model: ir.Model) -> int:
    return sum(len(g) for g in u.all_graphs(model))


class FixedPointDriver(GraphtrimPass):
    """Runs ``passes`` in order until none modifies the model, at most ``max_iterations`` times.

    ``per_iteration`` passes (shape inference) run at the start of each iteration after a change
    and do not count as one (what they learn lets the passes run again). After a pass marked
    ``resolves_shapes`` changed the model, inference and those passes run in turn until they
    settle, before the iteration goes on. ``repairs`` run after every pass that changed the model, so that what a
    rewrite made visible to a runtime's static checks still loads (see
    :mod:`graphtrim.graph.passes.scalar_inputs`); their rewrites are credited to that pass
    as rules ``<repair>:<rule>``. ``finishing`` passes are left out of the loop and run once, in
    their order, after it.
    """

    name = "fixed-point"
    sweeps_dead = False

    def __init__(
        self,
        passes: Sequence[GraphtrimPass],
        *,
        preset: str = "custom",
        options: OptimizeOptions | None = None,
        per_iteration: Sequence[ir.passes.PassBase] = (),
        repairs: Sequence[GraphtrimPass] = (),
        instruments: Sequence[Instrument] = (),
        progress: ProgressFn | None = None,
    ):
        super().__init__(options)
        self.passes = list(passes)
        self.preset = preset
        self.per_iteration = list(per_iteration)
        self.repairs = list(repairs)
        self.instruments = list(instruments)
        self.progress = progress
        self.log = self._new_log()

    def _new_log(self) -> ChangeLog:
        return ChangeLog(
            preset=self.preset,
            passes=[p.name for p in self.passes],
            inexact=frozenset(p.name for p in self.passes if not p.exact),
        )

    def apply(self, model: ir.Model) -> bool:
        start = time.perf_counter()
        self.log = self._new_log()
        for inst in self.instruments:
            inst.before_run(model)
        any_change = False
        history: list[str] = []
        converged = False
        modifications = 0  # modifying pass runs so far
        inferred_at = -1  # value of ``modifications`` when shape inference last ran
        clean_at: dict[int, int] = {}  # pass index -> ``modifications`` when it last found nothing
        looped = [(i, p) for i, p in enumerate(self.passes, start=1) if not p.finishing]
        for iteration in range(1, self.options.max_iterations + 1):
            self.log.iterations = iteration
            if inferred_at != modifications:
                if self._infer(model):
                    modifications += 1  # passes that found nothing may find something now
                inferred_at = modifications
            changed = False
            for index, pass_ in looped:
                # passes are deterministic: one that found nothing on this very model would
                # find nothing again, so it is skipped until another pass changes something
                if clean_at.get(index) == modifications:
                    continue
                if not self._run(model, index, pass_, iteration, history):
                    clean_at[index] = modifications
                    continue
                changed = True
                modifications += 1
                clean_at.pop(index, None)
                if pass_.resolves_shapes:
                    # each shape made constant can let inference compute the next one (a
                    # chain of computed reshapes): follow the chain now, not one whole
                    # iteration per link
                    modifications, inferred_at = self._settle_shapes(
                        model, looped, iteration, history, modifications, clean_at
                    )
            any_change = any_change or changed
            if not changed:
                converged = True
                break
        self.log.converged = converged
        if not converged:
            msg = (
                f"optimization did not converge within {self.options.max_iterations} iterations; "
                "the result is valid but may not be minimal"
            )
            self.log.notes.append(msg)
            logger.warning(msg)
        for index, pass_ in enumerate(self.passes, start=1):
            if pass_.finishing and self._run(model, index, pass_, self.log.iterations, history):
                any_change = True
        self.log.seconds = time.perf_counter() - start
        return any_change

    def _infer(self, model: ir.Model) -> bool:
        """Run the ``per_iteration`` helpers; whether one learned something (``learned``)."""
        learned = False
        for helper in self.per_iteration:
            helper(model)
            learned |= bool(getattr(helper, "learned", False))
        return learned

    def _settle_shapes(
        self,
        model: ir.Model,
        looped: Sequence[tuple[int, GraphtrimPass]],
        iteration: int,
        history: list[str],
        modifications: int,
        clean_at: dict[int, int],
    ) -> tuple[int, int]:
        """Inference and the ``resolves_shapes`` passes in turn until they change nothing (at
        most ``SHAPE_ROUNDS`` rounds). Returns the count of modifying pass runs afterwards and
        that count when inference last ran."""
        group = [(i, p) for i, p in looped if p.resolves_shapes]
        inferred_at = -1
        for _ in range(SHAPE_ROUNDS):
            learned = self._infer(model)
            if learned:
                modifications += 1  # passes that found nothing may find something now
            inferred_at = modifications
            if not learned:
                break  # nothing new to go on: the group already ran on these shapes
            progressed = False
            for index, pass_ in group:
                if self._run(model, index, pass_, iteration, history):
                    modifications += 1
                    progressed = True
                    clean_at.pop(index, None)
                else:
                    clean_at[index] = modifications
            if not progressed:
                break
        return modifications, inferred_at

    def _run(
        self, model: ir.Model, index: int, pass_: GraphtrimPass, iteration: int, history: list[str]
    ) -> bool:
        """Run one pass, record it in the change log and the instruments; whether it changed
        the model."""
        if self.progress is not None:
            self.progress(
                f"iteration {iteration} pass {index}/{len(self.passes)} {pass_.name} "
                f"({_node_count(model)} nodes)"
            )
        before = _node_count(model)
        removed_before = u.removed_so_far()
        t0 = time.perf_counter()
        try:
            result = pass_(model)
        except GraphtrimError:
            raise
        except Exception as exc:
            raise PassFailure(pass_.name, history, exc) from exc
        rules = dict(pass_.rule_counts)
        if result.modified:
            rules.update(self._repair(model, [*history, pass_.name]))
        seconds = time.perf_counter() - t0
        after = _node_count(model)
        removed = u.removed_so_far() - removed_before
        record = PassRecord(
            iteration=iteration,
            pass_name=pass_.name,
            modified=result.modified,
            nodes_before=before,
            nodes_after=after,
            nodes_removed=removed,
            nodes_added=after - before + removed,
            rules=rules,
            seconds=seconds,
        )
        self.log.records.append(record)
        history.append(pass_.name)
        if result.modified:
            logger.debug(
                "%s: -%d +%d nodes %s",
                pass_.name,
                record.nodes_removed,
                record.nodes_added,
                record.rules,
            )
        for inst in self.instruments:
            inst.after_pass(model, record, self.log.records)
        return bool(result.modified)

    def _repair(self, model: ir.Model, history: Sequence[str]) -> dict[str, int]:
        rules: dict[str, int] = {}
        for repair in self.repairs:
            try:
                repair(model)
            except GraphtrimError:
                raise
            except Exception as exc:
                raise PassFailure(repair.name, history, exc) from exc
            for rule, n in repair.rule_counts.items():
                rules[f"{repair.name}:{rule}"] = n
        return rules
