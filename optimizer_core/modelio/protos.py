"""Walking an ONNX model proto's graphs: the graphs a node's attributes hold, and every graph or
node of a graph with those nested in it (depth first, each node before its subgraphs)."""

from __future__ import annotations

from collections.abc import Iterator

import onnx


def node_subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs ``node``'s attributes hold (a Loop's or Scan's body, an If's branches)."""
    out: list[onnx.GraphProto] = []
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            out.append(attr.g)
        elif attr.type == onnx.AttributeProto.GRAPHS:
            out.extend(attr.graphs)
    return out


def all_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every graph nested in it."""
    yield graph
    for node in graph.node:
        for sub in node_subgraphs(node):
            yield from all_graphs(sub)


def all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node of ``graph`` and of the graphs nested in it, each node before the nodes of its
    own subgraphs."""
    for node in graph.node:
        yield node
        for sub in node_subgraphs(node):
            yield from all_nodes(sub)
