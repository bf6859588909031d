"""``graphtrim tune``: the search space, the search on a real model, its memory, its budget."""

from __future__ import annotations

import json
from html import escape
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from graphtrim.cli.main import main
from graphtrim.data import input_specs, load_npz
from graphtrim.examples.digits import DigitsTask
from graphtrim.tune import search as search_mod
from graphtrim.tune.memory import FileMemory, TuneMemoryError, graph_signature
from graphtrim.tune.search import TuneError, TuneSettings, tune
from graphtrim.tune.space import (
    SPACE,
    Candidate,
    forbidden,
    neighbours,
    start_points,
)
from tests.helpers import untimed_policy


def _data(task: DigitsTask) -> tuple[Any, Any]:
    specs = input_specs(task.model)
    return load_npz(task.eval, specs), load_npz(task.calibration, specs)


def _tune(task: DigitsTask, out: Path, **kw: Any) -> Any:
    """A search of the digits CNN (or ``model=``) on its evaluation and calibration data, under
    ``policy`` (default: :func:`tests.helpers.untimed_policy`)."""
    data, calib = _data(task)
    kw.setdefault("policy", untimed_policy())
    return tune(kw.pop("model", task.model), out, data=data, calibration=calib, **kw)


# -- the space -------------------------------------------------------------------------------


def test_a_candidate_keeps_only_what_differs_from_the_fixed_recipe() -> None:
    recipe = Candidate.of("int8-static", {"activation_type": "int8", "method": "minmax"})
    assert recipe.recipe and recipe.key == "int8-static" and recipe.overrides() == {}
    c = Candidate.of("int8-static", {"op_types": ["Conv", "MatMul", "Gemm"], "per_channel": False})
    assert c.key == 'int8-static[op_types=["Conv","MatMul","Gemm"],per_channel=false]'
    assert c.overrides() == {"op_types": ["Conv", "MatMul", "Gemm"], "per_channel": False}
    assert Candidate.from_json(json.loads(json.dumps(c.to_json()))) == c
    with pytest.raises(KeyError, match="not a knob of int8-dynamic"):
        Candidate.of("int8-dynamic", {"method": "entropy"})
    with pytest.raises(KeyError, match="no search space"):
        Candidate.of("int3", {})


def test_neighbours_change_one_knob_and_skip_what_cannot_be_built() -> None:
    start = Candidate.of("int8-static")
    found = neighbours(start, frozenset({"Conv", "Relu"}))
    for n in found:
        diff = {k for k, v in n.values().items() if start.values()[k] != v}
        assert len(diff) == 1, n.key
        assert forbidden(n) is None
    keys = {n.key for n in found}
    # int8 activations with uint8 weights: onnxruntime refuses them
    assert 'int8-static[weight_type="uint8"]' not in keys
    assert forbidden(Candidate.of("int8-static", {"weight_type": "uint8"})) is not None
    assert 'int8-static[activation_type="uint8"]' in keys
    # every other value of every knob, less the forbidden one
    expected = sum(len(k.values) - 1 for k in SPACE["int8-static"]) - 1
    assert len(found) == expected
    # op types the model lacks are not tried
    dyn = {n.key for n in neighbours(Candidate.of("int8-dynamic"), frozenset({"Conv"}))}
    assert 'int8-dynamic[op_types=["Conv"]]' in dyn
    assert not any("MatMul" in k for k in dyn)


def test_start_points_are_the_recipes_the_model_can_take() -> None:
    conv_only = frozenset({"Conv", "Relu", "Gemm"})
    kinds = ["graph", "int8-dynamic", "int8-static", "int4-weight"]
    assert [c.key for c in start_points(kinds, conv_only)] == [
        "graph",
        "int8-dynamic",
        "int8-static",
    ]
    # without calibration data there is no static quantization
    assert "int8-static" not in [c.key for c in start_points(kinds, conv_only, calibration=False)]
    assert "int4-weight" in [c.key for c in start_points(kinds, conv_only | {"MatMul"})]


