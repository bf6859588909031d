"""Loading and saving ONNX models safely.

``load_model`` rejects what cannot be optimized with a one-line ``InvalidModelError``: a missing
or empty file, bytes that are not an ONNX protobuf, a truncated file, external data that is
missing, too short, outside the model's folder or named with a NUL byte, opsets outside the
supported range, and element types that name no ONNX type (a tensor's ``data_type``, a value's
type, ``Cast(to=...)`` and the other type-valued attributes) which onnx's checker lets through
and the passes would trip on.
External weights stay memory-mapped (``onnx_ir`` maps them lazily), so a model with several GB
of weights is never read into memory whole.

``save_model`` writes to a temporary folder beside the target and moves the files into place only
when everything was written, so a failure never leaves a half-written model behind. Such folders
(:func:`staging_dir`) carry the host and process that made them: one left by a process that was
killed is removed by the next write beside the same output.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from graphtrim import dtypes
from graphtrim.errors import GraphtrimError, InvalidModelError, first_line

# set in ``model.meta`` when the loader ran onnx shape inference on the model
SHAPES_INFERRED = "graphtrim.shapes_inferred"


def unknown_dim(dim: object) -> bool:
    """A dim nobody could name, or one onnx's inference could only name ``unk__<n>`` (its name
    for every dim it could not compute: a later run may compute it)."""
    if isinstance(dim, int):
        return False
    name = getattr(dim, "value", dim)
    return not name or (isinstance(name, str) and name.startswith("unk__"))


def merged_shape(new: ir.Shape | None, old: ir.Shape | None) -> ir.Shape | None:
    """``old`` with the dims ``new`` knows and ``old`` does not (a size, or a real name where
    ``old`` has none or only an ``unk__`` one); ``None`` when ``new`` adds nothing. The dims
    ``old`` knows stay, whatever ``new`` says of them: names the exporter gave are kept."""
    if new is None:
        return None
    if old is None:
        return new
    if len(new) != len(old):
        return None  # conflicting ranks: trust what the value already carries
    dims: list[int | str | ir.SymbolicDim | None] = []
    better = False
    for n, o in zip(new.dims, old.dims, strict=True):
        if unknown_dim(o) and not unknown_dim(n):
            dims.append(n if isinstance(n, int) else getattr(n, "value", n))
            better = True
        else:
            dims.append(o if isinstance(o, int) else getattr(o, "value", o))
    return ir.Shape(dims) if better else None


def more_specific(new: ir.Shape | None, old: ir.Shape | None) -> bool:
    """Whether ``new`` knows a dim ``old`` does not (see :func:`merged_shape`)."""
    return merged_shape(new, old) is not None


# protobuf refuses messages over 2 GiB; keep a margin for the graph itself
PROTO_LIMIT_BYTES = 1_800_000_000


def max_opset() -> int:
    return int(onnx.defs.onnx_opset_version())


def _external_tensors(proto: onnx.ModelProto):
    def graphs(g: onnx.GraphProto):
        yield g
        for node in g.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    yield from graphs(attr.g)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for sub in attr.graphs:
                        yield from graphs(sub)

    for g in graphs(proto.graph):
        for t in g.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                yield t
        for node in g.node:
            for attr in node.attribute:
                if (
                    attr.type == onnx.AttributeProto.TENSOR
                    and attr.t.data_location == onnx.TensorProto.EXTERNAL
                ):
                    yield attr.t


def _check_external_data(proto: onnx.ModelProto, path: Path) -> bool:
    """Refuse unsafe or inconsistent external data; True when the model has any."""
    base = _resolved(path.parent, path, InvalidModelError)
    found = False
    for tensor in _external_tensors(proto):
        found = True
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        if not location:
            raise InvalidModelError.at(
                path, f"tensor '{tensor.name}' has external data without a location"
            )
        if any(ord(c) < 32 for c in location):
            # a path with a NUL byte reaches no file (the OS refuses it); one with a newline
            # or another control character is no file name a model is saved with
            what = "a NUL byte" if "\x00" in location else "a control character"
            raise InvalidModelError.at(
                path,
                f"tensor '{tensor.name}' has {what} in its external data location {location!r}",
            )
        loc = Path(location)
        if loc.is_absolute() or ".." in loc.parts:
            raise InvalidModelError.at(
                path, f"tensor '{tensor.name}' points outside the model folder: '{location}'"
            )
        target = _resolved(base / loc, path, InvalidModelError)
        if os.path.commonpath([base, target]) != str(base):
            raise InvalidModelError.at(
                path,
                f"tensor '{tensor.name}' external data resolves outside the model folder: '{location}'",
            )
        if not target.is_file():
            raise InvalidModelError.at(
                path, f"external data file '{location}' of tensor '{tensor.name}' is missing"
            )
        offset = _external_int(info, "offset", tensor, path) or 0
        length = _external_int(info, "length", tensor, path)
        expected = _tensor_nbytes(tensor)
        if length is not None and expected is not None and length != expected:
            raise InvalidModelError.at(
                path,
                f"external data length {length} of tensor '{tensor.name}' does not match its "
                f"shape and type ({expected} bytes)",
            )
        needed = length if length is not None else expected
        size = target.stat().st_size
        if needed is not None and offset + needed > size:
            raise InvalidModelError.at(
                path,
                f"external data file '{location}' is too short for tensor '{tensor.name}' "
                f"(needs {offset + needed} bytes, has {size})",
            )
    return found


# bytes per element of the fixed-width types (sub-byte and string types are not checked)
_ITEMSIZE: dict[int, int] = {
    onnx.TensorProto.FLOAT: 4,
    onnx.TensorProto.DOUBLE: 8,
    onnx.TensorProto.FLOAT16: 2,
    onnx.TensorProto.BFLOAT16: 2,
    onnx.TensorProto.INT8: 1,
    onnx.TensorProto.INT16: 2,
    onnx.TensorProto.INT32: 4,
    onnx.TensorProto.INT64: 8,
    onnx.TensorProto.UINT8: 1,
    onnx.TensorProto.UINT16: 2,
    onnx.TensorProto.UINT32: 4,
    onnx.TensorProto.UINT64: 8,
    onnx.TensorProto.BOOL: 1,
    onnx.TensorProto.COMPLEX64: 8,
    onnx.TensorProto.COMPLEX128: 16,
}


def _tensor_nbytes(tensor: onnx.TensorProto) -> int | None:
    itemsize = _ITEMSIZE.get(tensor.data_type)
    if itemsize is None or any(d < 0 for d in tensor.dims):
        return None
    return math.prod(tensor.dims) * itemsize


def _external_int(
    info: dict[str, str], key: str, tensor: onnx.TensorProto, path: Path
) -> int | None:
    raw = info.get(key)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise InvalidModelError.at(
            path, f"tensor '{tensor.name}' has an invalid external data {key}: '{raw}'"
        )
    return value


_DATA_TYPES = frozenset(
    int(v) for v in ir.DataType if int(v) in onnx.TensorProto.DataType.values()
) - {onnx.TensorProto.UNDEFINED}

# integer attributes that name an element type, by op (default domain); True: 0 means "not
# given" (the op picks the type), False: the value must name a type
_TYPE_ATTRIBUTES: dict[str, dict[str, bool]] = {
    "Cast": {"to": False},
    "EyeLike": {"dtype": False},
    "RandomNormal": {"dtype": False},
    "RandomUniform": {"dtype": False},
    "RandomNormalLike": {"dtype": False},
    "RandomUniformLike": {"dtype": False},
    "Multinomial": {"dtype": False},
    "Bernoulli": {"dtype": False},
    "QuantizeLinear": {"output_dtype": True},
    "DequantizeLinear": {"output_dtype": True},
}


def _graphs_with_functions(proto: onnx.ModelProto):
    """Every graph of the model (subgraphs included) and every function body, as
    ``(where, nodes, graph or None)``."""

    def graphs(g: onnx.GraphProto, where: str):
        yield where, g.node, g
        for node in g.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    yield from graphs(attr.g, f"subgraph '{attr.name}' of node '{node.name}'")
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for sub in attr.graphs:
                        yield from graphs(sub, f"subgraph '{attr.name}' of node '{node.name}'")

    yield from graphs(proto.graph, "")
    for fn in proto.functions:
        yield f"function '{fn.domain}:{fn.name}'", fn.node, None


def _type_elem_types(tp: onnx.TypeProto):
    """The element types a value type names (tensors inside sequences, maps and optionals)."""
    kind = tp.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        yield getattr(tp, kind).elem_type
    elif kind == "sequence_type":
        yield from _type_elem_types(tp.sequence_type.elem_type)
    elif kind == "optional_type":
        yield from _type_elem_types(tp.optional_type.elem_type)
    elif kind == "map_type":
        yield tp.map_type.key_type
        yield from _type_elem_types(tp.map_type.value_type)


def _check_types(proto: onnx.ModelProto, path: Path) -> None:
    """Refuse element types that name no ONNX type.

    onnx's checker accepts any integer in ``Cast(to=...)``, a tensor's ``data_type`` and the
    other type-valued attributes; deserializing such a tensor or running a pass that reads the
    type then fails deep inside (``-1 is not a valid DataType``), an internal error for what
    is a broken input. One walk over the nodes and tensors, no weights read."""

    def bad(value: int) -> bool:
        return value not in _DATA_TYPES

    def tensor(t: onnx.TensorProto, what: str) -> None:
        if bad(t.data_type):
            raise InvalidModelError.at(
                path, f"{what} has data type {t.data_type}, which is no ONNX element type"
            )

    for where, nodes, graph in _graphs_with_functions(proto):
        inside = f" (in {where})" if where else ""
        if graph is not None:
            for t in graph.initializer:
                tensor(t, f"initializer '{t.name}'{inside}")
            for sp in graph.sparse_initializer:
                tensor(sp.values, f"sparse initializer '{sp.values.name}'{inside}")
            for vi in [*graph.input, *graph.output, *graph.value_info]:
                for elem in _type_elem_types(vi.type):
                    # 0: the type is not known (yet); the checker judges where it must be
                    if elem and bad(elem):
                        raise InvalidModelError.at(
                            path,
                            f"value '{vi.name}'{inside} has element type {elem}, which is "
                            "no ONNX element type",
                        )
        for node in nodes:
            label = (
                f"{node.op_type} node '{node.name}'" if node.name else f"an unnamed {node.op_type}"
            ) + inside
            typed = _TYPE_ATTRIBUTES.get(node.op_type, {}) if node.domain in ("", "ai.onnx") else {}
            for attr in node.attribute:
                if attr.ref_attr_name:
                    continue  # in a function body: the value comes from the calling node
                if attr.type == onnx.AttributeProto.TENSOR:
                    tensor(attr.t, f"attribute '{attr.name}' of {label}")
                elif attr.type == onnx.AttributeProto.TENSORS:
                    for t in attr.tensors:
                        tensor(t, f"attribute '{attr.name}' of {label}")
                elif attr.type == onnx.AttributeProto.SPARSE_TENSOR:
                    tensor(attr.sparse_tensor.values, f"attribute '{attr.name}' of {label}")
                elif attr.name in typed and attr.type == onnx.AttributeProto.INT:
                    if attr.i == 0 and typed[attr.name]:
                        continue
                    if bad(attr.i):
                        raise InvalidModelError.at(
                            path,
                            f"attribute '{attr.name}' of {label} is {attr.i}, which is no ONNX "
                            "element type",
                        )


def read_proto(path: str | os.PathLike[str]) -> onnx.ModelProto:
    """Parse and validate the model's protobuf without loading external data."""
    return _read_validated(path)[0]


