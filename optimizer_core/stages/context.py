"""What every stage gets: where the registry and the artifacts are, and the pipeline's config.

A stage takes a :class:`StageContext`, a :class:`PipelineConfig` and the records of the stages
before it (:mod:`.records`), and returns its own record. Records hold URIs and small numbers
only, so they travel through any orchestrator (Airflow XCom, Kubeflow outputs) as JSON.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graphtrim.errors import GraphtrimError
from graphtrim.hashing import file_sha256
from graphtrim.quantize.kinds import DEFAULT_VARIANTS
from graphtrim.run_params import hashed_config

if TYPE_CHECKING:
    from graphtrim.gates.policy import GatePolicy
    from graphtrim.integrations.artifacts import S3Auth
    from graphtrim.integrations.registry import MlflowAuth

ProgressFn = Callable[[str], None]
TaskStateFn = Callable[[Mapping[str, Any]], str | None]


class PipelineError(GraphtrimError):
    """A stage cannot run with the inputs it was given."""


WEIGHT_FIELDS = (
    "block_size",
    "weight_symmetric",
    "weight_algorithm",
    "weight_form",
    "accuracy_level",
    "quantize_embeddings",
)


def _checked_weights(weights: Mapping[str, Any]) -> dict[str, Any]:
    """``weights`` as a plain dict, refused (:class:`PipelineError`) where a key is not a
    weight-only setting or the settings cannot build a variant."""
    from graphtrim.quantize.build import QuantizeConfig, QuantizeError

    if not isinstance(weights, Mapping):
        raise PipelineError(f"weights must be a mapping of settings, not {type(weights).__name__}")
    unknown = sorted(set(weights) - set(WEIGHT_FIELDS))
    if unknown:
        raise PipelineError(
            f"unknown weight setting(s) {', '.join(unknown)}: use {', '.join(WEIGHT_FIELDS)}"
        )
    try:
        QuantizeConfig(**weights).validate()
    except (QuantizeError, TypeError) as exc:
        raise PipelineError(f"weights: {exc}") from exc
    return dict(weights)


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
    # the weight-only variants' settings that differ from the defaults, by QuantizeConfig field
    # (block_size, weight_symmetric, weight_algorithm, weight_form, accuracy_level,
    # quantize_embeddings); None: the defaults
    weights: Mapping[str, Any] | None = None
    # seconds for each variant's settings search (graphtrim.tune, over the variant's own
    # knobs): the champion is the variant, a kind without one gets its fixed recipe; None: no
    # search
    tune: float | None = None
    # the default-domain opset the optimize stage raises the model to first, so that fusions
    # into newer standard ops fire (23: a decoder's Attention, RotaryEmbedding and
    # RMSNormalization); None: the export's opset
    opset: int | None = None

    def __post_init__(self) -> None:
        from graphtrim.graph.presets import PRESETS
        from graphtrim.quantize.build import VARIANTS

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
        if self.tune is not None:
            if isinstance(self.tune, bool) or not isinstance(self.tune, int | float):
                raise PipelineError(f"tune: a number of seconds, not {self.tune!r}")
            if not self.tune > 0:
                raise PipelineError(f"tune: the search's budget must be positive, not {self.tune}")
            object.__setattr__(self, "tune", float(self.tune))
        if self.weights is not None:
            object.__setattr__(self, "weights", _checked_weights(self.weights))
        if self.opset is not None:
            import onnx.defs

            newest = onnx.defs.onnx_opset_version()
            if isinstance(self.opset, bool) or not isinstance(self.opset, int):
                raise PipelineError(f"opset: a whole number, not {self.opset!r}")
            if not 7 <= self.opset <= newest:
                raise PipelineError(
                    f"opset: {self.opset} is not between 7 and {newest} (this onnx's newest)"
                )
        # parsed here, once per document: a bad policy is refused before any work, and the
        # copies of this config (resolved, read back from a record) share the parsed policy
        parsed = None
        if self.policy is None:
            # a deployment's policy (GRAPHTRIM_POLICY), embedded: every stage of the run, on
            # whatever worker, judges by this document, and the config hash covers it
            from graphtrim.gates.policy import GatePolicy, environment_policy_path

            if environment_policy_path() is not None:
                parsed = GatePolicy.load(None)
                object.__setattr__(self, "policy", parsed.document)
        gate_policy = parse_policy(self.policy, parsed=parsed)
        gate_policy.check_variants(tuple(VARIANTS))
        object.__setattr__(self, "_gate_policy", gate_policy)

    def gate_policy(self) -> GatePolicy:
        """The gate policy, parsed when this config was made."""
        policy: GatePolicy = self.__dict__["_gate_policy"]
        return policy

    def to_json(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        doc["variants"] = list(self.variants)
        doc["policy"] = dict(self.policy) if self.policy is not None else None
        doc["data_sha256"] = dict(self.data_sha256) if self.data_sha256 else None
        doc["weights"] = dict(self.weights) if self.weights else None
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

    def resolved(self, ctx: StageContext, data: DataFiles | None = None) -> PipelineConfig:
        """This config with the sha256 of its data files filled in (they enter the hash). A
        stage passes its :class:`DataFiles`, so the copy hashed here is the one it loads."""
        wanted = [k for k in DATA_KEYS if getattr(self, k)]
        if not wanted or (self.data_sha256 and set(self.data_sha256) == set(wanted)):
            return self
        if data is None:
            with ctx.scratch("data") as tmp:
                return self.resolved(ctx, DataFiles(ctx, self, tmp))
        digests = {key: file_sha256(data.path(key)) for key in wanted}
        return dataclasses.replace(self, data_sha256=digests)

    def hash_for(self, *parts: str) -> str:
        """sha256 of the config fields that decide a result (locations of data files do not;
        their content hashes do), narrowed to ``parts`` when given."""
        # the run-parameter table says which fields enter it, and which only when set (so
        # that a config without them hashes as before they existed)
        doc = hashed_config(self.to_json())
        if parts:
            doc = {k: doc[k] for k in parts if k in doc}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()

    @property
    def config_hash(self) -> str:
        return self.hash_for()


DATA_KEYS = ("calibration", "eval_data")  # the config's data files


def parse_policy(
    policy: Mapping[str, Any] | None, *, parsed: GatePolicy | None = None
) -> GatePolicy:
    """The :class:`GatePolicy` of the document ``policy`` (None: the built-in policy), parsed
    once per document in this process: every config, copy and stage reads the same object.
    ``parsed``: this document already parsed by the caller (the CLI, whose errors name the
    policy file), kept as its parse."""
    key = json.dumps(policy, sort_keys=True, default=str) if policy is not None else None
    if parsed is not None:
        _PARSED_POLICIES.pop(key, None)
    else:
        parsed = _PARSED_POLICIES.get(key)
    if parsed is None:
        from graphtrim.gates.policy import GatePolicy

        if policy is None:
            parsed = GatePolicy()
        else:
            parsed = GatePolicy(dict(policy), source="pipeline policy")
    if key not in _PARSED_POLICIES:
        if len(_PARSED_POLICIES) >= 64:
            _PARSED_POLICIES.pop(next(iter(_PARSED_POLICIES)))
        _PARSED_POLICIES[key] = parsed
    return parsed


_PARSED_POLICIES: dict[str | None, GatePolicy] = {}


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
    # further runs that measure a variant whose verdict was not reached (a timeout, a child
    # killed from outside) before that outcome is reported as recorded
    unreached_retries: int = 2
    # credentials of this context's tracking server and S3 connection: they go to the clients
    # built here and nowhere else (not the process environment, not :meth:`to_json`)
    mlflow_auth: MlflowAuth | None = dataclasses.field(default=None, repr=False, compare=False)
    s3_auth: S3Auth | None = dataclasses.field(default=None, repr=False, compare=False)
    # the orchestrator's state of the task instance a stage recorded (``worker()``'s doc), or
    # None where it cannot tell: how a run left RUNNING on another host is found dead
    task_state: TaskStateFn | None = dataclasses.field(default=None, repr=False, compare=False)

    def say(self, line: str) -> None:
        if self.progress is not None:
            self.progress(line)

    def store(self) -> Any:
        from graphtrim.integrations.artifacts import open_store

        return open_store(self.artifacts, endpoint_url=self.s3_endpoint_url, auth=self.s3_auth)

    def registry(self) -> Any:
        from graphtrim.integrations.registry import Registry

        return Registry(self.tracking_uri, auth=self.mlflow_auth, s3=self.s3_auth)

    def mlflow_client(self) -> Any:
        """An ``MlflowClient`` for this context's tracking server, with its credentials."""
        from graphtrim.integrations.registry import mlflow_client

        return mlflow_client(self.tracking_uri, self.mlflow_auth, s3=self.s3_auth)

    def fetch(self, uri: str, dest: str | os.PathLike[str]) -> Path:
        """The model entry at ``uri`` in ``dest``, fetched with this context's S3 connection."""
        from graphtrim.integrations.artifacts import fetch

        return fetch(uri, dest, endpoint_url=self.s3_endpoint_url, auth=self.s3_auth)

    def fetch_file(self, uri: str, dest: str | os.PathLike[str]) -> Path:
        """A single file at ``uri`` as a local path (see ``artifacts.fetch_file``)."""
        from graphtrim.integrations.artifacts import fetch_file

        return fetch_file(uri, dest, endpoint_url=self.s3_endpoint_url, auth=self.s3_auth)

    @contextmanager
    def scratch(self, stage: str) -> Iterator[Path]:
        """A fresh folder for one stage's local files, removed afterwards (and, should this
        process be killed first, by the next stage on this host: :mod:`.staging`)."""
        from graphtrim.scratch import scratch

        with scratch(stage, self.workdir) as d:
            yield d

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
            "unreached_retries": self.unreached_retries,
        }


