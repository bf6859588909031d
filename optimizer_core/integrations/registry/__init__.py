"""The MLflow model registry as graphtrim uses it: resolve sources, register variants with
lineage, find them again by lineage, and move aliases with an audit trail.

Every call goes through an ``MlflowClient`` bound to one tracking URI. Errors name what is
missing (model, version, alias) or unreachable (the tracking server) in one line, with any
credential in the URI masked.

Credentials travel with the client, never through the process environment: :func:`mlflow_client`
builds an ``MlflowClient`` whose tracking store, registry store and artifact repositories
(``mlflow-artifacts:`` proxied by the server, ``s3://`` written directly) all use the
:class:`MlflowAuth` (and :class:`~graphtrim.integrations.artifacts.S3Auth`) it was given.
Two clients for two servers in one process (Airflow's triggerer runs every DAG's triggers in one)
each send their own token. Without an ``MlflowAuth`` the client is MLflow's own, reading
``$MLFLOW_TRACKING_TOKEN`` and friends as MLflow documents (the CLI's case).

By concern: :mod:`.base` (tags, errors, ``models:/`` URIs, the client and its one-line
errors), :mod:`.client` (credentials per client), :mod:`.versions` (:class:`Registry`:
sources, variants' versions, lineage), :mod:`.aliases` (moves, history, holds),
:mod:`.tune_memory` (the settings search's memory). Everything is imported from here.
"""

from graphtrim.integrations.registry.base import (
    _INTEGER_METRICS,
    GATES_TAG,
    HISTORY_TAG,
    HOLD_TAG,
    KEY_TAG,
    LEGACY_METRICS_TAG,
    MOVES_TAG,
    TAG,
    TUNE_TAG,
    VARIANT_TAG,
    RegistryError,
    SourceVersion,
    _check_reachable,
    _quote,
    format_gates,
    is_graphtrim_output,
    logged_model_id,
    parse_gates,
    parse_models_uri,
)
from graphtrim.integrations.registry.client import (
    MlflowAuth,
    _artifact_repo,
    _host_creds,
    _install_creds_lookup,
    mlflow_client,
    split_userinfo,
)
from graphtrim.integrations.registry.tune_memory import RegistryTuneMemory
from graphtrim.integrations.registry.versions import Registry

__all__ = [
    "GATES_TAG",
    "HISTORY_TAG",
    "HOLD_TAG",
    "KEY_TAG",
    "LEGACY_METRICS_TAG",
    "MOVES_TAG",
    "TAG",
    "TUNE_TAG",
    "VARIANT_TAG",
    "_INTEGER_METRICS",
    "MlflowAuth",
    "Registry",
    "RegistryError",
    "RegistryTuneMemory",
    "SourceVersion",
    "_artifact_repo",
    "_check_reachable",
    "_host_creds",
    "_install_creds_lookup",
    "_quote",
    "format_gates",
    "is_graphtrim_output",
    "logged_model_id",
    "mlflow_client",
    "parse_gates",
    "parse_models_uri",
    "split_userinfo",
]
