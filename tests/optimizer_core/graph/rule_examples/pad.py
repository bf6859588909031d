"""Examples of the ``fuse-pad`` rules: a zero Pad of the spatial axes before its reader."""

from __future__ import annotations

import functools

from tests.optimizer_core.graph.rule_examples import Example
from tests.optimizer_core.graph.test_pad import _pad_model

EXAMPLES: dict[tuple[str, str], Example] = {
    ("fuse-pad", "pad-conv"): Example(model=_pad_model),
    ("fuse-pad", "pad-avgpool"): Example(
        model=functools.partial(
            _pad_model, reader="AveragePool", reader_attrs={"count_include_pad": 1}
        ),
    ),
    ("fuse-pad", "pad-maxpool"): Example(
        model=functools.partial(_pad_model, reader="MaxPool", before="Relu"),
    ),
}
