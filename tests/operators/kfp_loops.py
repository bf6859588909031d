"""A ``ParallelFor`` and the ``dsl.Collected`` of its outputs, as lightweight components, for
the test of what ``kfp.local`` does with a loop (tests/operators/test_kubeflow_local.py).

Without ``from __future__ import annotations``: KFP reads a component's types from its
annotations, in this process and again in the step's.
"""

from kfp import dsl


@dsl.component
def upper_item(x: str) -> str:
    return x.upper()


@dsl.component
def count_items(xs: list) -> str:
    return f"{len(xs)}:{','.join(xs)}"


@dsl.pipeline
def loop_then_collect(items: list) -> str:
    with dsl.ParallelFor(items) as item:
        each = upper_item(x=item)
    return count_items(xs=dsl.Collected(each.output)).output  # type: ignore[no-any-return]
