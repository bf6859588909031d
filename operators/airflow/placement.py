"""Where a task runs: the operator arguments that put it on a CPU or a GPU worker (a queue and,
on Kubernetes, the pod's GPUs, image, node selector and tolerations)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

DEVICES = ("cpu", "gpu")


GPU_NODE_SELECTOR = {"nvidia.com/gpu.present": "true"}


GPU_IMAGE_ENV = "GRAPHTRIM_GPU_IMAGE"  # read when the DAG is parsed


GPU_TOLERATIONS = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def placement(
    device: str,
    *,
    gpu_queue: str = "gpu",
    cpu_queue: str | None = None,
    gpus: int = 1,
    node_selector: Mapping[str, str] | None = None,
    tolerations: Sequence[Mapping[str, str]] | None = None,
) -> dict[str, Any]:
    """The operator arguments that put a task on a ``device`` worker. On Kubernetes a GPU task
    asks for ``gpus`` GPUs on its ``base`` container, runs ``$GRAPHTRIM_GPU_IMAGE`` there when
    set (the Dockerfile's ``airflow`` target built with ``GPU=true``) and lands on GPU nodes
    (``node_selector`` and ``tolerations``, by default those of NVIDIA's GPU operator and of
    ``helm/airflow-values.yaml``)."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, not {device!r}")
    if device == "cpu":
        return {"queue": cpu_queue} if cpu_queue else {}
    out: dict[str, Any] = {"queue": gpu_queue}
    try:
        from kubernetes.client import models as k8s
    except ImportError:  # no KubernetesExecutor without the client: the queue is enough
        return out
    out["executor_config"] = {
        "pod_override": k8s.V1Pod(
            spec=k8s.V1PodSpec(
                node_selector=dict(GPU_NODE_SELECTOR if node_selector is None else node_selector),
                tolerations=[
                    k8s.V1Toleration(**t)
                    for t in (GPU_TOLERATIONS if tolerations is None else tolerations)
                ],
                containers=[
                    k8s.V1Container(
                        name="base",
                        # the GPU build of the image (onnxruntime-gpu, CUDA torch) where the
                        # deployment names one; the pod template's image otherwise
                        image=os.environ.get(GPU_IMAGE_ENV) or None,
                        resources=k8s.V1ResourceRequirements(
                            limits={"nvidia.com/gpu": str(gpus)},
                            requests={"nvidia.com/gpu": str(gpus)},
                        ),
                    )
                ],
            )
        )
    }
    return out