@dataclasses.dataclass
class Validated:
    """A model file read and validated once: its protobuf (external data not loaded), the file's
    bytes and whether it has external data. :func:`load_model` takes it instead of reading the
    file again, and releases the bytes once it has inferred the shapes."""

    path: Path
    proto: onnx.ModelProto
    data: bytes
    external: bool


def read_validated(path: str | os.PathLike[str]) -> Validated:
    """:func:`read_proto` that keeps what :func:`load_model` needs, so a caller that looks at
    the protobuf before loading the model reads and checks the file once."""
    proto, data, external = _read_validated(path)
    return Validated(Path(path), proto, data, external)


def _read_validated(path: str | os.PathLike[str]) -> tuple[onnx.ModelProto, bytes, bool]:
    """The parsed and validated model, the file's bytes and whether it has external data.

    onnx's checker and shape inference work on serialized bytes; handing them the file's own
    bytes saves serializing the parsed model again (several times the cost of the check)."""
    p = Path(path)
    if not p.exists():
        raise InvalidModelError.at(p, "no such file")
    if not p.is_file():
        raise InvalidModelError.at(p, "not a regular file")
    if p.stat().st_size == 0:
        raise InvalidModelError.at(p, "empty file")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise InvalidModelError.at(p, f"cannot read the file: {exc.strerror or exc}") from exc
    try:
        proto = onnx.ModelProto.FromString(data)
    except (DecodeError, RuntimeError, ValueError, UnicodeDecodeError) as exc:
        raise InvalidModelError.at(p, f"not an ONNX model (protobuf parse failed: {exc})") from exc
    if proto.ir_version <= 0 or (not proto.graph.node and not proto.graph.output):
        raise InvalidModelError.at(p, "not an ONNX model (no IR version or empty graph)")
    # a model without a default-domain opset (only ai.onnx.ml, say) or older than the passes
    # support (graph.opset.MIN_OPSET) is valid: it is checked like any other and optimize writes
    # it out unchanged (graph.opset.passthrough_reason); one newer than this onnx is refused
    opsets = {o.domain or "": o.version for o in proto.opset_import}
    default = opsets.get("", opsets.get("ai.onnx"))
    if default is not None and not 1 <= default <= max_opset():
        raise InvalidModelError.at(
            p, f"unsupported opset {default}: graphtrim reads opsets 1 to {max_opset()}"
        )
    external = _check_external_data(proto, p)
    _check_types(proto, p)
    try:
        # with external data, check the file: the checker resolves data locations against the
        # model's folder only when it knows the path
        onnx.checker.check_model(str(p) if external else data)
    except onnx.checker.ValidationError as exc:
        first = first_line(exc)
        if "topologically sorted" in first and _sort_nodes(proto.graph):
            # onnxruntime runs nodes in any order that respects their inputs (onnxruntime's own
            # fp16 converter appends its input Casts last): read the nodes in such an order
            data = proto.SerializeToString()
            try:
                onnx.checker.check_model(str(p) if external else data)
                return proto, data, external
            except onnx.checker.ValidationError as again:
                exc = again
                first = first_line(exc)
        if "No Op registered for" in first:
            # an op onnxruntime defines is no fault: what the checker says without them is
            left = _check_runtime_ops(proto)
            if left is None:
                return proto, data, external
            first = left or first
        raise InvalidModelError.at(p, f"invalid model: onnx's checker refuses it: {first}") from exc
    return proto, data, external


