"""Rewrite rules as data.

Every pass module exports its rules as a table, ``RULES``: a tuple of :class:`Rule`. A rule names
the op types it is tried on, a ``check`` that either declines with a reason (a string) or returns
what it matched, the ``rewrite`` that replaces the match, and the math it relies on. A pass made
of node-local rules is a :class:`RulePass`: it walks the nodes in order and, for each node, tries
the rules that list its op type until one rewrites. Passes that work on the whole graph (dead
code, folding, CSE, loops) keep their own walk but still export their rules, and a pass may only
count (``hit``) a rule its table names, so ``graphtrim passes --rules`` lists every rewrite there
is.

A decline is not silent: it is counted per rule and reason in ``declines`` and logged at debug
level (logger ``graphtrim.optimizer``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.framework import GraphtrimPass

logger = logging.getLogger("graphtrim.optimizer")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One rewrite.

    Attributes:
        name: the name counted in change logs; unique within its pass.
        math: what the rewrite relies on, e.g. ``"x + 0 -> x (broadcast keeps x's shape)"``.
        ops: op types (default domain) the rule is tried on; empty for a rule on the whole graph.
        check: ``check(node, ctx) -> match | str``; a string is the reason it declines.
        rewrite: ``rewrite(node, match, ctx) -> None``; replaces what ``check`` matched.
    """

    name: str
    math: str
    ops: tuple[str, ...] = ()
    check: Callable[..., Any] | None = None
    rewrite: Callable[..., None] | None = None


@dataclasses.dataclass
class RuleContext:
    """What a rule sees besides the node: the model, its graph and the pass (options, names)."""

    model: ir.Model
    graph: ir.Graph
    pass_: GraphtrimPass

    @property
    def options(self) -> Any:
        return self.pass_.options


def replace(old: ir.Value, new: ir.Value, what: str) -> None:
    """Make the users of ``old`` read ``new``; raise when ``old`` cannot be rerouted (the rule's
    check should have declined), so the driver names the pass that failed."""
    if not u.replace_value(old, new):
        raise RuntimeError(f"cannot reroute the output of {what}")


def reroute_refusal(old: ir.Value, new: ir.Value) -> str | None:
    """Why :func:`replace` would refuse to make the users of ``old`` read ``new`` (the reasons
    of ``u.replace_value``), or ``None`` when it can: a check that calls it before matching
    leaves its rewrite nothing to fail on."""
    if old is new:
        return "the value would replace itself"
    if old.graph is not None and old.is_graph_output():
        if new.is_graph_input():
            return "a graph output would become a graph input"
        if new.is_graph_output():
            return "a graph output would become another graph output"
        if new.is_initializer():
            return "a graph output would become an initializer"
        if new.graph is not old.graph:
            return "a graph output would become a value of another scope"
        if new.producer() is None:
            return "a graph output would become a value without a producer"
    return None


def replace_output(node: ir.Node, new: ir.Value, ctx: RuleContext) -> None:
    """The rewrite of a rule whose match is a value equal to ``node``'s (first) output: the
    output's users read ``new`` and ``node`` goes dead."""
    replace(node.outputs[0], new, f"{node.op_type} node '{node.name}'")


def replace_with_node(node: ir.Node, new: ir.Node, name: str, ctx: RuleContext) -> None:
    """The rewrite of a rule that computes ``node``'s (first) output with the node ``new``:
    ``new`` goes in before ``node``, its output named ``name`` with the type and shape of
    ``node``'s, and ``node``'s readers read it."""
    ctx.graph.insert_before(node, new)
    out = new.outputs[0]
    out.name = name
    out.type = node.outputs[0].type
    out.shape = node.outputs[0].shape
    replace_output(node, out, ctx)


class RulePass(GraphtrimPass):
    """A pass made of node-local rules: ``RULES`` tried in table order on each node they list."""

    rules: ClassVar[Sequence[Rule]] = ()

    def __init__(self, options: Any = None):
        super().__init__(options)
        self.declines: Counter[tuple[str, str]] = Counter()
        # one name generator per run, made by the first rewrite that names something
        self.run_namer: u.NameGenerator | None = None

    def names(self, model: ir.Model) -> u.NameGenerator:
        """The run's name generator (made on first use, so a run that renames nothing scans
        no names)."""
        if self.run_namer is None:
            self.run_namer = u.NameGenerator(model)
        return self.run_namer

    def apply(self, model: ir.Model) -> bool:
        self.run_namer = None
        by_op: dict[str, list[Rule]] = {}
        for rule in self.rules:
            for op in rule.ops:
                by_op.setdefault(op, []).append(rule)
        changed = False
        for graph, node in u.standard_nodes(model):
            candidates = by_op.get(node.op_type)
            if not candidates or node.graph is None:
                continue
            ctx = RuleContext(model, graph, self)
            for rule in candidates:
                if self.try_rule(rule, node, ctx):
                    changed = True
                    break
        return changed

    def try_rule(self, rule: Rule, node: ir.Node, ctx: RuleContext) -> bool:
        """Check ``rule`` on ``node`` and rewrite on a match; a decline is counted, not raised."""
        assert rule.check is not None and rule.rewrite is not None, rule.name
        match = rule.check(node, ctx)
        if isinstance(match, str):
            self.declines[(rule.name, match)] += 1
            logger.debug("%s: %s declined at %s: %s", self.name, rule.name, node.name, match)
            return False
        rule.rewrite(node, match, ctx)
        self.hit(rule.name, self.counted(rule, match))
        return True

    def counted(self, rule: Rule, match: Any) -> int:
        """How many rewrites a match of ``rule`` counts as (:meth:`hit`): one."""
        return 1