def test_a_gain_inside_the_noise_keeps_the_fixed_recipe() -> None:
    from graphtrim.tune.choice import choose
    from graphtrim.tune.search import Trial

    def trial(n: int, key: dict[str, Any], speedup: float, spread: float, size: float) -> Trial:
        t = Trial(n, Candidate.of("int8-static", key), 0, "test", status="screened")
        t.timings.append((200, speedup, spread))
        t.size_ratio = size
        return t

    recipe = trial(1, {}, 2.00, 0.01, 0.25)
    close = trial(2, {"per_channel": False}, 2.03, 0.01, 0.24)  # +1.5%: inside 2%
    far = trial(3, {"activation_type": "uint8"}, 2.40, 0.01, 0.25)  # +20%
    noisy = trial(4, {"method": "entropy"}, 2.10, 0.08, 0.25)  # +5%, blocks 8% apart
    champion, note = choose([recipe, close], "latency", 0.02)
    assert champion is recipe and note and "inside this run's noise" in note
    assert choose([recipe, close, far], "latency", 0.02) == (far, None)
    assert choose([noisy, recipe], "latency", 0.02)[0] is recipe
    # sizes are exact: the smaller one wins however close
    assert choose([recipe, close], "size", 0.02) == (close, None)
    # no recipe among them: the best
    assert choose([close, far], "latency", 0.02) == (far, None)
    # from memory, the remembered champion is what a challenger must beat beyond the noise
    kept, why = choose([recipe, close, far], "latency", 0.02, incumbent=far.candidate)
    assert kept is far and why is None
    remembered = trial(5, {"per_channel": False, "method": "entropy"}, 2.37, 0.01, 0.24)
    kept, why = choose([recipe, remembered, far], "latency", 0.02, remembered.candidate)
    assert kept is remembered and why and "remembered champion" in why


# -- the memory ------------------------------------------------------------------------------


def test_the_signature_ignores_weights_and_sees_the_graph(tmp_path: Path) -> None:
    from onnx import TensorProto, helper, numpy_helper

    def model(weight: np.ndarray, op: str) -> Path:
        g = helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node(op, ["y"], ["z"])],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
            [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 4])],
            [numpy_helper.from_array(weight, "w")],
        )
        path = tmp_path / f"{op}{weight.sum():.0f}.onnx"
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
        return path

    rng = np.random.default_rng(0)
    a = model(rng.standard_normal((4, 4)).astype(np.float32), "Relu")
    b = model(rng.standard_normal((4, 4)).astype(np.float32) + 5, "Relu")
    c = model(rng.standard_normal((4, 4)).astype(np.float32), "Sigmoid")
    assert graph_signature(a) == graph_signature(b)
    assert graph_signature(a) != graph_signature(c)


def test_the_file_memory_keeps_one_entry_per_signature_and_device(tmp_path: Path) -> None:
    mem = FileMemory(tmp_path / "m" / "memory.json")
    assert mem.recall("abc", "cpu") is None
    mem.remember("abc", "cpu", {"kind": "graph", "settings": {}})
    mem.remember("abc", "gpu", {"kind": "fp16", "settings": {}})
    assert mem.recall("abc", "cpu")["kind"] == "graph"
    assert mem.recall("abc", "gpu")["kind"] == "fp16"
    assert "remembered" in mem.recall("abc", "cpu")
    assert not list((tmp_path / "m").glob(".*tmp"))
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(TuneMemoryError, match="not a graphtrim tune memory"):
        FileMemory(tmp_path / "bad.json").recall("abc", "cpu")


# -- the search ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def searched(
    digits_task: DigitsTask, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, Path, Path]:
    """A full search of the digits CNN (graph and the int8 kinds), remembered in a file."""
    out = tmp_path_factory.mktemp("tune")
    memory = out / "memory.json"
    result = _tune(
        digits_task,
        out / "first",
        kinds=["graph", "int8-dynamic", "int8-static"],
        memory=FileMemory(memory),
    )
    return result, out, memory


