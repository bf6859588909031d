"""The example CI workflow is valid YAML and calls the CLI the way the CLI parses it."""

from __future__ import annotations

import shlex

import yaml

from graphtrim.cli import build_parser
from tests.conftest import REPO


def test_github_actions_example_calls_a_valid_trigger_command() -> None:
    doc = yaml.safe_load((REPO / "examples" / "ci" / "github-actions-graphtrim.yml").read_text())
    steps = doc["jobs"]["optimize"]["steps"]
    step = next(s for s in steps if "graphtrim trigger" in s.get("run", ""))
    # credentials only through the environment
    assert set(step["env"]) >= {"GRAPHTRIM_AIRFLOW_URL", "GRAPHTRIM_AIRFLOW_PASSWORD"}
    assert "PASSWORD" not in step["run"] and "TOKEN" not in step["run"]
    command = " ".join(step["run"].replace("\\\n", " ").split())
    argv = shlex.split(
        command.replace("${{ steps.version.outputs.model }}", "m").replace(
            "${{ steps.version.outputs.version }}", "3"
        )
    )
    assert argv[:2] == ["graphtrim", "trigger"]
    args = build_parser().parse_args(argv[1:])
    assert args.model == "m" and args.version == "3" and args.wait
    assert args.variants == ["graph", "int8-static"]