class DataFiles:
    """The calibration and evaluation files of a config, as one stage sees them: each fetched
    at most once (an S3 object is downloaded into ``folder``, a local file used in place), on
    first use; the copy hashed for the config hash is the copy checked and loaded."""

    NAMES = {"calibration": "calibration.npz", "eval_data": "eval.npz"}

    def __init__(self, ctx: StageContext, config: PipelineConfig, folder: Path):
        self.ctx = ctx
        self.uris = {k: getattr(config, k) for k in DATA_KEYS if getattr(config, k)}
        self.folder = folder
        self.local: dict[str, Path] = {}  # by URI

    def has(self, key: str) -> bool:
        """Whether the config names the file ``key`` (``calibration``, ``eval_data``)."""
        return key in self.uris

    def path(self, key: str) -> Path:
        """The local copy of the file ``key``, fetched the first time it (or another key
        naming the same file) is asked for."""
        uri = self.uris[key]
        if uri not in self.local:
            self.local[uri] = self.ctx.fetch_file(uri, self.folder / self.NAMES[key])
        return self.local[uri]

    def load(self, model: Path) -> tuple[Any, Any]:
        """(calibration, evaluation) data for ``model``; random inputs when none is
        configured, and each file standing in for the other when only one is."""
        from graphtrim.data import input_specs, load_npz, random_data

        specs = input_specs(model)
        calib = evald = None
        if self.has("calibration"):
            calib = load_npz(self.path("calibration"), specs)
        if self.has("eval_data"):
            evald = load_npz(self.path("eval_data"), specs)
        if evald is None:
            evald = calib if calib is not None else random_data(specs, batches=8)
        if calib is None:
            calib = evald
        return calib, evald


def require(record: Mapping[str, Any], keys: Sequence[str], stage: str) -> None:
    missing = [k for k in keys if k not in record]
    if missing:
        raise PipelineError(
            f"{stage}: the record it was given lacks {', '.join(missing)} "
            "(pass the record the previous stage returned)"
        )