@pytest.mark.slow  # a whole search on the digits model (make test runs it)
def test_the_search_starts_from_the_recipes_and_its_champion_passes_every_gate(
    searched: tuple[Any, Path, Path], digits_task: DigitsTask
) -> None:
    import onnxruntime as ort

    result, _out, _ = searched
    trials = result.trials
    assert [t.candidate.key for t in trials[:3]] == ["graph", "int8-dynamic", "int8-static"]
    assert all(t.origin == "recipe" for t in trials[:3])
    # later rounds explore the neighbourhoods of the best ones
    assert any(t.origin.startswith("neighbour of ") for t in trials)
    assert result.stopped in ("converged", "exhausted", "rounds")
    champion = result.champion
    assert champion is not None and champion.verdict is not None
    assert champion.verdict["passed"]
    assert set(champion.verdict["gates"]) == {"size", "accuracy", "latency"}
    assert all(status == "pass" for status in champion.verdict["gates"].values())
    # the best fixed recipe was judged in the same timing run
    versus = result.against_recipe()
    assert versus is not None and versus["recipe"] in ("graph", "int8-dynamic", "int8-static")
    judged = [t for t in trials if t.verdict is not None]
    assert champion in judged and any(t.candidate.recipe for t in judged)
    # the champion file is the one that was judged: same size, runs, agrees with the reference
    output = Path(result.output)
    assert output.name == "digits_cnn.tuned.onnx" and output.exists()
    assert output.stat().st_size == champion.bytes
    data, _ = _data(digits_task)
    feeds = next(iter(data))
    ref = ort.InferenceSession(str(digits_task.model)).run(None, feeds)[0]
    got = ort.InferenceSession(str(output)).run(None, feeds)[0]
    assert (got.argmax(1) == ref.argmax(1)).mean() > 0.95
    # nothing but the champion and reports is left behind
    assert sorted(p.name for p in output.parent.iterdir()) == ["digits_cnn.tuned.onnx"]


@pytest.mark.slow  # a whole search on the digits model (make test runs it)
def test_every_trial_is_recorded_with_its_settings_and_the_front_drawn(
    searched: tuple[Any, Path, Path],
) -> None:
    from graphtrim.tune.search import write_result

    result, out, _ = searched
    reports = write_result(result, out / "reports")
    doc = json.loads(reports["json"].read_text())
    assert len(doc["trials"]) == len(result.trials)
    for t in doc["trials"]:
        assert set(t) >= {"kind", "settings", "key", "status", "timings", "verdict", "origin"}
        assert t["status"] in ("screened", "failed", "inaccurate", "too-big", "built")
        assert t["status"] != "failed" or t["error"]
    assert doc["front"], "no Pareto front"
    front = {t["number"]: t for t in doc["trials"] if t["number"] in doc["front"]}
    assert all(t["timings"] and t["size_ratio"] for t in front.values())
    html = reports["html"].read_text()
    assert "data:image/png;base64," in html
    assert escape(doc["champion"]["key"]) + " (champion)" in html
    assert doc["champion"]["key"] in reports["markdown"].read_text()


@pytest.mark.slow  # a whole search on the digits model (make test runs it)
def test_the_next_version_starts_from_the_remembered_champion(
    searched: tuple[Any, Path, Path], digits_task: DigitsTask, tmp_path: Path
) -> None:
    first, _, memory = searched
    entry = json.loads(memory.read_text())["entries"]
    assert list(entry) == [f"cpu:{first.signature}"]
    assert entry[f"cpu:{first.signature}"]["key"] == first.champion.candidate.key
    # a new version: the same graph with other weights
    model = onnx.load(str(digits_task.model))
    rng = np.random.default_rng(1)
    for init in model.graph.initializer:
        arr = onnx.numpy_helper.to_array(init)
        if arr.dtype == np.float32 and arr.size > 16:
            noisy = arr * (1 + 0.05 * rng.standard_normal(arr.shape)).astype(np.float32)
            init.CopyFrom(onnx.numpy_helper.from_array(noisy, init.name))
    v2 = tmp_path / "digits_v2.onnx"
    onnx.save(model, v2)
    assert graph_signature(v2) == first.signature
    second = _tune(
        digits_task,
        tmp_path / "second",
        model=v2,
        kinds=["graph", "int8-dynamic", "int8-static"],
        memory=FileMemory(memory),
    )
    assert second.mode == "memory"
    assert second.trials[0].origin == "memory"
    assert second.trials[0].candidate == first.champion.candidate
    # one neighbourhood only: the remembered candidate and its neighbours
    start = first.champion.candidate
    assert len(second.trials) <= 1 + len(neighbours(start))
    assert len(second.trials) < len(first.trials)
    assert all(t.origin in ("memory", f"neighbour of {start.key}") for t in second.trials)
    # the neighbourhood re-checked is in the knobs that depend on the weights: the others
    # time the same on every version of one graph
    weight_knobs = {k.field for k in SPACE[start.kind] if k.weights}
    for t in second.trials[1:]:
        changed = {k for k, v in t.candidate.values().items() if start.values()[k] != v}
        assert changed <= weight_knobs, t.candidate.key
    assert len(second.trials) == 1 + len(neighbours(start, weights_only=True))
    assert second.champion is not None and second.champion.verdict["passed"]


