"""What every stage gets: where the registry and the artifacts are, and the pipeline's config.

A stage takes a :class:`StageContext`, a :class:`PipelineConfig` and the JSON records of the
stages before it, and returns its own JSON record. Records hold URIs and small numbers only, so
they travel through any orchestrator (Airflow XCom, Kubeflow outputs) unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optimizer_core.errors import GraphtrimError
from optimizer_core.hashing import file_sha256

if TYPE_CHECKING:
    from optimizer_core.integrations.artifacts import S3Auth
    from optimizer_core.integrations.registry import MlflowAuth

ProgressFn = Callable[[str], None]

DEFAULT_VARIANTS = ("graph", "int8-dynamic", "int8-static")


class PipelineError(GraphtrimError):
    """A stage cannot run with the inputs it was given."""


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Everything that decides what a pipeline run produces. Its hash is the lineage's
    ``config_hash``: the same source version with the same config is the same result."""

    variants: tuple[str, ...] = DEFAULT_VARIANTS
    preset: str = "default"
    device: str = "cpu"
    tensorrt: bool = False
    policy: Mapping[str, Any] | None = None  # a gate policy document (parsed YAML)
    calibration: str | None = None  # .npz: local path, file:// or s3:// URI
    eval_data: str | None = None
    data_sha256: Mapping[str, str] | None = None  # filled in by `resolve_data`
    target_name: str | None = None  # registered model for the variants; default: the source's
    experiment: str = "graphtrim"
    fallback: bool = True
    # PyTorch models: torch.fx dead-code elimination and constant folding before export
    fx_simplify: bool = False

    def __post_init__(self) -> None:
        from optimizer_core.graph.presets import PRESETS
        from optimizer_core.quantize.build import VARIANTS

        if not self.variants:
            raise PipelineError("no variants requested")
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown:
            raise PipelineError(
                f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(VARIANTS)}"
            )
        if len(set(self.variants)) != len(self.variants):
            raise PipelineError(f"variant listed twice in {', '.join(self.variants)}")
        if self.preset not in PRESETS:
            raise PipelineError(
                f"unknown preset '{self.preset}': choose from {', '.join(sorted(PRESETS))}"
            )
        if self.device not in ("cpu", "gpu"):
            raise PipelineError(f"device must be 'cpu' or 'gpu', not '{self.device}'")
        object.__setattr__(self, "variants", tuple(self.variants))
        self.gate_policy()  # a bad policy is refused before any work

    def gate_policy(self) -> Any:
        from optimizer_core.gates.policy import GatePolicy

        if self.policy is None:
            return GatePolicy()
        return GatePolicy(dict(self.policy), source="pipeline policy")

    def to_json(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        doc["variants"] = list(self.variants)
        doc["policy"] = dict(self.policy) if self.policy is not None else None
        doc["data_sha256"] = dict(self.data_sha256) if self.data_sha256 else None
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> PipelineConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(doc) - fields
        if unknown:
            raise PipelineError(f"unknown pipeline config key(s): {', '.join(sorted(unknown))}")
        body = dict(doc)
        if "variants" in body:
            body["variants"] = tuple(body["variants"])
        return cls(**body)

    def resolved(self, ctx: StageContext) -> PipelineConfig:
        """This config with the sha256 of its data files filled in (they enter the hash)."""
        wanted = {k: getattr(self, k) for k in ("calibration", "eval_data") if getattr(self, k)}
        if not wanted or (self.data_sha256 and set(self.data_sha256) == set(wanted)):
            return self
        digests = {}
        with ctx.scratch("data") as tmp:
            for key, uri in wanted.items():
                path = ctx.fetch_file(uri, tmp / f"{key}.npz")
                digests[key] = file_sha256(path)
        return dataclasses.replace(self, data_sha256=digests)

    def hash_for(self, *parts: str) -> str:
        """sha256 of the config fields that decide a result (locations of data files do not;
        their content hashes do), narrowed to ``parts`` when given."""
        doc = self.to_json()
        for k in ("calibration", "eval_data", "experiment", "target_name"):
            doc.pop(k)
        if not doc["fx_simplify"]:
            doc.pop("fx_simplify")  # off: the hash of configs from before the option existed
        if parts:
            doc = {k: doc[k] for k in parts}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()

    @property
    def config_hash(self) -> str:
        return self.hash_for()


@dataclasses.dataclass
class StageContext:
    """Where a stage finds the registry and the artifact store, and who runs it."""

    tracking_uri: str
    artifacts: str  # a local folder, file:// or s3://bucket/prefix
    workdir: str | None = None  # scratch space; a temporary folder by default
    s3_endpoint_url: str | None = None
    orchestrator_run_id: str | None = None  # e.g. Airflow's run_id, recorded in the lineage
    progress: ProgressFn | None = None
    worker: Mapping[str, Any] | None = None  # where the orchestrator placed it (queue, task)
    # how a run treats earlier results and the registry (none of it changes what is built)
    rejudge: bool = False  # build and measure variants already judged under this config again
    allow_variant_source: bool = False  # optimize a version graphtrim itself registered
    force_promotion: bool = False  # move the champion even where a person holds it
    child_timeout: float = 1800.0  # seconds for one variant's build or gates in a child process
    # credentials of this context's tracking server and S3 connection: they go to the clients
    # built here and nowhere else (not the process environment, not :meth:`to_json`)
    mlflow_auth: MlflowAuth | None = dataclasses.field(default=None, repr=False, compare=False)
    s3_auth: S3Auth | None = dataclasses.field(default=None, repr=False, compare=False)

    def say(self, line: str) -> None:
        if self.progress is not None:
            self.progress(line)

    def store(self) -> Any:
        from optimizer_core.integrations.artifacts import open_store

        return open_store(self.artifacts, endpoint_url=self.s3_endpoint_url, auth=self.s3_auth)

    def registry(self) -> Any:
        from optimizer_core.integrations.registry import Registry

        return Registry(self.tracking_uri, auth=self.mlflow_auth, s3=self.s3_auth)

    def mlflow_client(self) -> Any:
        """An ``MlflowClient`` for this context's tracking server, with its credentials."""
        from optimizer_core.integrations.registry import mlflow_client

        return mlflow_client(self.tracking_uri, self.mlflow_auth, s3=self.s3_auth)

    def fetch(self, uri: str, dest: str | os.PathLike[str]) -> Path:
        """The model entry at ``uri`` in ``dest``, fetched with this context's S3 connection."""
        from optimizer_core.integrations.artifacts import fetch

        return fetch(uri, dest, endpoint_url=self.s3_endpoint_url, auth=self.s3_auth)

    def fetch_file(self, uri: str, dest: str | os.PathLike[str]) -> Path:
        """A single file at ``uri`` as a local path (see ``artifacts.fetch_file``)."""
        from optimizer_core.integrations.artifacts import fetch_file

        return fetch_file(uri, dest, endpoint_url=self.s3_endpoint_url, auth=self.s3_auth)

    @contextmanager
    def scratch(self, stage: str) -> Iterator[Path]:
        """A fresh folder for one stage's local files, removed afterwards."""
        if self.workdir:
            Path(self.workdir).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f"graphtrim-{stage}-", dir=self.workdir) as d:
            yield Path(d)

    def to_json(self) -> dict[str, Any]:
        return {
            "tracking_uri": self.tracking_uri,
            "artifacts": self.artifacts,
            "workdir": self.workdir,
            "s3_endpoint_url": self.s3_endpoint_url,
            "orchestrator_run_id": self.orchestrator_run_id,
            "rejudge": self.rejudge,
            "allow_variant_source": self.allow_variant_source,
            "force_promotion": self.force_promotion,
            "child_timeout": self.child_timeout,
        }


def library_versions() -> dict[str, str]:
    from importlib import metadata

    out: dict[str, str] = {}
    for dist in ("graphtrim", "onnx", "onnx-ir", "onnxruntime", "onnxscript", "torch", "mlflow"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


def require(record: Mapping[str, Any], keys: Sequence[str], stage: str) -> None:
    missing = [k for k in keys if k not in record]
    if missing:
        raise PipelineError(
            f"{stage}: the record it was given lacks {', '.join(missing)} "
            "(pass the record the previous stage returned)"
        )
