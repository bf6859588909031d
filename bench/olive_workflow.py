"""The Olive workflow configuration that bench.olive runs: the search space, the data it
reads (written as a user script that Olive imports), the reference labels."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# the module Olive imports for its data config (written beside the workflow)
_USER_SCRIPT = "olive_npz_data.py"

_USER_SCRIPT_TEXT = '''\
"""Olive data components for bench/olive.py: .npz model inputs (samples on the first axis)."""
import numpy as np
import torch

from olive.data.registry import Registry


class _NpzDataset(torch.utils.data.Dataset):
    def __init__(self, data_path, labels_path=None):
        with np.load(data_path) as z:
            self.inputs = {k: np.asarray(z[k]) for k in z.files}
        self.n = min(len(v) for v in self.inputs.values())
        self.labels = None
        if labels_path:
            with np.load(labels_path) as z:
                self.labels = np.asarray(z["labels"])

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = {k: torch.from_numpy(np.ascontiguousarray(v[i])) for k, v in self.inputs.items()}
        y = int(self.labels[i]) if self.labels is not None else 0
        return x, torch.tensor(y)


@Registry.register_dataset("bench_npz_dataset")
def bench_npz_dataset(data_path, labels_path=None):
    return _NpzDataset(data_path, labels_path)


@Registry.register_post_process("bench_argmax")
def bench_argmax(output, **kwargs):
    if isinstance(output, dict):
        output = next(iter(output.values()))
    return output.reshape(output.shape[0], -1).argmax(dim=1)
'''


def _input_specs(model: Path) -> list[tuple[str, list[int], Any]]:
    import onnx
    from onnx import helper

    m = onnx.load(str(model), load_external_data=False)
    inits = {i.name for i in m.graph.initializer}
    specs = []
    for vi in m.graph.input:
        if vi.name in inits:
            continue
        t = vi.type.tensor_type
        dims = [
            d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else 1 for d in t.shape.dim
        ]
        specs.append((vi.name, dims, helper.tensor_dtype_to_np_dtype(t.elem_type)))
    return specs


def _random_inputs(model: Path, path: Path, samples: int = 4) -> Path:
    """Random inputs (batch dim squeezed into the sample axis) for latency when no data is given."""
    import numpy as np

    rng = np.random.default_rng(0)
    arrays = {}
    for name, dims, dtype in _input_specs(model):
        shape = (samples, *dims[1:]) if dims else (samples,)
        if np.issubdtype(dtype, np.floating):
            arrays[name] = rng.standard_normal(shape).astype(dtype)
        else:
            arrays[name] = rng.integers(0, 2, size=shape).astype(dtype)
    np.savez(path, **arrays)
    return path


def _reference_labels(model: Path, data: Path, path: Path) -> int:
    """argmax of the fp32 model's first output per sample (batch of one), saved as ``labels``.

    Returns the number of classes (elements of that output per sample).
    """
    import numpy as np
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    with np.load(data) as z:
        arrays = {k: np.asarray(z[k]) for k in names}
    n = min(len(v) for v in arrays.values())
    labels, classes = [], 1
    for i in range(n):
        (y,) = sess.run([sess.get_outputs()[0].name], {k: v[i : i + 1] for k, v in arrays.items()})
        flat = np.asarray(y).reshape(1, -1)
        classes = flat.shape[1]
        labels.append(int(flat[0].argmax()))
    np.savez(path, labels=np.asarray(labels, dtype=np.int64))
    return classes


def workflow_config(
    model: Path,
    out: Path,
    cache_dir: Path,
    *,
    calibration: Path | None,
    data: Path | None,
    labels: Path | None,
    num_classes: int,
    max_samples: int,
    sampler: str = "tpe",
    accuracy_drop: float = 0.05,
    max_time: int | None = None,
) -> dict[str, Any]:
    """The ``olive run`` config (see the module docstring for what it searches and why).

    The user script (written by :func:`run_workflow`) and the label/random-input files are in
    ``out``, so that ``olive run --config out/olive_config.json`` can be repeated by hand.
    """
    script = str(out / _USER_SCRIPT)

    def data_config(
        name: str, path: Path, labels_path: Path | None = None, post: bool = False
    ) -> dict:
        params = {"data_path": str(Path(path).resolve())}
        if labels_path is not None:
            params["labels_path"] = str(labels_path)
        cfg = {
            "name": name,
            "user_script": script,
            "load_dataset_config": {"type": "bench_npz_dataset", "params": params},
            "dataloader_config": {"batch_size": 1},
        }
        if post:
            cfg["post_process_data_config"] = {"type": "bench_argmax"}
        return cfg

    latency_data = calibration or data or (out / "random_inputs.npz")
    data_configs = [data_config("latency_data", latency_data)]
    metrics: list[dict[str, Any]] = []
    if data is not None and labels is not None:
        data_configs.append(data_config("accuracy_data", data, labels, post=True))
        metrics.append(
            {
                "name": "agreement",
                "type": "accuracy",
                "backend": "torch_metrics",
                "data_config": "accuracy_data",
                "sub_types": [
                    {
                        "name": "accuracy_score",
                        "priority": 1,
                        "metric_config": {"task": "multiclass", "num_classes": max(2, num_classes)},
                        "goal": {"type": "max-degradation", "value": accuracy_drop},
                    }
                ],
            }
        )
    metrics.append(
        {
            "name": "latency",
            "type": "latency",
            "data_config": "latency_data",
            "sub_types": [{"name": "avg", "priority": len(metrics) + 1}],
        }
    )
    passes: dict[str, Any] = {}
    if calibration is not None:
        data_configs.append(data_config("calibration_data", calibration))
        passes["quantization"] = {"type": "OnnxQuantization", "data_config": "calibration_data"}
    else:
        passes["quantization"] = {"type": "OnnxDynamicQuantization"}
    passes["session_params"] = {"type": "OrtSessionParamsTuning", "data_config": "latency_data"}
    search: dict[str, Any] = {
        "execution_order": "joint",
        "sampler": sampler,
        # sampler_config is dropped by Olive 0.13's engine (see above): max_iter is what bounds it
        "sampler_config": {"max_samples": max_samples, "seed": 0},
        "max_iter": max(0, max_samples - 1),
    }
    if max_time:
        search["max_time"] = max_time
    return {
        "input_model": {"type": "ONNXModel", "model_path": str(Path(model).resolve())},
        "systems": {
            "local_system": {
                "type": "LocalSystem",
                "accelerators": [
                    {"device": "cpu", "execution_providers": ["CPUExecutionProvider"]}
                ],
            }
        },
        "data_configs": data_configs,
        "evaluators": {"evaluator": {"type": "OnnxEvaluator", "metrics": metrics}},
        "passes": passes,
        "search_strategy": search,
        "evaluator": "evaluator",
        "host": "local_system",
        "target": "local_system",
        "cache_dir": str(cache_dir),
        "output_dir": str(out),
        "log_severity_level": 1,
    }
