"""Builders shared by the example modules."""

from __future__ import annotations

from collections.abc import Callable

import onnx

from tests.helpers import parse


def model(
    body: str, sig: str = "(float[2, 4] xin) => (float[2, 4] y)", inits: str = "", opset: int = 18
) -> Callable[[], onnx.ModelProto]:
    """A builder of the model ``g sig <inits> { body }`` (ONNX text) in the default domain."""
    init = f"<{inits}>" if inits else ""

    def build() -> onnx.ModelProto:
        return parse(
            f"""
            <ir_version: 8, opset_import: ["" : {opset}]>
            g {sig} {init} {{
              {body}
            }}
            """
        )

    return build