_RUNTIME_DOMAIN = "graphtrim.runtime-defined"


def _check_runtime_ops(proto: onnx.ModelProto) -> str | None:
    """onnx's checker on the model with the default-domain ops onnx does not define but
    onnxruntime does (``SimplifiedLayerNormalization``, as onnxruntime-genai's model builder
    and onnxruntime's transformer optimizer write it) left unchecked, as the checker leaves ops
    of other domains: None when it passes, else its first complaint ("" when there is no such
    op to leave out). An op that neither defines is still refused."""
    opsets = {o.domain or "": o.version for o in proto.opset_import}
    version = opsets.get("", opsets.get("ai.onnx"))
    if version is None:
        return ""
    runtime = runtime_defined_ops(version)
    moved = 0
    copy_ = onnx.ModelProto()
    copy_.CopyFrom(proto)  # data that is external stays out of the copy
    graphs = [copy_.graph]
    while graphs:
        graph = graphs.pop()
        for tensor in graph.initializer:
            _drop_external(tensor)  # checked already (_check_external_data); bytes lack a folder
        for node in graph.node:
            if node.domain in ("", "ai.onnx") and node.op_type in runtime:
                if not onnx.defs.has(node.op_type, ""):
                    node.domain = _RUNTIME_DOMAIN
                    moved += 1
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    _drop_external(attr.t)
                graphs.extend([attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs)
    if not moved:
        return ""
    copy_.opset_import.add(domain=_RUNTIME_DOMAIN, version=1)
    try:
        onnx.checker.check_model(copy_.SerializeToString())
    except onnx.checker.ValidationError as exc:
        return first_line(exc)
    return None


def _drop_external(tensor: onnx.TensorProto) -> None:
    """Make an external tensor a one-element inline one, for a check that has no folder."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return
    del tensor.external_data[:]
    del tensor.dims[:]
    tensor.data_location = onnx.TensorProto.DEFAULT
    tensor.raw_data = bytes(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize)


def runtime_defined_ops(version: int) -> frozenset[str]:
    """The default-domain ops onnxruntime defines at opset ``version`` (its schemas include
    ops onnx does not have, such as ``SimplifiedLayerNormalization``); empty without
    onnxruntime."""
    try:
        from onnxruntime.capi.onnxruntime_pybind11_state import get_all_operator_schema
    except ImportError:
        return frozenset()
    return frozenset(
        s.name
        for s in get_all_operator_schema()
        if s.domain in ("", "ai.onnx") and s.since_version <= version
    )


def _outer_names(graph: onnx.GraphProto) -> set[str]:
    """Names a subgraph reads from its enclosing scopes."""
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    read: set[str] = set()
    for node in graph.node:
        read.update(n for n in node.input if n)
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                read |= _outer_names(sub)
        defined.update(node.output)
    read.update(o.name for o in graph.output)
    return read - defined


def _sort_nodes(graph: onnx.GraphProto) -> bool:
    """Order the main graph's nodes so that each comes after the producers of what it reads
    (subgraphs' reads of outer values included); False when no such order exists (a cycle, or
    a value nothing produces)."""
    available = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    produced = {o for node in graph.node for o in node.output}
    needs: list[set[str]] = []
    for node in graph.node:
        wanted = set(node.input)
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                wanted |= _outer_names(sub) & produced
        needs.append(wanted - available)
    order: list[int] = []
    ready = [i for i, n in enumerate(needs) if not n]
    waiting = {i for i, n in enumerate(needs) if n}
    readers: dict[str, list[int]] = {}
    for i in waiting:
        for name in needs[i]:
            readers.setdefault(name, []).append(i)
    while ready:
        i = ready.pop(0)
        order.append(i)
        for out in graph.node[i].output:
            for j in readers.pop(out, []):
                needs[j].discard(out)
                if not needs[j] and j in waiting:
                    waiting.discard(j)
                    ready.append(j)
    if waiting:
        return False
    sorted_nodes = [onnx.NodeProto() for _ in order]
    for target, i in zip(sorted_nodes, order, strict=True):
        target.CopyFrom(graph.node[i])
    del graph.node[:]
    graph.node.extend(sorted_nodes)
    return True


# graph inputs and outputs whose type has a map in it (``ai.onnx.ml`` classifiers' ZipMap:
# ``seq(map(int64, float))``): onnx_ir cannot represent map types, so such a value is read with a
# stand-in type and its real type is written back on save (graph input/output name -> TypeProto)
MAP_TYPES = "graphtrim.map_types"


def _has_map(tp: onnx.TypeProto) -> bool:
    kind = tp.WhichOneof("value")
    if kind == "map_type":
        return True
    if kind == "sequence_type":
        return _has_map(tp.sequence_type.elem_type)
    if kind == "optional_type":
        return _has_map(tp.optional_type.elem_type)
    return False


def _stand_in(tp: onnx.TypeProto) -> onnx.TypeProto:
    """The same type with each map(K, V) replaced by V (a tensor type onnx_ir reads)."""
    kind = tp.WhichOneof("value")
    out = onnx.TypeProto()
    if kind == "map_type":
        out.CopyFrom(_stand_in(tp.map_type.value_type))
    elif kind == "sequence_type":
        out.sequence_type.elem_type.CopyFrom(_stand_in(tp.sequence_type.elem_type))
    elif kind == "optional_type":
        out.optional_type.elem_type.CopyFrom(_stand_in(tp.optional_type.elem_type))
    else:
        out.CopyFrom(tp)
    return out


def deserialize(proto: onnx.ModelProto) -> ir.Model:
    """``ir.serde.deserialize_model`` that also reads models with map-typed values: the main
    graph's map-typed inputs and outputs get a stand-in type (their real types are kept in
    ``model.meta[MAP_TYPES]`` and restored by :func:`save_model`), map-typed ``value_info``
    entries are dropped (they are hints; inference finds them again)."""
    graph = proto.graph
    saved: dict[str, onnx.TypeProto] = {}
    if any(_has_map(vi.type) for vi in (*graph.input, *graph.output, *graph.value_info)):
        proto = copy.copy(proto)  # shallow: the caller's proto is not changed
        proto.graph.CopyFrom(graph)
        for vi in (*proto.graph.input, *proto.graph.output):
            if _has_map(vi.type):
                saved[vi.name] = copy.deepcopy(vi.type)
                vi.type.CopyFrom(_stand_in(vi.type))
        kept = [vi for vi in proto.graph.value_info if not _has_map(vi.type)]
        del proto.graph.value_info[:]
        proto.graph.value_info.extend(kept)
    model = ir.serde.deserialize_model(proto)
    if saved:
        model.meta[MAP_TYPES] = saved
    return model


def restore_map_types(proto: onnx.ModelProto, saved: dict[str, onnx.TypeProto]) -> None:
    """Give the main graph's inputs and outputs back the map types :func:`deserialize` replaced."""
    for vi in (*proto.graph.input, *proto.graph.output):
        if vi.name in saved:
            vi.type.CopyFrom(saved[vi.name])