@pytest.mark.slow  # a whole search on the digits model (make test runs it)
def test_settings_remembered_that_fail_here_fall_back_to_the_full_search(
    digits_task: DigitsTask, tmp_path: Path
) -> None:
    memory = FileMemory(tmp_path / "memory.json")
    signature = graph_signature(digits_task.model)
    # the digits CNN has no MatMul weight: a remembered int4-weight cannot be built
    memory.remember(signature, "cpu", {"kind": "int4-weight", "settings": {"block_size": 64}})
    result = _tune(
        digits_task,
        tmp_path / "out",
        kinds=["graph", "int8-static", "int4-weight"],
        memory=memory,
        settings=TuneSettings(max_rounds=1),
    )
    assert result.mode == "memory, then full"
    assert result.trials[0].status == "failed" and "MatMul" in (result.trials[0].error or "")
    assert any("full search" in n for n in result.notes)
    assert [t.candidate.key for t in result.trials[1:3]] == ["graph", "int8-static"]
    assert result.champion is not None
    assert memory.recall(signature, "cpu")["kind"] != "int4-weight"


@pytest.mark.slow  # a whole search on the digits model (make test runs it)
def test_a_kind_whose_recipe_misses_a_gate_is_searched_from_its_nearest_miss(
    digits_task: DigitsTask, tmp_path: Path
) -> None:
    """Per-channel scales make the static recipe of the digits CNN a little larger than
    per-tensor ones: with a size gate between the two, the recipe misses it and the search
    goes on from it to a neighbour that passes."""

    result = _tune(
        digits_task,
        tmp_path / "probe",
        kinds=["int8-static"],
        settings=TuneSettings(max_rounds=0),
    )
    recipe = result.trials[0]
    assert recipe.candidate.recipe and recipe.size_ratio is not None
    policy = untimed_policy(
        {"variants": {"int8-static": {"size": {"max_ratio": recipe.size_ratio - 1e-4}}}}
    )
    result = _tune(
        digits_task,
        tmp_path / "out",
        kinds=["int8-static"],
        policy=policy,
        settings=TuneSettings(max_rounds=1),
    )
    assert result.trials[0].status == "too-big"
    assert all(t.origin == "neighbour of int8-static" for t in result.trials[1:])
    assert result.champion is not None
    assert result.champion.candidate.values()["per_channel"] is False
    assert result.champion.size_ratio < recipe.size_ratio


