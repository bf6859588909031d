"""The pass framework: a pass base on onnx_ir's infrastructure, instruments and the fixed-point driver.

A pass is an ``onnx_ir`` in-place pass that also counts the rules it fired. The driver runs a
list of passes repeatedly until none changes the graph (capped), records per pass what changed
and how long it took, and calls instruments after each pass. Verification of each pass is such an
instrument (see ``graphtrim.verify.instrument``), so no pass carries checking code.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol

import onnx_ir as ir

from graphtrim.errors import GraphtrimError, PassFailure
from graphtrim.graph import _ir_utils as u

logger = logging.getLogger("graphtrim.optimizer")


TARGETS = ("portable", "ort-cpu", "ort-cuda", "tensorrt")


@dataclasses.dataclass(frozen=True)
class OptimizeOptions:
    """Knobs shared by the passes.

    Attributes:
        max_iterations: cap of the fixed-point loop; a warning is logged when it is reached.
        fold_max_growth_bytes: constant folding may add at most this many bytes per folded value
            beyond the bytes of the constants it makes dead (shape tensors, small tables).
        fold_max_growth_ratio: beyond that per-value allowance, the folded values of one run
            may together grow the model by this fraction of its initializer bytes (a 110 MB
            model may take on 5.5 MB of folded attention masks; a model of placeholder fills
            takes on next to nothing); 0 turns the pool off.
        fold_max_tensor_bytes: never materialize a folded tensor larger than this.
        fold_max_input_bytes: skip folding subgraphs that read more constant bytes than this.
        dedup_max_bytes: initializers larger than this are not compared for deduplication.
        target: the runtime the model is optimized for: ``portable`` (standard ONNX ops only),
            ``ort-cpu`` / ``ort-cuda`` (may add onnxruntime contrib ops where they help on that
            target) or ``tensorrt`` (avoids ops TensorRT's ONNX parser does not take).
        allow_lossy: permit rewrites that change numbers beyond rounding (removing a
            QuantizeLinear -> DequantizeLinear pair); off by default.
        max_unroll_trip_count: a Loop with a constant trip count up to this is unrolled.
        max_unroll_nodes: ... and only when the unrolled body adds at most this many nodes.
        target_opset: raise the model's default-domain opset to this before optimizing (opt-in:
            fusions into Gelu need 20, into RMSNormalization 23); never lowered.
    """

    max_iterations: int = 10
    fold_max_growth_bytes: int = 4096
    fold_max_growth_ratio: float = 0.05
    fold_max_tensor_bytes: int = 256 * 1024 * 1024
    fold_max_input_bytes: int = 1024 * 1024 * 1024
    dedup_max_bytes: int = 4 * 1024 * 1024 * 1024
    target: str = "portable"
    allow_lossy: bool = False
    max_unroll_trip_count: int = 16
    max_unroll_nodes: int = 512
    target_opset: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.fold_max_growth_ratio <= 1:
            raise GraphtrimError(
                f"fold_max_growth_ratio must lie in [0, 1], not {self.fold_max_growth_ratio}"
            )
        if self.target not in TARGETS:
            raise GraphtrimError(
                f"unknown target '{self.target}'; choose one of {', '.join(TARGETS)}"
            )


class GraphtrimPass(ir.passes.InPlacePass):
    """Base of every graphtrim pass.

    Subclasses set ``name`` (the CLI's name for it), ``exact`` (results are identical for finite
    inputs, up to the sign of a zero: ``x + 0`` turns -0.0 into +0.0, its removal does not) and
    ``summary``, and implement :meth:`apply`, which returns whether it changed
    the model and calls :meth:`hit` once per rewrite with the rule's name.
    """

    name: ClassVar[str] = ""
    exact: ClassVar[bool] = True
    summary: ClassVar[str] = ""
    # remove the nodes a rewrite made dead, so the change log credits the pass that did it
    sweeps_dead: ClassVar[bool] = True
    # the pass's rule table (``graphtrim.graph.rules.Rule``); ``hit`` takes only these names
    rules: ClassVar[Sequence[Any]] = ()
    # a form chosen for the runtime rather than a simplification: it runs once, after the
    # fixed point, so that no other pass loses the pattern it rewrites
    finishing: ClassVar[bool] = False
    # turns shapes into constants and constants into shapes (symbolic dims, folding): after
    # it changed the model, inference and these passes run again until they settle
    resolves_shapes: ClassVar[bool] = False

    def __init__(self, options: OptimizeOptions | None = None):
        super().__init__()
        self.options = options or OptimizeOptions()
        self.rule_counts: Counter[str] = Counter()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def hit(self, rule: str, n: int = 1) -> None:
        if self.rules and rule not in {r.name for r in self.rules}:
            raise ValueError(f"pass '{self.name}' counted rule '{rule}', which its table lacks")
        self.rule_counts[rule] += n

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.rule_counts = Counter()
        modified = bool(self.apply(model))
        if modified and self.sweeps_dead:
            u.sweep_dead(model)
        return ir.passes.PassResult(model, modified)

    def apply(self, model: ir.Model) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclasses.dataclass
class PassRecord:
    """What one pass invocation did."""

    iteration: int
    pass_name: str
    modified: bool
    nodes_before: int
    nodes_after: int
    nodes_removed: int
    nodes_added: int
    rules: dict[str, int]
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class ChangeLog:
    """The record of a whole optimization run."""

    preset: str
    passes: list[str]
    records: list[PassRecord] = dataclasses.field(default_factory=list)
    iterations: int = 0
    converged: bool = True
    seconds: float = 0.0
    notes: list[str] = dataclasses.field(default_factory=list)
    # the target profile and what it applied (see ``graphtrim.graph.targets``)
    target: dict[str, Any] = dataclasses.field(default_factory=dict)
    # why no pass ran and the model was left as it is (see ``graph.opset.passthrough_reason``)
    passed_through: str | None = None
    # names of the passes that are not exact (their rules are the fusions); set by the driver
    inexact: frozenset[str] = frozenset()

    def fusions(self) -> dict[str, int]:
        """Rules fired by passes that are not exact (the fusions), with their counts."""
        out: Counter[str] = Counter()
        for r in self.records:
            if r.pass_name in self.inexact:
                out.update(r.rules)
        return dict(sorted(out.items()))

    def per_pass(self) -> dict[str, dict[str, Any]]:
        """Totals per pass across iterations."""
        out: dict[str, dict[str, Any]] = {}
        for r in self.records:
            agg = out.setdefault(
                r.pass_name,
                {"nodes_removed": 0, "nodes_added": 0, "seconds": 0.0, "rules": Counter()},
            )
            agg["nodes_removed"] += r.nodes_removed
            agg["nodes_added"] += r.nodes_added
            agg["seconds"] += r.seconds
            agg["rules"].update(r.rules)
        for agg in out.values():
            agg["rules"] = dict(sorted(agg["rules"].items()))
            agg["seconds"] = round(agg["seconds"], 6)
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "preset": self.preset,
            "passes": self.passes,
            "iterations": self.iterations,
            "converged": self.converged,
            "seconds": round(self.seconds, 6),
            "notes": self.notes,
            "passed_through": self.passed_through,
            "target": self.target,
            "fusions": self.fusions(),
            "per_pass": self.per_pass(),
            "records": [r.to_json() for r in self.records if r.modified],
        }

    def summary(self) -> str:
        if self.passed_through is not None:
            head = f"passed through: {self.passed_through}; the output is the input unchanged"
            rest = [f"  note: {n}" for n in self.notes if not n.startswith("passed through:")]
            return "\n".join([head, *rest])
        lines = [
            f"preset {self.preset}: {self.iterations} iteration(s), "
            f"{'converged' if self.converged else 'NOT converged'}, {self.seconds:.3f} s"
        ]
        lines.extend(f"  note: {note}" for note in self.notes)
        if self.target.get("kept"):
            t = self.target
            lines.append(
                f"  target {t['target']}: kept the {t['kept']} model "
                "(p50 " + ", ".join(f"{k} {v:.3f} ms" for k, v in t["p50_ms"].items()) + f"; "
                f"contrib ops {t['contrib_ops'] or 'none'})"
            )
        for name, agg in self.per_pass().items():
            if not agg["rules"] and not agg["nodes_removed"] and not agg["nodes_added"]:
                continue
            rules = ", ".join(f"{k} x{v}" for k, v in agg["rules"].items())
            lines.append(
                f"  {name:<22} -{agg['nodes_removed']:<5} +{agg['nodes_added']:<4} "
                f"{agg['seconds'] * 1000:8.1f} ms  {rules}"
            )
        return "\n".join(lines)


class Instrument(Protocol):
    """Hooks around the passes (timing, dumping, verifying)."""

    def before_run(self, model: ir.Model) -> None: ...

    def after_pass(
        self, model: ir.Model, record: PassRecord, history: Sequence[PassRecord]
    ) -> None: ...


ProgressFn = Callable[[str], None]


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
