"""A model as MLflow serves it: the ONNX flavor's save, ``mlflow.pyfunc.load_model`` and one
prediction. The registry receives only variants that pass this probe: a model that loads in
graphtrim's measuring sessions can still crash or be refused where it is served (onnxruntime's
default optimization level, the flavor's own session options).

:func:`serving_probe` is meant for a child process (:mod:`graphtrim.isolation`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from graphtrim.isolation import step


def signature(path: str | os.PathLike[str]) -> Any:
    """An MLflow tensor signature from the ONNX model's inputs and outputs (symbolic dims -1)."""
    import numpy as np
    import onnx
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    proto = onnx.load(str(path), load_external_data=False)

    def specs(values: Any) -> Any:
        out: list[Any] = []
        for v in values:
            t = v.type.tensor_type
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type))
            shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim)
            out.append(TensorSpec(dtype, shape, v.name))
        return Schema(out)

    inits = {i.name for i in proto.graph.initializer}
    return ModelSignature(
        specs([i for i in proto.graph.input if i.name not in inits]), specs(proto.graph.output)
    )


def library_versions() -> dict[str, str]:
    """The installed versions of the libraries a variant depends on (its lineage records them;
    its MLflow model pins onnx and onnxruntime)."""
    from importlib import metadata

    out: dict[str, str] = {}
    for dist in ("graphtrim", "onnx", "onnx-ir", "onnxruntime", "onnxscript", "torch", "mlflow"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


def pip_requirements() -> list[str]:
    v = library_versions()
    return [f"onnx=={v['onnx']}", f"onnxruntime=={v['onnxruntime']}"]


def save_onnx_model(path: str | os.PathLike[str], dest: str | os.PathLike[str], **kw: Any) -> None:
    """Save the ONNX file at ``path`` as an MLflow model folder ``dest`` (onnx + pyfunc) whose
    model files are the input's own bytes: ``model.onnx`` is a copy of ``path`` and each external
    data file keeps its name, so the folder's files hash to the artifact store's sha256 (MLflow's
    own save re-serializes the proto and renames the data file)."""
    import shutil

    import mlflow.onnx
    import onnx
    from mlflow.models import Model

    from graphtrim.integrations.model_files import model_files

    src = Path(path)
    files = model_files(src)
    out = Path(dest)
    # the flavor's files (MLmodel, environments) from the proto alone; its data files are the
    # input's, copied below
    mlflow.onnx.save_model(
        onnx.load(str(src), load_external_data=False),
        str(out),
        signature=signature(src),
        pip_requirements=pip_requirements(),
        save_as_external_data=False,
        **kw,
    )
    meta = Model.load(str(out))
    data = meta.flavors[mlflow.onnx.FLAVOR_NAME]["data"]
    shutil.copyfile(src, out / data)
    for extra in files[1:]:
        target = out / Path(data).parent / extra.relative_to(src.parent)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(extra, target)
    meta.model_size_bytes = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    meta.save(str(out / "MLmodel"))


def serving_probe(
    path: str | os.PathLike[str],
    *,
    feeds: Mapping[str, Any] | None = None,
    saved: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Save ``path`` with MLflow's ONNX flavor (or take the saved folder ``saved``), load it
    with ``mlflow.pyfunc.load_model`` and predict once on ``feeds`` (seeded random inputs
    without them). Returns what was checked."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import mlflow.pyfunc

    from graphtrim.scratch import scratch

    # named for this process: a probe stopped at its child timeout leaves its folder to the next
    with scratch("serving") as tmp:
        folder = Path(saved) if saved is not None else tmp / "model"
        if saved is None:
            step("saving the model with MLflow's ONNX flavor")
            save_onnx_model(path, folder)
        step("loading the model with mlflow.pyfunc.load_model (ORT_ENABLE_ALL)")
        model = mlflow.pyfunc.load_model(str(folder))
        if feeds is None:
            from graphtrim.runtime import open_session, probe_feeds

            feeds = probe_feeds(open_session(path, optimize=False))
        step("predicting once through mlflow.pyfunc")
        out = model.predict(dict(feeds))
    shapes = (
        {k: list(getattr(v, "shape", ())) for k, v in out.items()}
        if isinstance(out, Mapping)
        else {"output": list(getattr(out, "shape", ()))}
    )
    return {"flavor": "mlflow.onnx", "loader": "mlflow.pyfunc.load_model", "outputs": shapes}