@pytest.mark.slow  # a whole search on the digits model (make test runs it)
def test_when_no_finalist_passes_the_next_candidates_are_judged(
    digits_task: DigitsTask, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The finalists' full judgement fails (here: made to, as all the data can fail where the
    screening subset passed): the next best candidates are judged, and one of them wins."""
    real_judge = search_mod._Search.judge
    groups: list[list[str]] = []

    def judge(self: Any, finalists: Any) -> Any:
        groups.append([t.candidate.key for t in finalists])
        if len(groups) == 1:
            for t in finalists:
                t.verdict = {"passed": False, "gates": {}, "reasons": ["made to fail"]}
            return None, None
        return real_judge(self, finalists)

    monkeypatch.setattr(search_mod._Search, "judge", judge)
    result = _tune(
        digits_task,
        tmp_path / "out",
        kinds=["int8-static"],
        settings=TuneSettings(max_rounds=1),
    )
    assert len(groups) == 2 and not set(groups[0]) & set(groups[1])
    assert result.champion is not None and result.champion.candidate.key in groups[1]


@pytest.mark.slow  # a whole search on the digits model (make test runs it)
def test_the_policy_chooses_what_the_champion_is_best_at(
    digits_task: DigitsTask, tmp_path: Path
) -> None:
    from graphtrim.gates import GatePolicy
    from graphtrim.gates.policy import PolicyError

    policy = untimed_policy({"tune": {"objective": "size"}})
    result = _tune(
        digits_task,
        tmp_path / "out",
        kinds=["int8-static"],
        policy=policy,
        settings=TuneSettings(max_rounds=1),
    )
    assert result.objective == "size"
    assert result.champion is not None
    # the finalists are the smallest candidates; the champion the smallest that passed every
    # gate (a small QOperator model can fail its latency gate)
    judged = [t for t in result.trials if t.verdict is not None]
    finalists = sorted(t.size_ratio for t in result.trials if t.feasible and t.size_ratio)[:2]
    assert all(t.size_ratio in finalists or t.candidate.recipe for t in judged)
    passed = [t for t in judged if t.verdict["passed"]]
    assert result.champion.size_ratio == min(t.size_ratio for t in passed)
    assert result.to_json()["objective"] == "size"
    # the command's flag wins over the policy
    flagged = _tune(
        digits_task,
        tmp_path / "flag",
        kinds=["graph"],
        policy=policy,
        settings=TuneSettings(max_rounds=0, objective="latency"),
    )
    assert flagged.objective == "latency"
    for bad, why in (
        ({"objective": "fastest"}, "tune.objective"),
        ({"size_weight": -1}, "tune.size_weight"),
        ({"budget": 5}, "unknown key"),
    ):
        with pytest.raises(PolicyError, match=why):
            GatePolicy({"tune": bad})


@pytest.mark.slow  # a whole search on the digits model (make test runs it)
def test_a_gpu_search_takes_fp16_and_a_crashing_candidate_fails_alone(
    digits_task: DigitsTask, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the GPU path (routed to the CPU provider by the explicit test switch) fp16 is
    searched; a candidate whose build raises an error no converter should is a failed trial
    with that error, and the search goes on."""
    from graphtrim.quantize import build as build_mod

    monkeypatch.setenv("GRAPHTRIM_TEST_GPU_ON_CPU", "1")
    real = build_mod.build_variant

    def build_variant(src: Any, dst: Any, variant: str, **kw: Any) -> Any:
        if variant == "graph" and kw["config"].preset == "compact":
            raise RuntimeError("a defect in a converter")
        return real(src, dst, variant, **kw)

    monkeypatch.setattr(build_mod, "build_variant", build_variant)
    result = _tune(
        digits_task,
        tmp_path / "out",
        device="gpu",
        kinds=["graph", "fp16"],
        settings=TuneSettings(max_rounds=1),
    )
    assert result.device == "gpu"
    by_key = {t.candidate.key: t for t in result.trials}
    assert by_key["fp16"].status == "screened" and by_key["fp16"].size_ratio < 0.6
    crashed = by_key['graph[preset="compact"]']
    assert crashed.status == "failed"
    assert crashed.error == "RuntimeError: a defect in a converter"
    assert result.champion is not None