def load_model(path: str | os.PathLike[str], validated: Validated | None = None) -> ir.Model:
    """Load a validated model into ``onnx_ir``; external data stays memory-mapped.

    ``validated``: the file as :func:`read_validated` read it (then the file is not read again;
    its bytes are released here)."""
    if validated is not None and validated.path == Path(path) and validated.data:
        proto, data, external = validated.proto, validated.data, validated.external
        validated.data = b""
    else:
        proto, data, external = _read_validated(path)
    # inferring on the protobuf (weights not loaded) is far cheaper than on the IR later;
    # it is an aid only: custom ops and odd models load without it
    inferred: dict[str, onnx.TypeProto] = {}
    ran = False
    with contextlib.suppress(Exception):
        light = _without_weights(proto)
        result = onnx.shape_inference.infer_shapes(
            data if light is None else light.SerializeToString(),
            check_type=False,
            strict_mode=False,
            data_prop=True,
        )
        inferred = {vi.name: vi.type for vi in result.graph.value_info}
        ran = True
    del data
    model = deserialize(proto)
    _apply_inferred_types(model.graph, inferred)
    _apply_ml_types(model.graph)
    if ran and not _has_subgraphs(proto.graph):
        # what inference could not find now it will not find before a pass changes the graph
        model.meta[SHAPES_INFERRED] = True
    if external:
        ir.external_data.set_base_dir(model.graph, os.path.dirname(os.path.abspath(path)))
    return model


