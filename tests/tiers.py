"""The test tiers, held to what they promise.

``make test-fast`` runs ``-m "not slow and not server and not venv and not browser"`` with
``GRAPHTRIM_TEST_TIER=fast``: a test that starts a server (MLflow, moto, Airflow's database or
API server, PostgreSQL, Redis), builds a venv or opens the browser then fails at that call,
naming the marker it lacks, instead of slowing the edit loop down unnoticed. ``make test`` runs
every tier.
"""

from __future__ import annotations

import os

import pytest

TIERS = {
    "server": "starts a server (MLflow, moto, Airflow, PostgreSQL, Redis)",
    "venv": "builds a virtual environment",
    "browser": "drives the browser",
}
# session fixtures that start servers: a test asking for one is marked ``server`` (conftest)
# (``s3_url``: test_artifacts' moto server)
SERVER_FIXTURES = frozenset({"servers", "airflow_db", "s3_url"})
# module fixtures that export a language model with its cache (10-20 s each on the 2-core
# machine, paid by whichever test asks first): a test asking for one is marked ``slow``, so the
# fast tier does not pay that for a handful of checks
# (``lm``: test_language_gates, ``causal``: test_export_transformers)
MODEL_FIXTURES = frozenset({"lm", "causal"})


def require(marker: str) -> None:
    """Called where a test starts what ``marker`` stands for."""
    if os.environ.get("GRAPHTRIM_TEST_TIER") == "fast":
        pytest.fail(
            f"this test {TIERS[marker]}: mark it `{marker}` (pytest.mark.{marker}) so that the "
            "fast tier leaves it to make test",
            pytrace=False,
        )
