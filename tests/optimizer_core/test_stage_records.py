"""The stages' records and the one stage list: each record reads back what it writes, field for
field and in order; every stage in ``STAGES`` names its function and record type, and the
pipeline is their composition; the gate policy is parsed once per config."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import typing
from typing import Any

import pytest

from graphtrim.stages import STAGES, Stage, context, pipeline, records
from graphtrim.stages.context import PipelineConfig, PipelineError, StageContext

WORKER = {"host": "h", "name": "", "pid": 1, "queue": "gpu", "task": "quantize"}
SOURCE = {"name": "digits", "version": "3", "uri": "models:/digits/3", "tags": {}}
MODEL = {"uri": "s3://b/digits/3/export/ab", "sha256": "ab", "bytes": 10}
VERDICT = {
    "passed": True,
    "gates": {"serving": "pass", "accuracy": "pass"},
    "metrics": {"bytes": 10, "nodes": 4},
    "reasons": [],
    "model": MODEL,
}

# documents as the stages wrote them before they had record types
DOCS: dict[str, dict[str, Any]] = {
    "export": {
        "stage": "export",
        "worker": WORKER,
        "source": SOURCE,
        "config_hash": "c" * 64,
        "config": {"variants": ["graph"], "preset": "default"},
        "reused": {},
        "run_id": "r1",
        "model": MODEL,
        "export": {"flavor": "onnx", "exporter": "none", "inputs": [], "notes": []},
    },
    "optimize": {
        "stage": "optimize",
        "worker": WORKER,
        "run_id": "r1",
        "source": SOURCE,
        "model": MODEL,
        "preset": "default",
        "passes": ["cse", "dce"],
        "changed": ["dce"],
        "nodes_before": 9,
        "nodes_after": 4,
    },
    "quantize": {
        "stage": "quantize",
        "run_id": "r1",
        "source": SOURCE,
        "reused": [],
        "variants": {"graph": {"model": MODEL, "attempts": 1, "excluded": []}},
        "worker": WORKER,
    },
    "validate": {
        "stage": "validate",
        "worker": WORKER,
        "run_id": "r1",
        "source": SOURCE,
        "device": "cpu",
        "passed": ["graph"],
        "variants": {"graph": VERDICT},
        "reference": {"bytes": 20, "nodes": 9},
        "fingerprint": "f",
        "policy_hash": "p",
        "reports": {"html": "s3://b/r/evaluation.html"},
    },
    "register": {
        "stage": "register",
        "worker": WORKER,
        "run_id": "r1",
        "source": SOURCE,
        "target": "digits",
        "registered": {"graph": {"name": "digits", "version": "4", "created": True}},
        "failed": {},
        "existing": {},
    },
    "promote": {
        "stage": "promote",
        "run_id": "r1",
        "aliases": {"graph-candidate": {"version": "4", "previous": None, "moved": True}},
        "champion": {"alias": "champion", "moved": False, "reason": "x"},
        "worker": WORKER,
    },
}


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.name)
def test_a_record_writes_what_it_read_field_for_field(stage: Stage) -> None:
    doc = json.loads(json.dumps(DOCS[stage.name]))
    record = stage.record_type().from_json(doc)
    assert list(record.to_json().items()) == list(doc.items())  # same keys, values and order
    assert record == doc and dict(record) == doc  # it reads like its document
    again = type(record).from_json(json.loads(json.dumps(record.to_json())))
    assert again.to_json() == doc


def test_a_record_of_another_stage_or_a_partial_one_is_refused() -> None:
    with pytest.raises(PipelineError, match="expected a export record, got a optimize record"):
        records.ExportRecord.from_json(DOCS["optimize"])
    with pytest.raises(PipelineError, match="optimize: the record it was given lacks model"):
        records.ExportRecord.take(
            {"run_id": "r", "source": SOURCE}, ("run_id", "model"), "optimize"
        )


def test_validate_records_of_mapped_tasks_merge_into_one() -> None:
    a = DOCS["validate"]
    failed = {**VERDICT, "passed": False, "reasons": ["accuracy: x"]}
    b = {
        **a,
        "worker": {**WORKER, "task": "gate-1"},
        "passed": [],
        "variants": {"int8-static": failed},
        "reference": None,
        "fingerprint": "",
        "reports": {"html": "s3://b/r/evaluation-int8-static.html"},
    }
    merged = records.ValidateRecord.merge([b, a]).to_json()
    assert merged == {
        **b,
        "passed": ["graph"],
        "variants": {"int8-static": failed, "graph": VERDICT},
        "reference": a["reference"],  # from the task that measured
        "fingerprint": "f",
        "reports": {"html": "s3://b/r/evaluation-int8-static.html"},
        "all_reports": [b["reports"], a["reports"]],
        "workers": {"int8-static": b["worker"], "graph": WORKER},
    }
    assert list(merged)[-2:] == ["all_reports", "workers"]
    with pytest.raises(PipelineError, match="different pipeline runs"):
        records.ValidateRecord.merge([a, {**a, "run_id": "r2"}])


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.name)
def test_every_stage_names_its_function_and_record_type(stage: Stage) -> None:
    fn = stage.load()
    hints = typing.get_type_hints(fn)
    assert hints["return"] is stage.record_type()
    assert stage.name == stage.record_type().STAGE
    assert set(stage.args) <= set(stage.inputs)
    # (ctx, config, then its records in order; the first stage takes the model URI)
    positional = [
        p for p in inspect.signature(fn).parameters.values() if p.default is inspect.Parameter.empty
    ]
    assert len(positional) == 2 + max(1, len(stage.args)), positional


def test_the_pipeline_is_the_composition_of_the_stage_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``run_pipeline`` calls the functions the list names, in its order, each with the records
    it takes; the config the first stage resolved reaches the others."""
    calls: list[tuple[str, Any, tuple[Any, ...]]] = []

    def first(ctx: Any, config: Any, uri: str) -> dict[str, Any]:
        calls.append(("first", config.data_sha256, (uri,)))
        return {"config": {**config.to_json(), "data_sha256": {"eval_data": "d"}}, "n": 1}

    def second(ctx: Any, config: Any, *recs: Any) -> dict[str, Any]:
        calls.append(("second", config.data_sha256, recs))
        return {"n": 2}

    module = sys.modules[__name__]
    monkeypatch.setattr(module, "first", first, raising=False)
    monkeypatch.setattr(module, "second", second, raising=False)
    fake = (
        Stage("a", (), "x", function=f"{__name__}:first"),
        Stage("b", ("a",), "y", function=f"{__name__}:second"),
        Stage("c", ("a", "b"), "z", function=f"{__name__}:second", takes=("b",)),
    )
    monkeypatch.setattr(pipeline, "STAGES", fake)
    ctx = StageContext("sqlite:///unused.db", "unused")
    out = pipeline.run_pipeline(ctx, PipelineConfig(variants=("graph",), eval_data="e.npz"), "m")
    assert [c[0] for c in calls] == ["first", "second", "second"]
    assert calls[0][2] == ("m",) and calls[0][1] is None
    assert calls[1][1] == {"eval_data": "d"} and calls[1][2] == (out["a"],)
    assert calls[2][2] == (out["b"],)
    assert list(out) == ["a", "b", "c"]