def _inference_reads(tensor: onnx.TensorProto) -> bool:
    """Whether onnx's inference may need this initializer's values: small ones, and integer
    ones up to 64 KiB (shapes, indices, axes). Weights only lend it their type."""
    size = math.prod(tensor.dims) * _ITEMSIZE.get(tensor.data_type, 8)
    if size <= 1024:
        return True
    return tensor.data_type in _INTEGER_TYPES and size <= 64 * 1024


_ITEMSIZE = {
    onnx.TensorProto.FLOAT: 4,
    onnx.TensorProto.DOUBLE: 8,
    onnx.TensorProto.FLOAT16: 2,
    onnx.TensorProto.BFLOAT16: 2,
    onnx.TensorProto.INT8: 1,
    onnx.TensorProto.UINT8: 1,
    onnx.TensorProto.INT16: 2,
    onnx.TensorProto.UINT16: 2,
    onnx.TensorProto.INT32: 4,
    onnx.TensorProto.UINT32: 4,
    onnx.TensorProto.INT64: 8,
    onnx.TensorProto.UINT64: 8,
    onnx.TensorProto.BOOL: 1,
}
_INTEGER_TYPES = {
    onnx.TensorProto.INT8,
    onnx.TensorProto.UINT8,
    onnx.TensorProto.INT16,
    onnx.TensorProto.UINT16,
    onnx.TensorProto.INT32,
    onnx.TensorProto.UINT32,
    onnx.TensorProto.INT64,
    onnx.TensorProto.UINT64,
}


