"""Helpers shared by the transformer fusions' matchers (pass ``fuse-transformer``)."""

from __future__ import annotations

from typing import Protocol, cast

import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.passes._affine import one_constant
from graphtrim.graph.rules import RuleContext


class Fusion(Protocol):
    """What the matchers read of the pass (``TransformerFusion``)."""

    opset: int
    fixed_masks: dict[int, ir.Value]
    rotary_caches: dict[tuple[object, ...], tuple[ir.Value, ir.Value]]

    def new_name(self, hint: str) -> str: ...


FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE})


def fusion(ctx: RuleContext) -> Fusion:
    return cast(Fusion, ctx.pass_)


def scalar(value: ir.Value | None) -> float | None:
    arr = u.const_array(value)
    if arr is None or arr.size != 1 or arr.dtype.kind != "f":
        return None
    return float(arr.reshape(-1)[0])


def close(a: float | None, b: float, rel: float = 1e-4) -> bool:
    return a is not None and abs(a - b) <= rel * abs(b)


def split_const(node: ir.Node) -> tuple[ir.Value, ir.Value] | None:
    """(variable operand, constant operand) of a binary node with exactly one constant input
    (a constant first operand only for the commutative Mul and Add)."""
    found = one_constant(node)
    if found is None:
        return None
    variable, constant, index = found
    if index == 1 and node.op_type not in ("Mul", "Add"):
        return None
    return variable, constant


def producer(value: ir.Value | None, *ops: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    return node if node is not None and u.is_op(node, *ops) else None


def only_reader(value: ir.Value, reader: ir.Node) -> bool:
    return not value.is_graph_output() and all(user is reader for user, _ in value.uses())


def elem_type(value: ir.Value | None) -> ir.DataType | None:
    if value is None or value.type is None or not isinstance(value.type, ir.TensorType):
        return None
    return value.type.dtype


def sole_reader(value: ir.Value, op: str) -> ir.Node | None:
    if value.is_graph_output() or len(value.uses()) != 1:
        return None
    node = next(iter(value.uses()))[0]
    return node if u.is_op(node, op) else None


def other(node: ir.Node, value: ir.Value) -> ir.Value | None:
    return node.inputs[1] if node.inputs[0] is value else node.inputs[0]


def private(nodes: list[ir.Node], keep: ir.Value | None = None) -> bool:
    """No output of ``nodes`` but ``keep`` is a graph output or read outside ``nodes``."""
    ids = {id(n) for n in nodes}
    for n in nodes:
        for o in n.outputs:
            if o is keep:
                continue
            if o.is_graph_output() or any(id(user) not in ids for user, _ in o.uses()):
                return False
    return True
