"""The run-parameter table (``graphtrim.run_params``) and the surfaces that derive from it: the
``graphtrim pipeline`` options, the optimize DAGs' Params and ``plan_run``, the Kubeflow
pipeline's signature and steps, the ``PipelineConfig`` fields and its config hash. Each surface
must take every parameter the table gives it and none of its own, and pass each one on."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from graphtrim import run_params
from graphtrim.cli import build_parser
from graphtrim.run_params import REQUIRED, RUN_PARAMS, RunParam, on

ROOT = Path(__file__).resolve().parents[1]

# the options of the commands themselves: how this process runs, not what the run is
COMMAND_OPTIONS = {
    "run": {"help", "model", "json", "allow_failed_variants"},
    "stage": {"help", "stage", "model", "input", "output", "only", "tuned"},
    "tune": {"help", "step", "input", "trial", "trials", "search", "search_output", "batch"}
    | {"output", "rounds"},
}
PROCESS_OPTIONS = {"policy", "workdir", "orchestrator_run_id", "child_timeout", "quiet"}


def _weight_flags() -> set[str]:
    from graphtrim.cli.variant_args import add_weight_args

    p = argparse.ArgumentParser()
    add_weight_args(p)
    return {a.dest for a in p._actions} - {"help"}


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    pipeline = next(
        a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
    ).choices["pipeline"]
    sub = next(a for a in pipeline._actions if isinstance(a, argparse._SubParsersAction))
    found: argparse.ArgumentParser = sub.choices[command]
    return found


def _table_names(surface: run_params.Surface, *, dest: bool = False) -> list[str]:
    return [p.dest if dest else p.name for p in on(surface)]


@pytest.fixture(scope="module")
def dag_module(tmp_path_factory: pytest.TempPathFactory) -> Any:
    home = tmp_path_factory.mktemp("airflow-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AIRFLOW_HOME", str(home))
        mp.setenv("HOME", str(home))
        spec = importlib.util.spec_from_file_location(
            "graphtrim_optimize_model_under_test", ROOT / "dags" / "graphtrim_optimize_model.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("kfp")
    from graphtrim.kubeflow.pipeline import compile_pipeline

    path = tmp_path_factory.mktemp("kfp") / "p.yaml"
    compile_pipeline(path, image="gt:1")
    doc: dict[str, Any] = next(yaml.safe_load_all(path.read_text()))
    return doc


# ---------------------------------------------------------------- the table itself


def test_the_table_is_well_formed() -> None:
    names = [p.name for p in RUN_PARAMS]
    assert len(names) == len(set(names))
    flags = [p.flag for p in RUN_PARAMS]
    assert len(flags) == len(set(flags))
    for p in RUN_PARAMS:
        assert p.surfaces <= set(run_params.SURFACES) and p.surfaces, p.name
        assert p.help and p.example is not None, p.name
        assert p.example != p.default_value(), f"{p.name}: its example is its default"
        if p.into in ("context", "location"):
            assert p.hashed == "no", p.name


def test_the_table_imports_nothing_heavy() -> None:
    import subprocess

    code = (
        "import json, sys; import graphtrim.run_params; "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert not {"airflow", "kfp", "mlflow", "onnx", "numpy", "torch", "yaml"} & loaded


# ---------------------------------------------------------------- each surface: no more, no less


@pytest.mark.parametrize("command", ["run", "stage", "tune"])
def test_the_pipeline_commands_take_the_table_s_parameters_and_no_other(command: str) -> None:
    dests = {a.dest for a in _subparser(command)._actions}
    own = COMMAND_OPTIONS[command] | PROCESS_OPTIONS | _weight_flags()
    wanted = {p.dest for p in on("cli") if p.into != "source"}
    assert dests - own == wanted, "options outside the table, or table rows without an option"
    if command == "run":
        # the source: `run` takes it as --model
        assert "model" in dests and run_params.BY_NAME["model_uri"].dest == "model"


def test_the_dags_take_the_table_s_parameters_and_no_other(dag_module: Any) -> None:
    for dag in (dag_module.cpu_dag, dag_module.gpu_dag):
        assert list(dag.params.keys()) == _table_names("dag"), dag.dag_id


def test_the_kubeflow_pipeline_takes_the_table_s_parameters_and_no_other(
    compiled: dict[str, Any],
) -> None:
    declared = set(compiled["root"]["inputDefinitions"]["parameters"])
    assert declared == set(_table_names("kfp"))
    # the four the DAGs had and the pipeline lacked
    assert {"target_name", "allow_variant_source", "rejudge", "force_promotion"} <= declared
    # every step passes each of them on as its graphtrim option, bound to the parameter
    for name, executor in compiled["deploymentSpec"]["executors"].items():
        args = executor["container"]["args"]
        for p in on("kfp"):
            if p.into == "source" and name != "exec-export":
                continue
            assert p.flag in args, (name, p.flag)
            placeholder = args[args.index(p.flag) + 1]
            assert placeholder == f"{{{{$.inputs.parameters['{p.name}']}}}}", (name, p.name)


def test_the_config_fields_are_the_table_s(monkeypatch: pytest.MonkeyPatch) -> None:
    from graphtrim.stages.context import PipelineConfig, StageContext

    monkeypatch.delenv("GRAPHTRIM_POLICY", raising=False)
    fields = {f.name: f for f in dataclasses.fields(PipelineConfig)}
    table = {p.name: p for p in run_params.config_params()}
    # data_sha256: not a parameter; filled in from the data files, and hashed
    assert set(fields) - {"data_sha256"} == set(table)
    default = PipelineConfig()
    for name, p in table.items():
        value = getattr(default, name)
        assert (list(value) if isinstance(value, tuple) else value) == p.default_value(), name
    context = {f.name for f in dataclasses.fields(StageContext)}
    for p in RUN_PARAMS:
        if p.into == "context":
            assert p.name in context, p.name
            assert getattr(StageContext("t", "a"), p.name) == p.default, p.name


# ---------------------------------------------------------------- each surface passes each on


def _expected(p: RunParam) -> Any:
    """What a config or context holds for ``p``'s example."""
    if p.name == "tune":
        return 600.0  # "10m"
    if p.type == "array":
        return list(p.example)
    return p.example