def _copy_fields(src: Any, dst: Any, skip: str) -> None:
    for field, value in src.ListFields():
        if field.name == skip:
            continue
        if field.is_repeated:
            getattr(dst, field.name).extend(value)
        elif field.message_type is not None:
            getattr(dst, field.name).CopyFrom(value)
        else:
            setattr(dst, field.name, value)


def _without_weights(proto: onnx.ModelProto) -> onnx.ModelProto | None:
    """``proto`` for onnx's inference without the bytes of its weights: each initializer that
    inference only needs the type of becomes a graph input of that type (the main graph's; a
    model of hundreds of MB is then not copied into inference and out again). ``None`` when
    there is none to leave out (or the model keeps sparse initializers)."""
    graph = proto.graph
    if graph.sparse_initializer or all(_inference_reads(t) for t in graph.initializer):
        return None
    light = onnx.ModelProto()
    _copy_fields(proto, light, skip="graph")
    _copy_fields(graph, light.graph, skip="initializer")
    inputs = {i.name for i in graph.input}
    for tensor in graph.initializer:
        if _inference_reads(tensor):
            light.graph.initializer.append(tensor)
        elif tensor.name not in inputs:
            light.graph.input.append(
                onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims)
            )
    return light


def _has_subgraphs(graph: onnx.GraphProto) -> bool:
    return any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
        for n in graph.node
        for a in n.attribute
    )


# ai.onnx.ml ops whose output type the spec fixes but onnx's inference does not report:
# op -> {output position: element type}
_ML_FLOAT = ir.DataType.FLOAT
ML_OUTPUT_TYPES: dict[str, dict[int, ir.DataType]] = {
    "Scaler": {0: _ML_FLOAT},
    "Normalizer": {0: _ML_FLOAT},
    "FeatureVectorizer": {0: _ML_FLOAT},
    "OneHotEncoder": {0: _ML_FLOAT},
    "LinearRegressor": {0: _ML_FLOAT},
    "SVMRegressor": {0: _ML_FLOAT},
    "TreeEnsembleRegressor": {0: _ML_FLOAT},
    "LinearClassifier": {1: _ML_FLOAT},
    "SVMClassifier": {1: _ML_FLOAT},
    "TreeEnsembleClassifier": {1: _ML_FLOAT},
}


def _apply_ml_types(graph: ir.Graph) -> None:
    """Give ``ai.onnx.ml`` outputs the element type their op's definition fixes, where nothing
    else gave them one (a Cast to float after a Scaler is then seen to be a no-op)."""
    for node in graph:
        if node.domain != "ai.onnx.ml":
            continue
        for pos, dtype in ML_OUTPUT_TYPES.get(node.op_type, {}).items():
            if pos < len(node.outputs) and node.outputs[pos].type is None:
                node.outputs[pos].type = ir.TensorType(dtype)


def _apply_inferred_types(graph: ir.Graph, inferred: dict[str, onnx.TypeProto]) -> None:
    """Give the main graph's node outputs their inferred tensor types, and shapes where the
    inferred shape says more than the declared one.

    Done directly on the IR rather than by deserializing ``value_info`` entries, which costs
    several times more per value; non-tensor types are left to later inference."""
    if not inferred:
        return
    for node in graph:
        for out in node.outputs:
            tp = inferred.get(out.name or "")
            if tp is None or tp.WhichOneof("value") != "tensor_type":
                continue
            tt = tp.tensor_type
            if not tt.elem_type:
                continue
            if out.type is None:
                out.type = ir.TensorType(ir.DataType(tt.elem_type))
            old = out.shape
            if not tt.HasField("shape") or (old is not None and old.is_static()):
                continue
            new = ir.Shape(
                [
                    d.dim_value
                    if d.HasField("dim_value")
                    else (d.dim_param if d.HasField("dim_param") else None)
                    for d in tt.shape.dim
                ]
            )
            merged = merged_shape(new, old)
            if merged is not None:
                out.shape = merged


