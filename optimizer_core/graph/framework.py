"""The pass framework: a pass base on onnx_ir's infrastructure, its records and instruments.

A pass is an ``onnx_ir`` in-place pass that also counts the rules it fired. The driver
(:mod:`graphtrim.graph.driver`) runs a list of passes repeatedly until none changes the graph
(capped), records per pass what changed and how long it took, and calls instruments after each
pass. Verification of each pass is such an instrument (see ``graphtrim.verify.instrument``), so
no pass carries checking code.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol

import onnx_ir as ir

from graphtrim.errors import GraphtrimError
from graphtrim.graph import _ir_utils as u
from graphtrim.lazy import lazy_attributes

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

# FixedPointDriver moved to graph.driver, which builds on this module: its old import path is an
# alias resolved by name when asked for, not a dependency of this module
__getattr__ = lazy_attributes(__name__, {"FixedPointDriver": "graphtrim.graph.driver"})
