"""Attribute values that an op's definition constrains by its input's rank or by each other.

onnx's checker checks an attribute's type, not its value against the input: a ``Transpose``
whose ``perm`` is ``[0, 2, 2]``, or longer than the input's rank, passes it; onnxruntime refuses
the model when it creates a session, and a pass that reads the value may index past the axes.
graphtrim refuses such a model at load, with one line naming the node, the attribute and the
value. Checked, in the default domain, in every graph, subgraph and function body:

- ``Transpose`` ``perm``: a permutation of the input's axes;
- ``axis`` of ``Concat``, ``Gather``, ``GatherElements``, ``ScatterElements``, ``Split``,
  ``Softmax``, ``LogSoftmax``, ``Hardmax``, ``ArgMax``, ``ArgMin``, ``LayerNormalization`` and
  ``Compress``: in ``[-r, r)``; ``Flatten``: in ``[-r, r]``;
- ``axes`` of the reductions and ``Squeeze`` (the attribute, or a constant second input): in
  ``[-r, r)`` (an axis named twice is reduced or squeezed once), and a squeezed dim of known
  size is 1; ``Unsqueeze``: in the output's range ``[-(r + k), r + k)``, no axis twice;
- ``keepdims``, ``select_last_index`` and ``noop_with_empty_axes``: 0 or 1;
- ``Conv``, ``ConvTranspose`` and the pools: ``kernel_shape``, ``strides`` and ``dilations``
  one entry per spatial axis (``r - 2``) and at least 1, ``pads`` two per spatial axis and not
  negative.

Where a value's rank is unknown (no shape, even after onnx's inference), only the checks that
need no rank are made: a ``perm`` must still be a permutation, lengths must agree with each
other, flags must be 0 or 1.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import numpy as np
import onnx_ir as ir

from graphtrim.errors import InvalidModelError

# ops whose ``axis`` attribute names an axis of the first input: ``True`` when the range
# includes the rank itself (Flatten's axis may be r: everything in the first dimension)
_AXIS_OPS: dict[str, bool] = {
    "Concat": False,
    "Gather": False,
    "GatherElements": False,
    "ScatterElements": False,
    "Split": False,
    "Softmax": False,
    "LogSoftmax": False,
    "Hardmax": False,
    "ArgMax": False,
    "ArgMin": False,
    "LayerNormalization": False,
    "Compress": False,
    "Flatten": True,
}
_REDUCTIONS = frozenset(
    {
        "ReduceMean",
        "ReduceSum",
        "ReduceMax",
        "ReduceMin",
        "ReduceProd",
        "ReduceL1",
        "ReduceL2",
        "ReduceLogSum",
        "ReduceLogSumExp",
        "ReduceSumSquare",
    }
)
_FLAGS = ("keepdims", "select_last_index", "noop_with_empty_axes")
_WINDOWED = frozenset(
    {"Conv", "ConvTranspose", "ConvInteger", "QLinearConv", "MaxPool", "AveragePool", "LpPool"}
)


def _rank(value: ir.Value | None) -> int | None:
    if value is None:
        return None
    if value.shape is not None:
        return len(value.shape)
    if value.const_value is not None:
        return len(value.const_value.shape)
    return None


def _const_ints(value: ir.Value | None) -> list[int] | None:
    """A constant integer input (an initializer that is no graph input, or a ``Constant``)."""
    if value is None:
        return None
    tensor = value.const_value
    if tensor is not None and value.is_graph_input():
        return None  # the caller may feed another value
    if tensor is None:
        producer = value.producer()
        if (
            producer is None
            or producer.op_type != "Constant"
            or producer.domain not in ("", "ai.onnx")
        ):
            return None
        attr = producer.attributes.get("value")
        if attr is None or attr.type != ir.AttributeType.TENSOR:
            return None
        tensor = attr.as_tensor()
    try:
        array = np.asarray(tensor.numpy())
    except Exception:
        return None
    if array.dtype.kind not in "iu":
        return None
    return [int(v) for v in array.reshape(-1)]


def _ints(node: ir.Node, name: str) -> list[int] | None:
    attr = node.attributes.get(name)
    if attr is None or attr.is_ref() or attr.type != ir.AttributeType.INTS:
        return None
    return list(attr.as_ints())


def _int(node: ir.Node, name: str) -> int | None:
    attr = node.attributes.get(name)
    if attr is None or attr.is_ref() or attr.type != ir.AttributeType.INT:
        return None
    return int(attr.as_int())


def _in_range(
    axes: Sequence[int], r: int, *, inclusive: bool = False, distinct: bool = True
) -> str | None:
    top = r + 1 if inclusive else r
    bad = [a for a in axes if not -r <= a < top]
    if bad:
        hi = r if inclusive else r - 1
        return f"is outside [-{r}, {hi}] for an input of rank {r}"
    normalized = [a + r if a < 0 else a for a in axes]
    if distinct and len(set(normalized)) != len(normalized):
        return "names an axis twice"
    return None


def _perm_reason(perm: list[int], r: int | None) -> str | None:
    if r is not None and len(perm) != r:
        return f"has {len(perm)} entries for an input of rank {r}"
    if sorted(perm) != list(range(len(perm))):
        return "is not a permutation of the input's axes"
    return None


def _window_reasons(node: ir.Node, r: int | None) -> Iterator[tuple[str, list[int], str]]:
    kernel = _ints(node, "kernel_shape")
    spatial = r - 2 if r is not None and r >= 2 else (len(kernel) if kernel is not None else None)
    for name, low, per_axis in (
        ("kernel_shape", 1, 1),
        ("strides", 1, 1),
        ("dilations", 1, 1),
        ("pads", 0, 2),
    ):
        values = _ints(node, name)
        if values is None:
            continue
        if spatial is not None and len(values) != per_axis * spatial:
            whose = f"an input of rank {r}" if r is not None else f"a kernel of {spatial} axes"
            yield name, values, f"has {len(values)} entries for {whose}"
        elif any(v < low for v in values):
            yield name, values, f"has an entry below {low}"


def _reasons(node: ir.Node) -> Iterator[tuple[str, object, str]]:
    """``(attribute, value, what is wrong)`` for each attribute of ``node`` that breaks its op's
    rules."""
    op = node.op_type
    x = node.inputs[0] if node.inputs else None
    r = _rank(x)
    for flag in _FLAGS:
        value = _int(node, flag)
        if value is not None and value not in (0, 1):
            yield flag, value, "must be 0 or 1"
    if op == "Transpose":
        perm = _ints(node, "perm")
        if perm is not None:
            reason = _perm_reason(perm, r)
            if reason:
                yield "perm", perm, reason
    elif op in _AXIS_OPS:
        axis = _int(node, "axis")
        if axis is not None and r is not None:
            reason = _in_range([axis], r, inclusive=_AXIS_OPS[op])
            if reason:
                yield "axis", axis, reason
    elif op in _REDUCTIONS or op in ("Squeeze", "Unsqueeze"):
        from_input = len(node.inputs) > 1
        axes = _const_ints(node.inputs[1]) if from_input else _ints(node, "axes")
        name = "axes (input 1)" if from_input else "axes"
        if axes is not None:
            if op == "Unsqueeze":
                out_rank = r + len(axes) if r is not None else None
                if out_rank is not None:
                    reason = _in_range(axes, out_rank)
                    if reason:
                        yield name, axes, reason.replace("an input", "an output")
                elif len({a for a in axes if a >= 0}) != len([a for a in axes if a >= 0]):
                    yield name, axes, "names an axis twice"
            elif r is not None:
                # an axis named twice is reduced or squeezed once (onnxruntime runs it)
                reason = _in_range(axes, r, distinct=False)
                if reason:
                    yield name, axes, reason
                elif op == "Squeeze" and x is not None and x.shape is not None:
                    for a in axes:
                        dim = x.shape[a]
                        if isinstance(dim, int) and dim != 1:
                            yield name, axes, f"squeezes axis {a} of size {dim}"
                            break
    elif op in _WINDOWED and node.domain in ("", "ai.onnx"):
        for name, values, reason in _window_reasons(node, r):
            yield name, values, reason


def _graphs(graph: ir.Graph, where: str) -> Iterator[tuple[ir.Graph, str]]:
    yield graph, where
    for node in graph:
        for attr in node.attributes.values():
            if attr.is_ref():
                continue
            label = f"subgraph '{attr.name}' of node '{node.name or node.op_type}'"
            if attr.type == ir.AttributeType.GRAPH:
                yield from _graphs(attr.as_graph(), label)
            elif attr.type == ir.AttributeType.GRAPHS:
                for sub in attr.as_graphs():
                    yield from _graphs(sub, label)


def check_attributes(model: ir.Model, path: str | os.PathLike[str]) -> None:
    """Raise :class:`InvalidModelError` for the first attribute value that breaks its op's
    rules (see the module's docstring)."""
    scopes: list[tuple[ir.Graph | ir.Function, str]] = list(_graphs(model.graph, ""))
    for function in model.functions.values():
        where = f"function '{function.domain}:{function.name}'"
        scopes.append((function, where))
        for node in function:
            for attr in node.attributes.values():
                if not attr.is_ref() and attr.type == ir.AttributeType.GRAPH:
                    scopes.extend(_graphs(attr.as_graph(), where))
    for scope, where in scopes:
        inside = f" (in {where})" if where else ""
        for node in scope:
            if node.domain not in ("", "ai.onnx"):
                continue
            for name, value, reason in _reasons(node):
                label = (
                    f"{node.op_type} node '{node.name}'"
                    if node.name
                    else f"an unnamed {node.op_type}"
                )
                raise InvalidModelError.at(
                    path, f"{label}{inside}: attribute '{name}' is {value}, which {reason}"
                )
