"""Node order of what the converters write: onnxruntime's quantizer and float16 converter
append the nodes they add, so a model they write can read a value before its producer."""

from __future__ import annotations

from pathlib import Path

import onnx


def unsorted(graph: onnx.GraphProto, outer: frozenset[str] = frozenset()) -> bool:
    """Whether a node of ``graph`` (or of a subgraph) reads a value produced by a later node,
    directly or from inside one of its subgraphs."""
    produced = {o for n in graph.node for o in n.output if o}
    known = set(outer) | {i.name for i in graph.input} | {t.name for t in graph.initializer}

    def reads(node: onnx.NodeProto) -> set[str]:
        names = {i for i in node.input if i}
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                inner = {o for n in sub.node for o in n.output} | {i.name for i in sub.input}
                inner |= {t.name for t in sub.initializer}
                names |= {r for n in sub.node for r in reads(n)} - inner
        return names

    for node in graph.node:
        if any(name in produced and name not in known for name in reads(node)):
            return True
        known.update(node.output)
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                if unsorted(sub, frozenset(known)):
                    return True
    return False


def sorted_output(raw: Path) -> Path:
    """The converter's output with its nodes in topological order. onnxruntime's quantizer
    appends the nodes it adds, so a value that an ``If``/``Loop`` body reads from the outer
    graph can end up produced after that node; such a model is valid once sorted."""
    import onnx_ir as ir

    from graphtrim.modelio import save_model

    if not unsorted(onnx.load(str(raw), load_external_data=False).graph):
        return raw
    model = ir.load(str(raw))
    model.graph.sort()  # subgraphs too, with their reads from outer scopes as dependencies
    return save_model(model, raw.with_name("sorted.onnx"))[0]


def toposort(graph: onnx.GraphProto) -> None:
    """Order ``graph``'s nodes so every node follows its producers (the fp16 converter appends
    the casts it adds for the inputs at the end)."""
    available = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    pending = list(graph.node)
    ordered: list[onnx.NodeProto] = []
    outer_ok = set()
    for node in pending:  # names produced nowhere in this graph come from an outer scope
        outer_ok.update(node.input)
    produced = {o for n in pending for o in n.output}
    available |= outer_ok - produced
    while pending:
        rest = []
        for node in pending:
            if all(i in available for i in node.input):
                ordered.append(node)
                available.update(node.output)
            else:
                rest.append(node)
        if len(rest) == len(pending):  # a cycle: leave the remainder as it was
            ordered.extend(rest)
            break
        pending = rest
    copies = [onnx.NodeProto.FromString(n.SerializeToString()) for n in ordered]
    del graph.node[:]
    graph.node.extend(copies)