def _config_value(config: dict[str, Any], ctx: dict[str, Any], p: RunParam) -> Any:
    return (config if p.into == "config" else ctx)[p.name]


def test_the_command_line_passes_each_example_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from graphtrim.cli.pipeline_context import _context_and_config

    monkeypatch.delenv("GRAPHTRIM_POLICY", raising=False)
    base = ["pipeline", "run", "--model", "models:/m/1", "--tracking-uri", "t", "-q"]
    for p in on("cli"):
        if p.into == "source":
            continue
        if p.type == "boolean":
            value = [] if p.flag.startswith("--no-") else ["true"]
        elif isinstance(p.example, list | dict):
            value = [json.dumps(p.example)]
        else:
            value = [str(p.example)]
        args = build_parser().parse_args([*base, p.flag, *value])
        ctx, config = _context_and_config(args)
        if p.into == "location":
            assert getattr(ctx, p.name) == p.example, p.name
            continue
        assert _config_value(config.to_json(), ctx.to_json(), p) == _expected(p), p.name


def test_a_boolean_option_takes_an_orchestrator_s_value() -> None:
    base = ["pipeline", "run", "--model", "m", "--tracking-uri", "t"]
    parse = build_parser().parse_args
    assert parse([*base, "--rejudge"]).rejudge is True
    assert parse([*base, "--rejudge", "true"]).rejudge is True
    assert parse([*base, "--rejudge", "false"]).rejudge is False
    assert parse(base).rejudge is False
    with pytest.raises(SystemExit) as exc:
        parse([*base, "--rejudge", "maybe"])
    assert exc.value.code == 2


