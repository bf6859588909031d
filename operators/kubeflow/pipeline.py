"""graphtrim on Kubeflow Pipelines (KFP v2): the stages as container components running
``graphtrim pipeline stage`` in the graphtrim image, and a pipeline mirroring the Airflow DAG
``graphtrim_optimize_model``: export -> optimize -> one quantize / gate pair per variant
(``ParallelFor``) -> register -> promote.

Records travel as KFP output parameters (small JSON: URIs, versions, verdicts); models stay in
the artifact store (S3) under their content-addressed keys. The build steps are cached (their
inputs, config included, are the cache key: same source, same config, same result); register and
promote talk to the registry and are never cached. With ``device="gpu"`` the quantize and gate
steps ask for an NVIDIA GPU.
"""

# no "from __future__ import annotations": KFP reads the component signatures at runtime

import os
from typing import Any

from kfp import compiler, dsl

DEFAULT_IMAGE = os.environ.get("GRAPHTRIM_IMAGE", "ghcr.io/graphtrim/graphtrim:0.1.0")
STAGES = ("export", "optimize", "quantize", "gate", "register", "promote")


def build_pipeline(image: str = DEFAULT_IMAGE, device: str = "cpu", retries: int = 2) -> Any:
    """The pipeline function for ``image``, with its quantize and gate steps on ``device``."""
    if device not in ("cpu", "gpu"):
        raise ValueError(f"device must be 'cpu' or 'gpu', not {device!r}")

    def common(
        tracking_uri: str,
        artifacts: str,
        s3_endpoint_url: str,
        variants: list,
        preset: str,
        policy: str,
        calibration: str,
        eval_data: str,
    ) -> list[Any]:
        return [
            "--tracking-uri",
            tracking_uri,
            "--artifacts",
            artifacts,
            "--s3-endpoint-url",
            s3_endpoint_url,
            "--variants",
            variants,
            "--preset",
            preset,
            "--device",
            device,
            "--policy-json",
            policy,
            "--calibration",
            calibration,
            "--eval-data",
            eval_data,
            "--orchestrator-run-id",
            f"kfp:{dsl.PIPELINE_JOB_ID_PLACEHOLDER}",
            "-q",
        ]

    def spec(stage: str, args: list[Any]) -> dsl.ContainerSpec:
        return dsl.ContainerSpec(
            image=image, command=["graphtrim"], args=["pipeline", "stage", stage, *args]
        )

    @dsl.container_component
    def export(
        model_uri: str,
        tracking_uri: str,
        artifacts: str,
        s3_endpoint_url: str,
        variants: list,
        preset: str,
        policy: str,
        calibration: str,
        eval_data: str,
        record: dsl.OutputPath(str),  # type: ignore[valid-type]
    ) -> dsl.ContainerSpec:
        return spec(
            "export",
            [
                "--model",
                model_uri,
                "--output",
                record,
                *common(
                    tracking_uri,
                    artifacts,
                    s3_endpoint_url,
                    variants,
                    preset,
                    policy,
                    calibration,
                    eval_data,
                ),
            ],
        )

    @dsl.container_component
    def optimize(
        exported: str,
        tracking_uri: str,
        artifacts: str,
        s3_endpoint_url: str,
        variants: list,
        preset: str,
        policy: str,
        calibration: str,
        eval_data: str,
        record: dsl.OutputPath(str),  # type: ignore[valid-type]
    ) -> dsl.ContainerSpec:
        return spec(
            "optimize",
            [
                "--input",
                dsl.ConcatPlaceholder(["export=", exported]),
                "--output",
                record,
                *common(
                    tracking_uri,
                    artifacts,
                    s3_endpoint_url,
                    variants,
                    preset,
                    policy,
                    calibration,
                    eval_data,
                ),
            ],
        )

    @dsl.container_component
    def quantize(
        exported: str,
        optimized: str,
        variant: str,
        tracking_uri: str,
        artifacts: str,
        s3_endpoint_url: str,
        variants: list,
        preset: str,
        policy: str,
        calibration: str,
        eval_data: str,
        record: dsl.OutputPath(str),  # type: ignore[valid-type]
    ) -> dsl.ContainerSpec:
        return spec(
            "quantize",
            [
                "--input",
                dsl.ConcatPlaceholder(["export=", exported]),
                "--input",
                dsl.ConcatPlaceholder(["optimize=", optimized]),
                "--only",
                variant,
                "--output",
                record,
                *common(
                    tracking_uri,
                    artifacts,
                    s3_endpoint_url,
                    variants,
                    preset,
                    policy,
                    calibration,
                    eval_data,
                ),
            ],
        )

    @dsl.container_component
    def gate(
        exported: str,
        quantized: str,
        tracking_uri: str,
        artifacts: str,
        s3_endpoint_url: str,
        variants: list,
        preset: str,
        policy: str,
        calibration: str,
        eval_data: str,
        record: dsl.OutputPath(str),  # type: ignore[valid-type]
    ) -> dsl.ContainerSpec:
        return spec(
            "validate",
            [
                "--input",
                dsl.ConcatPlaceholder(["export=", exported]),
                "--input",
                dsl.ConcatPlaceholder(["quantize=", quantized]),
                "--output",
                record,
                *common(
                    tracking_uri,
                    artifacts,
                    s3_endpoint_url,
                    variants,
                    preset,
                    policy,
                    calibration,
                    eval_data,
                ),
            ],
        )

    @dsl.container_component
    def register(
        exported: str,
        optimized: str,
        validated: list,
        tracking_uri: str,
        artifacts: str,
        s3_endpoint_url: str,
        variants: list,
        preset: str,
        policy: str,
        calibration: str,
        eval_data: str,
        record: dsl.OutputPath(str),  # type: ignore[valid-type]
    ) -> dsl.ContainerSpec:
        return spec(
            "register",
            [
                "--input",
                dsl.ConcatPlaceholder(["export=", exported]),
                "--input",
                dsl.ConcatPlaceholder(["optimize=", optimized]),
                "--input",
                dsl.ConcatPlaceholder(["validate=", validated]),
                "--output",
                record,
                *common(
                    tracking_uri,
                    artifacts,
                    s3_endpoint_url,
                    variants,
                    preset,
                    policy,
                    calibration,
                    eval_data,
                ),
            ],
        )

    @dsl.container_component
    def promote(
        exported: str,
        validated: list,
        registered: str,
        tracking_uri: str,
        artifacts: str,
        s3_endpoint_url: str,
        variants: list,
        preset: str,
        policy: str,
        calibration: str,
        eval_data: str,
        record: dsl.OutputPath(str),  # type: ignore[valid-type]
    ) -> dsl.ContainerSpec:
        return spec(
            "promote",
            [
                "--input",
                dsl.ConcatPlaceholder(["export=", exported]),
                "--input",
                dsl.ConcatPlaceholder(["validate=", validated]),
                "--input",
                dsl.ConcatPlaceholder(["register=", registered]),
                "--output",
                record,
                *common(
                    tracking_uri,
                    artifacts,
                    s3_endpoint_url,
                    variants,
                    preset,
                    policy,
                    calibration,
                    eval_data,
                ),
            ],
        )

    @dsl.pipeline(
        name=f"graphtrim-optimize-model{'-gpu' if device == 'gpu' else ''}",
        description="graphtrim: export, optimize, build and gate variants, register, promote",
    )
    def optimize_model(
        model_uri: str,
        tracking_uri: str,
        artifacts: str,
        s3_endpoint_url: str = "",
        variants: list = ["graph", "int8-dynamic", "int8-static"],  # noqa: B006 (KFP default)
        preset: str = "default",
        policy: str = "{}",
        calibration: str = "",
        eval_data: str = "",
    ) -> None:
        cfg = dict(
            tracking_uri=tracking_uri,
            artifacts=artifacts,
            s3_endpoint_url=s3_endpoint_url,
            variants=variants,
            preset=preset,
            policy=policy,
            calibration=calibration,
            eval_data=eval_data,
        )
        e = export(model_uri=model_uri, **cfg).set_display_name("export")
        o = optimize(exported=e.outputs["record"], **cfg).set_display_name("optimize")
        built = [e, o]
        with dsl.ParallelFor(variants) as variant:
            q = quantize(
                exported=e.outputs["record"], optimized=o.outputs["record"], variant=variant, **cfg
            ).set_display_name("quantize")
            g = gate(exported=e.outputs["record"], quantized=q.outputs["record"], **cfg)
            g.set_display_name("gate")
            for t in (q, g):
                if device == "gpu":
                    t.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(1)
                t.set_cpu_request("2").set_memory_request("8G")
            built += [q, g]
        r = register(
            exported=e.outputs["record"],
            optimized=o.outputs["record"],
            validated=dsl.Collected(g.outputs["record"]),
            **cfg,
        ).set_display_name("register")
        p = promote(
            exported=e.outputs["record"],
            validated=dsl.Collected(g.outputs["record"]),
            registered=r.outputs["record"],
            **cfg,
        ).set_display_name("promote")
        for t in built:
            t.set_caching_options(True).set_retry(num_retries=retries, backoff_duration="30s")
        for t in (r, p):  # they write to the registry: never served from a cache
            t.set_caching_options(False).set_retry(num_retries=retries, backoff_duration="30s")

    return optimize_model


def compile_pipeline(
    output: str | os.PathLike[str], *, image: str = DEFAULT_IMAGE, device: str = "cpu"
) -> str:
    """Compile the pipeline to a KFP v2 YAML file, offline."""
    compiler.Compiler().compile(build_pipeline(image, device), str(output))
    return str(output)
