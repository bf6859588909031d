"""Opt-in opset upgrade, so that fusions into newer standard ops (Gelu, RMSNormalization) can fire.

The model is converted with onnx's version converter, which rewrites every node whose definition
changed between the two opsets (e.g. ReduceMean's axes from attribute to input). Weights stored as
external data stay where they are; weights inside the model are serialized once for the
conversion, which is why the upgrade runs only when asked for.
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx
import onnx.helper
import onnx.version_converter
import onnx_ir as ir

from graphtrim.errors import GraphtrimError
from graphtrim.graph import _ir_utils as u

# the lowest default-domain opset the passes are written for (older models pass through)
MIN_OPSET = 7


def passthrough_reason(
    opset_imports: Mapping[str, int], target_opset: int | None = None
) -> str | None:
    """Why the passes leave a valid model with these opset imports as it is, or ``None``.

    A model that imports no default-domain opset (only ``ai.onnx.ml``, say) has nothing the
    passes rewrite; one below :data:`MIN_OPSET` predates the op definitions they assume
    (unless ``target_opset`` raises it to a supported opset first). Such a model is written out
    unchanged, never refused.
    """
    default = opset_imports.get("", opset_imports.get("ai.onnx"))
    if default is None:
        imported = ", ".join(f"{d} {v}" for d, v in sorted(opset_imports.items())) or "none"
        return (
            f"the model imports no default-domain opset ({imported}); "
            "the passes rewrite default-domain ops only"
        )
    if default < MIN_OPSET and (target_opset is None or target_opset < MIN_OPSET):
        return f"opset {default} is below the lowest opset the passes support ({MIN_OPSET})"
    return None


def min_ir_version(opset: int) -> int:
    """The lowest IR version whose release defines ``opset`` of the default domain."""
    candidates = [ir_v for _, ir_v, op_v, *_ in onnx.helper.VERSION_TABLE if op_v >= opset]
    return min(candidates) if candidates else onnx.IR_VERSION


def upgrade_opset(model: ir.Model, target: int) -> tuple[ir.Model, str | None]:
    """``model`` converted to ``target`` of the default domain, and a note saying so.

    A model already at or above ``target`` is returned unchanged (the opset is never lowered).

    Raises:
        GraphtrimError: ``target`` is unknown to the installed onnx, or a node cannot be
            converted.
    """
    current = u.opset_version(model)
    if target <= current:
        return model, None
    newest = onnx.defs.onnx_opset_version()
    if target > newest:
        raise GraphtrimError(f"opset {target} is newer than this onnx knows ({newest})")
    proto = ir.serde.serialize_model(model)
    try:
        converted = onnx.version_converter.convert_version(proto, target)
    except Exception as exc:
        raise GraphtrimError(
            f"cannot raise the opset from {current} to {target}: {str(exc).splitlines()[0]}"
        ) from exc
    converted.ir_version = max(converted.ir_version, min_ir_version(target))
    upgraded = ir.serde.deserialize_model(converted)
    return upgraded, f"opset raised from {current} to {target} (IR version {converted.ir_version})"