def test_plan_run_passes_each_example_on(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("airflow")
    from graphtrim.airflow.run_plan import plan_run

    monkeypatch.delenv("GRAPHTRIM_POLICY", raising=False)
    base = {"model_name": "m", "version": "1", "variants": ["graph"], "preset": "default"}
    for p in on("dag"):
        if p.into == "source" or p.name == "device":
            continue
        planned = plan_run({**base, p.name: p.example}, "cpu")
        if p.into == "location":
            assert planned[p.name] == p.example, p.name
        elif p.into == "context":
            assert planned[p.name] is True, p.name
        else:
            assert planned["config"][p.name] == _expected(p), p.name
    # what the plan hands on besides the config: the source and the run's other parameters
    planned = plan_run(base, "gpu")
    assert planned["config"]["device"] == "gpu"
    extra = {p.name for p in on("dag") if p.into in ("context", "location")}
    assert set(planned) == {"model_uri", "config", "variants"} | extra


def test_the_kubeflow_pipeline_s_defaults_are_the_table_s(compiled: dict[str, Any]) -> None:
    declared = compiled["root"]["inputDefinitions"]["parameters"]
    for p in on("kfp"):
        spec = declared[p.name]
        default = p.default_value()
        if default is REQUIRED:
            assert "defaultValue" not in spec, p.name
        elif default is None:
            assert spec["defaultValue"] == ("{}" if p.type == "object" else ""), p.name
        else:
            assert spec["defaultValue"] == default, p.name


# ---------------------------------------------------------------- the config hash


# config hashes computed before the table existed: the lineage keys of existing runs
EARLIER_HASHES = {
    "default": ({}, "93f886e79d7e4af9990cd8535637858627d872c360ab6227d00db0a941c4b70e"),
    "variants": (
        {"variants": ("graph", "int8-dynamic")},
        "c2e7f94c20d956b2e7bf4af8f599be496e981dd0c8de3244cdfaa7f11669e96e",
    ),
    "preset": (
        {"preset": "safe"},
        "0820b5efc9003835b80a41f57f1b2bf85dd67cbb362028e7a9f25cf80216d983",
    ),
    "gpu": (
        {"device": "gpu", "tensorrt": True},
        "6988fe2ca304db113b5852d92dd8842da83403a624df5c0bd29d477cbfde2c40",
    ),
    "policy": (
        {"policy": {"variants": {"graph": {"latency": {"min_speedup": None}}}}},
        "5b5c85079bfd3eaf57ad71bd8df5685f902c088781a33a7c253eb9dbc5845d35",
    ),
    "policy {}": (
        {"policy": {}},
        "d737d9e49895c56f44532cdc461b52387c6cf35a308428f66308e025722a1774",
    ),
    "data": (
        {
            "calibration": "s3://b/c.npz",
            "eval_data": "x.npz",
            "data_sha256": {"calibration": "ab", "eval_data": "cd"},
        },
        "42a6a0c9021699c53848d78a46692a5d9ff0f56f3e99d7a892e80b28b6a4f648",
    ),
    "target and experiment": (
        {"target_name": "other", "experiment": "e2"},
        "93f886e79d7e4af9990cd8535637858627d872c360ab6227d00db0a941c4b70e",
    ),
    "no fallback": (
        {"fallback": False},
        "1bd3056760d1422ad0b415140097dc971dab74faf0fffe15e1369559ffb957be",
    ),
    "fx": (
        {"fx_simplify": True},
        "98f33bfc7efeb2bf58b2417b60415b9b63e7b0fa4db5f84ca4a60f67d99d1b78",
    ),
    "weights": (
        {"weights": {"weight_form": "ort"}},
        "b5f0b183779a54b753985a70371d026a345a22f9a1e6dba704488e3c59ce7c5d",
    ),
    "weights {}": (
        {"weights": {}},
        "93f886e79d7e4af9990cd8535637858627d872c360ab6227d00db0a941c4b70e",
    ),
    "tune": ({"tune": 600}, "5c10f91ecca32020f9e5bdec81d85009dc7c6b77ab38b6d21183dce8fd7e5a3c"),
    "opset": ({"opset": 21}, "13a9036e92acf98538e839de411b04d9c0394734d72a4d01fcec899a142de2aa"),
    "all": (
        {
            "variants": ("int8-static",),
            "preset": "safe",
            "fx_simplify": True,
            "weights": {"block_size": 64},
            "tune": 90.0,
            "opset": 23,
            "fallback": False,
        },
        "c6b3a09a7bb4bf4c5faf3d039159a915ba11c7eed0e354ecab9195b4c9aa9c50",
    ),
}


@pytest.mark.parametrize("case", sorted(EARLIER_HASHES))
def test_the_config_hash_of_an_earlier_run_is_unchanged(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from graphtrim.stages.context import PipelineConfig

    monkeypatch.delenv("GRAPHTRIM_POLICY", raising=False)
    fields, expected = EARLIER_HASHES[case]
    assert PipelineConfig(**fields).config_hash == expected
    if case == "default":
        narrowed = PipelineConfig(variants=("graph",)).hash_for("variants", "preset")
        assert narrowed == "8b682a8b616c758497c2d252e4eb435a9c5f3fb9a0015fb4b0676fe0ee8d29c3"


def test_the_hash_takes_what_the_table_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """A parameter marked hashed changes the hash when set to its example; one marked not
    hashed leaves it as it is."""
    from graphtrim.stages.context import PipelineConfig

    monkeypatch.delenv("GRAPHTRIM_POLICY", raising=False)
    plain = PipelineConfig().config_hash
    for p in run_params.config_params():
        value = p.example
        if p.type == "array":
            value = tuple(value)
        elif p.type == "duration":
            value = 600.0
        changed = PipelineConfig(**{p.name: value}).config_hash
        assert (changed != plain) == (p.hashed != "no"), p.name