def test_listing_the_stages_imports_nothing_heavy() -> None:
    code = (
        "import json, sys, graphtrim.stages as s; "
        "[(st.function, st.record) for st in s.STAGES]; "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert not {"mlflow", "torch", "onnxruntime", "boto3"} & loaded


def test_the_gate_policy_is_parsed_once_per_config(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """Made where the config is made; its copies (resolved, read back from a record) and every
    stage's use share that object."""
    from graphtrim.gates import policy as policy_module

    parsed: list[Any] = []
    real = policy_module.GatePolicy.__init__

    def counting(self: Any, *args: Any, **kw: Any) -> None:
        parsed.append(args)
        real(self, *args, **kw)

    monkeypatch.setattr(policy_module.GatePolicy, "__init__", counting)
    monkeypatch.setattr(context, "_PARSED_POLICIES", {})  # what earlier tests parsed
    data = tmp_path / "eval.npz"
    data.write_bytes(b"not read, only hashed")
    doc = {"defaults": {"size": {"max_ratio": 0.9}}, "promotion": {"margin": 0.07}}
    config = PipelineConfig(variants=("graph",), policy=doc, eval_data=str(data))
    ctx = StageContext("sqlite:///unused.db", str(tmp_path / "artifacts"))
    resolved = config.resolved(ctx)
    again = PipelineConfig.from_json(json.loads(json.dumps(resolved.to_json())))
    policies = {id(c.gate_policy()) for c in (config, resolved, again, config, again)}
    assert len(parsed) == 1 and len(policies) == 1
    assert again.gate_policy().promotion.margin == 0.07
    with pytest.raises(Exception, match="unknown top-level"):
        PipelineConfig(policy={"gates": {}})  # a bad policy is still refused when made


def test_the_cli_parses_a_policy_file_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI reads the file (its errors name it) and the config it makes keeps that parse."""
    from graphtrim.cli import main
    from graphtrim.gates import policy as policy_module

    parsed: list[Any] = []
    real = policy_module.GatePolicy.__init__

    def counting(self: Any, *args: Any, **kw: Any) -> None:
        parsed.append(kw.get("source"))
        real(self, *args, **kw)

    monkeypatch.setattr(policy_module.GatePolicy, "__init__", counting)
    monkeypatch.setattr(context, "_PARSED_POLICIES", {})
    policy = tmp_path / "gates.yaml"
    policy.write_text("defaults:\n  size:\n    max_ratio: 0.93\n")
    code = main(
        [
            "pipeline",
            "stage",
            "export",
            "--model",
            "models:/nothing/1",
            "--tracking-uri",
            f"sqlite:///{tmp_path / 'mlflow.db'}",
            "--artifacts",
            str(tmp_path / "a"),
            "--policy",
            str(policy),
            "--output",
            str(tmp_path / "export.json"),
            "-q",
        ]
    )
    assert code == 2 and "registered model 'nothing'" in capsys.readouterr().err
    assert parsed == [str(policy)]
