"""The rule tables: every rule of every pass is listed, documented, and shown firing on an example
that keeps the model's results."""

from __future__ import annotations

import pytest

from graphtrim.graph.framework import OptimizeOptions
from graphtrim.graph.presets import PASSES, all_rules
from tests.helpers import assert_equivalent, parse, run_passes
from tests.optimizer_core.graph.rule_examples import all_examples

EXAMPLES = all_examples()
RULES = [(p, r.name) for p, r in all_rules()]


def test_every_pass_has_a_rule_table():
    empty = [name for name, cls in PASSES.items() if not cls.rules]
    assert not empty, f"passes without a rule table: {empty}"


def test_rule_names_are_unique_within_a_pass_and_documented():
    seen: set[tuple[str, str]] = set()
    for pass_name, rule in all_rules():
        assert (pass_name, rule.name) not in seen, f"{pass_name}: rule {rule.name} twice"
        seen.add((pass_name, rule.name))
        assert rule.math.strip(), f"{pass_name}: rule {rule.name} has no math"


def test_every_rule_has_an_example_and_every_example_a_rule():
    missing = sorted(set(RULES) - set(EXAMPLES))
    stale = sorted(set(EXAMPLES) - set(RULES))
    assert not missing, f"rules without an example: {missing}"
    assert not stale, f"examples of no rule: {stale}"


@pytest.mark.parametrize(("pass_name", "rule"), RULES, ids=[f"{p}:{r}" for p, r in RULES])
def test_rule_fires_on_its_example_and_keeps_results(pass_name, rule):
    example = EXAMPLES.get((pass_name, rule))
    if example is None:
        pytest.fail(f"no example for {pass_name}:{rule}")
    proto = example.model()
    out, result = run_passes(
        proto,
        passes=list(example.passes or [pass_name]),
        options=OptimizeOptions(**example.options),
    )
    fired = result.log.per_pass().get(pass_name, {}).get("rules", {})
    assert fired.get(rule, 0) >= 1, f"{pass_name}:{rule} did not fire; fired: {fired}"
    if example.compare:
        assert_equivalent(proto, out, rtol=example.rtol, atol=example.atol)


def test_new_names_avoid_node_names_too():
    """onnxruntime refuses a file with two nodes of one name: a fusion naming its node after
    the op must not repeat the name an earlier run gave a node."""
    import onnx_ir as ir

    from graphtrim.graph import _ir_utils as u

    proto = parse(
        """
        <ir_version: 10, opset_import: ["" : 23]>
        g (float[2] x) => (float[2] y) { y = Relu(x) }
        """
    )
    proto.graph.node[0].name = "RotaryEmbedding"
    names = u.NameGenerator(ir.from_proto(proto))
    assert names("RotaryEmbedding") != "RotaryEmbedding"
    assert names("y") != "y" and names("fresh") == "fresh"