def has_external_data(model: ir.Model) -> bool:
    return any(
        isinstance(v.const_value, ir.ExternalTensor)
        for g in model.graphs()
        for v in g.initializers.values()
    )


def initializer_bytes(model: ir.Model) -> int:
    return sum(
        dtypes.tensor_nbytes(v.const_value)
        for g in model.graphs()
        for v in g.initializers.values()
        if v.const_value is not None
    )


# a staging folder of a dead process is left alone this long after its last change: a
# process on another machine that shares the folder and the host name (a container
# started from the same image) may still be writing it
STALE_GRACE_SECONDS = 60.0
_STAGING = ".staging."


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64] or "host"


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a process id this module wrote: never someone else's to remove
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # it exists, under another user
    return True


def remove_stale_staging(target: str | os.PathLike[str]) -> list[Path]:
    """Remove the staging folders beside ``target`` that a process of this host left when it
    was killed: named for ``target`` (``.<name>.staging.<host>.<pid>.<random>``), made by a
    process that no longer exists, unchanged for :data:`STALE_GRACE_SECONDS`. Folders of live
    processes, of other hosts and of other outputs stay. Returns what was removed."""
    t = Path(target)
    prefix = f".{t.name}{_STAGING}"
    host = _host()
    removed: list[Path] = []
    try:
        entries = list(os.scandir(t.parent))
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        parts = entry.name[len(prefix) :].split(".")
        if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
            continue
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            if now - entry.stat(follow_symlinks=False).st_mtime < STALE_GRACE_SECONDS:
                continue
        except OSError:
            continue
        if _pid_alive(int(parts[1])):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        if not os.path.lexists(entry.path):
            removed.append(Path(entry.path))
    return removed


def staging_dir(target: str | os.PathLike[str]) -> Path:
    """A new hidden folder beside ``target`` to build it in, named
    ``.<name>.staging.<host>.<pid>.<random>``; stale ones a killed process left for the same
    ``target`` are removed first (:func:`remove_stale_staging`). The caller removes it."""
    t = Path(target)
    t.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(t)
    return Path(
        tempfile.mkdtemp(prefix=f".{t.name}{_STAGING}{_host()}.{os.getpid()}.", dir=t.parent)
    )


def save_model(
    model: ir.Model, path: str | os.PathLike[str], *, external_data: bool | None = None
) -> list[Path]:
    """Write ``model`` atomically; returns the files written.

    With ``external_data=None`` weights go to ``<name>.data`` beside the model when the model
    had external data or would not fit into one protobuf.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if external_data is None:
        external_data = has_external_data(model) or initializer_bytes(model) > PROTO_LIMIT_BYTES
    data_name = f"{target.name}.data"
    tmpdir = staging_dir(target)
    try:
        tmp_model = tmpdir / target.name
        if external_data:
            ir.save(model, tmp_model, external_data=data_name, size_threshold_bytes=1024)
        else:
            _save_inline(model, tmp_model)
        written = [target]
        tmp_data = tmpdir / data_name
        if tmp_data.exists() and tmp_data.stat().st_size > 0:
            os.replace(tmp_data, target.parent / data_name)
            written.append(target.parent / data_name)
        else:
            # a data file left by an earlier save under this name no longer belongs to the model
            (target.parent / data_name).unlink(missing_ok=True)
        if model.meta.get(MAP_TYPES):
            saved = onnx.load(str(tmp_model), load_external_data=False)
            restore_map_types(saved, model.meta[MAP_TYPES])
            onnx.save(saved, str(tmp_model))
        os.replace(tmp_model, target)
        return written
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


_STREAMED_BYTES = 64 * 1024  # initializers larger than this are written by _save_inline itself


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _len_field(number: int, length: int) -> bytes:
    """The key and length of a length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(length)


# protobuf field numbers (onnx.proto): ModelProto.graph, GraphProto.initializer,
# TensorProto.raw_data
_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_RAW_DATA = 7, 5, 9


