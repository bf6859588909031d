"""PyTorch-level simplification before export (opt-in: ``PipelineConfig.fx_simplify``).

The module is traced with ``torch.fx`` (an MLflow ``pt2`` model already is an fx
``GraphModule``); then dead code is eliminated and constant subgraphs are folded: every node
whose inputs are all parameters, buffers or constants is computed once and stored as an attribute
(``torch.fx.experimental.const_fold``). What cannot be traced (data-dependent control flow) is
exported as it is, with the reason in the export notes.

What it changes in the ONNX model, measured (``tests/optimizer_core/test_torch_simplify.py``):
nothing after graphtrim. On a module that scales a weight by a gain parameter and adds constant
tensors in ``forward`` (with dead code), fx folds 2 nodes and drops 1; the dynamo export has 2
nodes either way (it folds the same constants), the TorchScript export 3 without and 2 with, and
graphtrim brings both to 2. On a Conv/BatchNorm/Linear CNN there is nothing to fold: 4 nodes
exported and after graphtrim, with or without. The option remains for modules whose constant
arithmetic an exporter does not fold.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

logger = logging.getLogger("graphtrim.stages")


def fx_simplify(module: Any) -> tuple[Any, list[str]]:
    """``module`` with dead code removed and constant subgraphs folded, and notes saying what
    was done; the module itself (and why) when it cannot be traced."""
    import torch
    import torch.fx
    from torch.fx.experimental.const_fold import split_const_subgraphs

    notes: list[str] = []
    if isinstance(module, torch.fx.GraphModule):
        gm = module
    else:
        try:
            gm = torch.fx.symbolic_trace(module)
        except Exception as exc:
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            notes.append(
                f"fx simplification skipped: torch.fx cannot trace the module "
                f"({type(exc).__name__}: {first})"
            )
            logger.warning("%s", notes[-1])
            return module, notes
    before = len(gm.graph.nodes)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    dead = before - len(gm.graph.nodes)
    try:
        with warnings.catch_warnings():
            # const_fold's own bookkeeping warns about the attributes it is about to add
            warnings.simplefilter("ignore", UserWarning)
            folded = split_const_subgraphs(gm)
            folded.run_folding()
    except Exception as exc:
        notes.append(
            f"fx simplification: {dead} dead node(s) removed; constant folding skipped "
            f"({type(exc).__name__}: {str(exc)[:200]})"
        )
        logger.warning("%s", notes[-1])
        return gm, notes
    consts = 0
    if folded.const_subgraph_module is not None:
        compute = ("call_function", "call_method", "call_module")
        consts = sum(1 for n in folded.const_subgraph_module.graph.nodes if n.op in compute)
    notes.append(
        f"fx simplification: {dead} dead node(s) removed, {consts} constant node(s) folded"
    )
    return folded, notes
