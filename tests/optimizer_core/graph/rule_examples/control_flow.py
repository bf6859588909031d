"""Examples of the ``if-inline`` rules: an If on a constant condition."""

from __future__ import annotations

from tests.optimizer_core.graph.rule_examples import Example
from tests.optimizer_core.graph.rule_examples._build import model


def _if(cond: int) -> Example:
    return Example(
        model=model(
            f"""c = Constant<value = bool {{{cond}}}>()
              r = If(c) <
                then_branch = t () => (float[2, 4] ty) {{ ty = Neg(xin) }},
                else_branch = e () => (float[2, 4] ey) {{ ey = Exp(xin) }}
              >
              y = Relu(r)"""
        )
    )


EXAMPLES: dict[tuple[str, str], Example] = {
    ("if-inline", "if-then"): _if(1),
    ("if-inline", "if-else"): _if(0),
}