@pytest.mark.slow  # a whole search on the digits model (make test runs it)
def test_the_budget_ends_the_search_with_the_best_so_far_and_the_reason(
    digits_task: DigitsTask, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each build costs 100 s of a simulated clock: a 250 s budget has room for the three
    recipes' round, then stops before the next build, and the finalists are still judged."""
    built: list[str] = []
    real_build = search_mod._Search.build

    class Clock(search_mod._Clock):
        def elapsed(self) -> float:
            return 100.0 * len(built)

        def left(self) -> float:
            return self.deadline - self.start - self.elapsed()

    def build(self: Any, candidate: Any, *args: Any, **kwargs: Any) -> Any:
        built.append(candidate.key)
        return real_build(self, candidate, *args, **kwargs)

    monkeypatch.setattr(search_mod, "_Clock", Clock)
    monkeypatch.setattr(search_mod._Search, "build", build)
    result = _tune(
        digits_task,
        tmp_path / "out",
        kinds=["graph", "int8-dynamic", "int8-static"],
        settings=TuneSettings(budget_s=250.0),
    )
    assert result.stopped == "budget"
    assert built == ["graph", "int8-dynamic", "int8-static"]
    assert result.champion is not None and result.champion.candidate.recipe
    assert result.output is not None


def test_a_budget_spent_before_any_build_says_so(digits_task: DigitsTask, tmp_path: Path) -> None:
    result = tune(
        digits_task.model,
        tmp_path / "out",
        kinds=["graph"],
        settings=TuneSettings(budget_s=1e-6),
    )
    assert result.stopped == "budget" and not result.trials
    assert result.champion is None and result.output is None


def test_bad_settings_are_refused_before_any_work(digits_task: DigitsTask, tmp_path: Path) -> None:
    with pytest.raises(TuneError, match="objective"):
        tune(digits_task.model, tmp_path, settings=TuneSettings(objective="fastest"))
    with pytest.raises(TuneError, match="no search space for int3"):
        tune(digits_task.model, tmp_path, kinds=["int3"])
    with pytest.raises(TuneError, match="no variant of int4-weight applies"):
        tune(digits_task.model, tmp_path, kinds=["int4-weight"])
    assert not list(tmp_path.iterdir()) or all(p.is_dir() for p in tmp_path.iterdir())


# -- the command line ------------------------------------------------------------------------


@pytest.mark.slow  # a whole search on the digits model (make test runs it)
def test_the_command_writes_the_champion_reports_and_memory(
    digits_task: DigitsTask, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = [
        "tune",
        str(digits_task.model),
        "-o",
        str(out),
        "--calibration",
        str(digits_task.calibration),
        "--data",
        str(digits_task.eval),
        "--kinds",
        "int8-static",
        "--budget",
        "5m",
        "--memory",
        str(tmp_path / "memory.json"),
        "-q",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("champion int8-static")
    assert (out / "digits_cnn.tuned.onnx").exists()
    assert {p.name for p in out.iterdir()} >= {"tune.json", "tune.md", "tune.html"}
    assert json.loads((tmp_path / "memory.json").read_text())["entries"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--budget", "ten minutes"], "not a duration"),
        (["--budget", "0s"], "must be positive"),
        (["--kinds", "int3"], "no search space for int3"),
    ],
)
def test_the_command_refuses_bad_arguments(
    digits_task: DigitsTask,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    argv = ["tune", str(digits_task.model), "-o", str(tmp_path / "out"), *extra]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusal
        code = int(exc.code or 0)
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_durations_read_as_a_user_writes_them() -> None:
    import argparse

    from graphtrim.cli.argtypes import duration

    assert duration("600") == 600
    assert duration("90s") == 90
    assert duration("10m") == 600
    assert duration("1h30m") == 5400
    assert duration("1.5m") == 90
    for bad in ("", "m", "10 minutes", "-5", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            duration(bad)


# -- the knobs the converters gained for the search -------------------------------------------


def test_static_quantization_writes_the_qoperator_form_and_reads_the_batches_asked_for(
    digits_task: DigitsTask, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from graphtrim.quantize import int8 as int8_mod
    from graphtrim.quantize.build import QuantizeConfig, QuantizeError, build_variant

    read: list[int] = []
    real_reader = int8_mod.CalibrationReader

    def reader(batches: Any, **kwargs: Any) -> Any:
        read.append(len(list(batches)))
        return real_reader(batches, **kwargs)

    monkeypatch.setattr(int8_mod, "CalibrationReader", reader)
    _, calib = _data(digits_task)
    assert len(calib.batches) > 1
    dst = tmp_path / "q.onnx"
    cfg = QuantizeConfig(quant_format="qoperator", calibration_batches=1, activation_type="uint8")
    build_variant(digits_task.model, dst, "int8-static", config=cfg, calibration=calib.batches)
    ops = {n.op_type for n in onnx.load(str(dst)).graph.node}
    assert "QLinearConv" in ops and "Conv" not in ops and "DequantizeLinear" in ops
    assert read == [1]
    with pytest.raises(QuantizeError, match="quant_format"):
        QuantizeConfig(quant_format="qdq2").validate()
    with pytest.raises(QuantizeError, match="calibration_batches"):
        QuantizeConfig(calibration_batches=0).validate()


def test_calibration_progress_stays_off_stdout(
    digits_task: DigitsTask, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "quantize",
        str(digits_task.model),
        "-o",
        str(tmp_path / "q.onnx"),
        "--variant",
        "int8-static",
        "--method",
        "entropy",
        "--calibration",
        str(digits_task.calibration),
        "-q",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("wrote ") and "histogram" not in out