def _save_inline(model: ir.Model, path: Path) -> None:
    """``model`` as one protobuf file, its large weights written straight from their buffers.

    Serializing a model of hundreds of MB through protobuf copies every weight twice and costs
    seconds; here the model is serialized without its large main-graph initializers and each
    of them is appended as a ``GraphProto.initializer`` field by hand (protobuf fields may come
    in any order, repeated ones are appended), its bytes written from the tensor's own
    buffer. Strings and tensors onnx_ir does not hold as raw bytes go the usual way."""
    graph = model.graph
    kept = list(graph.initializers.items())
    big = [
        v
        for _, v in kept
        if v.const_value is not None
        and v.const_value.dtype != ir.DataType.STRING
        and dtypes.tensor_nbytes(v.const_value) > _STREAMED_BYTES
        and not isinstance(v.const_value, ir.ExternalTensor)
    ]
    if not big:
        ir.save(model, path)
        return
    tensors = {id(v): v.const_value for v in big}
    for v in big:
        graph.initializers.pop(v.name or "")
    try:
        proto = ir.serde.serialize_model(model)
    finally:
        graph.initializers.clear()
        for _, v in kept:
            graph.initializers[v.name or ""] = v
    # the skeleton's initializers are there already; the large ones follow
    pieces: list[tuple[bytes, Any]] = []
    for v in big:
        tensor = tensors[id(v)]
        assert tensor is not None
        meta = onnx.TensorProto(
            name=v.name or "",
            dims=list(tensor.shape.numpy()),
            data_type=int(tensor.dtype),
        )
        if tensor.doc_string:
            meta.doc_string = tensor.doc_string
        for key, value in tensor.metadata_props.items():
            meta.metadata_props.add(key=key, value=value)
        raw = tensor.tobytes()
        head = meta.SerializeToString() + _len_field(_TENSOR_RAW_DATA, len(raw))
        pieces.append((head, raw))
    # the value infos serde gives initializers (their type and shape), as it would have
    inputs = {v.name for v in graph.inputs}
    for v in big:
        described = v.shape is not None or v.type is not None or v.metadata_props or v.doc_string
        if described and v.name not in inputs:
            proto.graph.value_info.append(ir.serde.serialize_value(v))
    graph_bytes = proto.graph.SerializeToString()
    proto.ClearField("graph")
    graph_len = len(graph_bytes) + sum(
        len(_len_field(_GRAPH_INITIALIZER, len(h) + len(r))) + len(h) + len(r) for h, r in pieces
    )
    with open(path, "wb") as f:
        f.write(proto.SerializeToString())
        f.write(_len_field(_MODEL_GRAPH, graph_len))
        f.write(graph_bytes)
        for head, raw in pieces:
            f.write(_len_field(_GRAPH_INITIALIZER, len(head) + len(raw)))
            f.write(head)
            f.write(raw)


def input_files(path: str | os.PathLike[str], proto: onnx.ModelProto | None = None) -> list[Path]:
    """The files the model at ``path`` reads: the model file and every external data file any
    tensor names, in any graph or subgraph and in ``Constant`` attributes."""
    p = Path(path)
    if proto is None:
        proto = read_proto(p)
    files = [p]
    for tensor in _external_tensors(proto):
        for entry in tensor.external_data:
            if entry.key == "location":
                f = p.parent / entry.value
                if f not in files:
                    files.append(f)
    return files


def _resolved(path: Path, what: Path, error: type[GraphtrimError] = GraphtrimError) -> Path:
    """``path`` with its links resolved; a symlink loop (or a path the OS refuses) is an error
    naming ``what``, not a traceback."""
    try:
        return path.resolve()
    except (RuntimeError, OSError) as exc:  # RuntimeError: "Symlink loop from ..."
        named = f" (named by {what})" if what != path else ""
        raise error(f"cannot resolve {path}{named}: {exc}") from exc


def _same_file(a: Path, b: Path) -> bool:
    """``a`` and ``b`` are one file: the same path after links are resolved, or the same inode
    (a hard link, another case of the name on a case-insensitive file system)."""
    if _resolved(a, a) == _resolved(b, b):
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def refuse_overwrite(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], proto: onnx.ModelProto | None = None
) -> None:
    """Refuse an output ``dst`` whose model file or data file (``<name>.data``) is, or aliases
    through a link or a case-insensitive name, any file the input model reads: writing it
    would destroy the input. Raises :class:`InvalidModelError` naming both."""
    inputs = input_files(src, proto)
    target = Path(dst)
    for out in (target, target.with_name(target.name + ".data")):
        for used in inputs:
            if _same_file(out, used):
                raise InvalidModelError(
                    f"output {out} would overwrite the input ({used}, read by {src}); "
                    "choose another output path"
                )


def publish_model(built: Path, target: Path) -> None:
    """Move a finished model file (and its ``.data`` file) over ``target``, data first; a data
    file ``target`` had that ``built`` does not need goes."""
    data = built.with_name(built.name + ".data")
    target_data = target.with_name(target.name + ".data")
    if data.exists():
        os.replace(data, target_data)
    else:
        target_data.unlink(missing_ok=True)
    os.replace(built, target)
