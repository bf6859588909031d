"""Loading and saving ONNX models safely.

``load_model`` rejects what cannot be optimized with a one-line ``InvalidModelError``: a missing
or empty file, bytes that are not an ONNX protobuf, a truncated file, external data that is
missing, too short, outside the model's folder or named with a NUL byte, opsets outside the
supported range, element types that name no ONNX type (a tensor's ``data_type``, a value's
type, ``Cast(to=...)`` and the other type-valued attributes) which onnx's checker lets through
and the passes would trip on, and attribute values an op's definition constrains by its input's
rank or by each other (a ``Transpose`` ``perm`` that is no permutation of the input's axes, an
axis out of range, ...), which the checker does not compare with the input.
External weights stay memory-mapped (``onnx_ir`` maps them lazily), so a model with several GB
of weights is never read into memory whole.

``save_model`` writes to a temporary folder beside the target and moves the files into place only
when everything was written, so a failure never leaves a half-written model behind. Such folders
(:func:`staging_dir`) carry the host and process that made them: one left by a process that was
killed is removed by the next write beside the same output.

The modules: :mod:`~graphtrim.modelio.load` (read, validate, deserialize),
:mod:`~graphtrim.modelio.external` (external data), :mod:`~graphtrim.modelio.guards` (what is
refused beyond onnx's checker), :mod:`~graphtrim.modelio.attributes` (attribute values against
the input's rank), :mod:`~graphtrim.modelio.protos` (walking a proto's nested graphs) and
:mod:`~graphtrim.modelio.save` (atomic writes and staging folders).
"""

from graphtrim.modelio.external import has_external_data
from graphtrim.modelio.guards import runtime_defined_ops
from graphtrim.modelio.load import (
    MAP_TYPES,
    ML_OUTPUT_TYPES,
    SHAPES_INFERRED,
    Validated,
    deserialize,
    input_files,
    load_model,
    max_opset,
    merged_shape,
    more_specific,
    read_proto,
    read_validated,
    restore_map_types,
    unknown_dim,
)
from graphtrim.modelio.save import (
    PROTO_LIMIT_BYTES,
    STALE_GRACE_SECONDS,
    initializer_bytes,
    publish_model,
    refuse_overwrite,
    remove_stale_staging,
    save_model,
    staging_dir,
)

__all__ = [
    "MAP_TYPES",
    "ML_OUTPUT_TYPES",
    "PROTO_LIMIT_BYTES",
    "SHAPES_INFERRED",
    "STALE_GRACE_SECONDS",
    "Validated",
    "deserialize",
    "has_external_data",
    "initializer_bytes",
    "input_files",
    "load_model",
    "max_opset",
    "merged_shape",
    "more_specific",
    "publish_model",
    "read_proto",
    "read_validated",
    "refuse_overwrite",
    "remove_stale_staging",
    "restore_map_types",
    "runtime_defined_ops",
    "save_model",
    "staging_dir",
    "unknown_dim",
]
