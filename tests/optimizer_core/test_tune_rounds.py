"""The settings search in steps (:mod:`graphtrim.tune.rounds`): plan, trials, select, judge,
with the state between the steps as JSON, as an orchestrator runs them over its workers."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from graphtrim.data import input_specs, load_npz
from graphtrim.examples.digits import DigitsTask
from graphtrim.gates.policy import GatePolicy
from graphtrim.tune import rounds
from graphtrim.tune.memory import graph_signature, op_histogram
from graphtrim.tune.search import TuneError, TuneSettings
from graphtrim.tune.search_state import SearchState
from tests.helpers import untimed_policy

SETTINGS = TuneSettings(budget_s=600, objective="latency", size_weight=0.25)


def _ops(path: Path) -> frozenset[str]:
    import onnx

    return frozenset(op for _, op in op_histogram(onnx.load(str(path))))


def _wire(doc: Any) -> Any:
    """What crosses between tasks: JSON."""
    return json.loads(json.dumps(doc))


def _search(
    task: DigitsTask,
    tmp: Path,
    kinds: list[str],
    *,
    remembered: dict[str, Any] | None = None,
    settings: TuneSettings = SETTINGS,
    layers: int = rounds.ROUNDS,
) -> tuple[SearchState, list[list[dict[str, Any]]], dict[int, str]]:
    """Every step on its own, through JSON: the state, each round's results and the feasible
    trials' models by number."""
    specs = input_specs(task.model)
    data, calib = load_npz(task.eval, specs), load_npz(task.calibration, specs)
    ops = _ops(task.model)
    state, batch = rounds.plan(
        kinds,
        ops,
        signature=graph_signature(task.model),
        settings=settings,
        calibration=True,
        remembered=remembered,
        rounds=layers,
    )
    done: list[list[dict[str, Any]]] = []
    paths: dict[int, str] = {}
    while batch:
        results = []
        for spec in _wire(batch):  # each its own task: its own folder, its own timing
            out = rounds.run_trial(
                spec,
                task.model,
                tmp / f"t{spec['number']}",
                device="cpu",
                policy=untimed_policy(),
                data=data,
                calibration=calib,
                config=None,
                settings=state.tune_settings(),
            )
            # as the trial task does: a feasible model goes to the store, this worker's path
            # means nothing to the next task
            path = out["trial"].pop("path")
            out["trial"]["path"] = None
            if path:
                paths[spec["number"]] = path
                out["trial"]["uri"] = f"store://{spec['number']}"
            results.append(_wire(out))
        done.append(results)
        state = SearchState.from_json(_wire(state.to_json()))
        state, batch = rounds.select(state, results)
    return SearchState.from_json(_wire(state.to_json())), done, paths


@pytest.mark.slow
def test_the_rounds_search_and_judge_like_the_one_process_search(
    digits_task: DigitsTask, tmp_path: Path
) -> None:
    state, done, paths = _search(digits_task, tmp_path, ["int8-static"])
    assert state.done and len(done) >= 2, state.kinds
    first = [r["trial"]["key"] for r in done[0]]
    assert first == ["int8-static"]  # the recipe first
    second = {r["trial"]["origin"] for r in done[1]}
    assert second == {"neighbour of int8-static"}
    numbers = [r["trial"]["number"] for rs in done for r in rs]
    assert numbers == list(range(1, len(numbers) + 1))  # each trial its own number
    search = state.kinds["int8-static"]
    assert search.stopped in ("converged", "exhausted", "rounds"), search.stopped
    # each feasible trial was timed against the reference on its own worker
    for r in (r for rs in done for r in rs):
        t = r["trial"]
        if t["status"] == "screened":
            assert t["timings"] and r["ref_ms"] > 0 and t["uri"]
    wanted = rounds.to_judge(search, state.tune_settings())
    assert 1 <= len(wanted) <= rounds.JUDGED + 1
    assert any(t["key"] == "int8-static" for t in wanted)  # the recipe is judged beside them
    specs = input_specs(digits_task.model)
    result = rounds.judge(
        state,
        "int8-static",
        digits_task.model,
        tmp_path / "out",
        {t["number"]: paths[t["number"]] for t in wanted},
        device="cpu",
        policy=untimed_policy(),
        data=load_npz(digits_task.eval, specs),
    )
    assert result.champion is not None and result.output and Path(result.output).exists()
    assert result.champion.verdict and result.champion.verdict["passed"]
    assert result.against_recipe() is not None
    assert len(result.trials) == len(numbers)
    assert result.notes[0] == f"{len(done)} round(s) over the worker pool"


@pytest.mark.slow
def test_a_remembered_champion_is_checked_with_its_neighbourhood_in_one_round(
    digits_task: DigitsTask, tmp_path: Path
) -> None:
    remembered = {"int8-static": {"kind": "int8-static", "settings": {"per_channel": False}}}
    state, done, _ = _search(digits_task, tmp_path, ["int8-static"], remembered=remembered)
    assert len(done) == 1  # one round on the pool: the remembered and its neighbours
    origins = [r["trial"]["origin"] for r in done[0]]
    assert origins[0] == "memory" and len(origins) > 1
    assert all(o == "neighbour of int8-static[per_channel=false]" for o in origins[1:])
    search = state.kinds["int8-static"]
    assert search.mode == "memory" and search.stopped.startswith("memory")


@pytest.mark.slow
def test_remembered_settings_that_fail_go_on_as_a_full_search(
    digits_task: DigitsTask, tmp_path: Path
) -> None:
    remembered = {"int8-static": {"kind": "int8-static", "settings": {"op_types": ["Conv"]}}}
    ops = _ops(digits_task.model)
    state, batch = rounds.plan(
        ["int8-static"],
        ops,
        signature="s",
        settings=SETTINGS,
        calibration=True,
        remembered=remembered,
    )
    # the remembered trial comes back infeasible (its task built it over its accuracy gate)
    spec = batch[0]
    failed = {
        "trial": {
            "number": spec["number"],
            **spec["candidate"],
            "round": 0,
            "origin": "memory",
            "status": "inaccurate",
            "accuracy_passed": False,
        },
        "ref_ms": None,
        "accuracy_s": 0.1,
        "seconds": 1.0,
    }
    state, nxt = rounds.select(state, [failed])
    search = state.kinds["int8-static"]
    assert search.mode == "memory, then full" and search.stopped is None
    assert [b["candidate"]["key"] for b in nxt] == ["int8-static"]  # the recipe
    assert "failed their gates here" in search.notes[0]


def test_a_trial_that_would_start_after_the_deadline_is_not_built(
    digits_task: DigitsTask, tmp_path: Path
) -> None:
    ops = _ops(digits_task.model)
    state, batch = rounds.plan(
        ["int8-dynamic"], ops, signature="s", settings=SETTINGS, calibration=True
    )
    spec = {**batch[0], "deadline": time.time() - 600}  # or a worker 10 minutes ahead
    out = rounds.run_trial(
        spec,
        digits_task.model,
        tmp_path,
        device="cpu",
        policy=GatePolicy(),
        data=None,
        calibration=None,
        config=None,
        settings=SETTINGS,
    )
    assert out["trial"]["status"] == "skipped" and "budget" in out["trial"]["error"]
    assert re.search(r"\b60\d s past the round's deadline", out["trial"]["error"])
    assert "clock is ahead" in out["trial"]["error"]  # the one cause a queue does not explain
    assert not list(tmp_path.iterdir())  # nothing built
    state, nxt = rounds.select(state, [out])
    assert nxt == [] and state.kinds["int8-dynamic"].stopped == "budget"


def test_the_last_round_the_orchestrator_has_ends_the_search(digits_task: DigitsTask) -> None:
    ops = _ops(digits_task.model)
    state, batch = rounds.plan(
        ["int8-dynamic"], ops, signature="s", settings=SETTINGS, calibration=True, rounds=1
    )
    assert batch and batch[0]["deadline"] > time.time()
    state, nxt = rounds.select(state, [])
    assert nxt == [] and state.kinds["int8-dynamic"].stopped == "rounds"


def test_a_plan_refuses_what_it_cannot_search(digits_task: DigitsTask) -> None:
    ops = frozenset({"Conv", "Relu"})
    with pytest.raises(TuneError, match="no variant of int4-weight applies"):
        rounds.plan(["int4-weight"], ops, signature="s", settings=SETTINGS, calibration=True)
    with pytest.raises(TuneError, match="must be resolved"):
        rounds.plan(["graph"], ops, signature="s", settings=TuneSettings(), calibration=True)
    with pytest.raises(TuneError, match="not a search state"):
        SearchState.from_json({"kinds": {}, "bogus": 1})


def test_the_search_steps_refuse_what_they_cannot_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from graphtrim.cli.main import main

    common = ["--tracking-uri", f"sqlite:///{tmp_path / 'db'}", "--artifacts", str(tmp_path)]
    outs = ["--search-output", str(tmp_path / "s.json"), "--batch", str(tmp_path / "b.json")]
    assert main(["pipeline", "tune", "select", *common, *outs]) == 2
    assert "needs --search, --trials" in capsys.readouterr().err
    assert main(["pipeline", "tune", "plan", *common, *outs]) == 2
    assert "needs --input export=FILE, --input optimize=FILE" in capsys.readouterr().err
    bad = ["--search", "null", "--trials", '{"not": "a list"}']
    assert main(["pipeline", "tune", "select", *common, *outs, *bad]) == 2
    assert "the round's results, a JSON list" in capsys.readouterr().err
    # no search: a select passes none on, and an empty round
    ok = ["--search", "null", "--trials", "[]"]
    assert main(["pipeline", "tune", "select", *common, *outs, *ok]) == 0
    assert json.loads((tmp_path / "s.json").read_text()) is None
    assert json.loads((tmp_path / "b.json").read_text()) == []


def test_when_the_recipe_was_in_the_remembered_neighbourhood_the_full_search_goes_on_from_it(
    digits_task: DigitsTask,
) -> None:
    ops = _ops(digits_task.model)
    remembered = {"int8-dynamic": {"kind": "int8-dynamic", "settings": {"per_channel": False}}}
    state, batch = rounds.plan(
        ["int8-dynamic"],
        ops,
        signature="s",
        settings=SETTINGS,
        calibration=True,
        remembered=remembered,
    )
    keys = [b["candidate"]["key"] for b in batch]
    assert keys[0] == "int8-dynamic[per_channel=false]" and "int8-dynamic" in keys

    def result(spec: dict[str, Any], status: str) -> dict[str, Any]:
        feasible = status == "screened"
        trial = {
            "number": spec["number"],
            **spec["candidate"],
            "round": 0,
            "origin": spec["origin"],
            "status": status,
            "accuracy_passed": feasible,
            "size_ratio": 0.3,
            "timings": [{"runs": 20, "speedup_p50": 1.5, "spread": 0.01}] if feasible else [],
            "uri": f"store://{spec['number']}" if feasible else None,
        }
        return {"trial": trial, "ref_ms": 1.0, "accuracy_s": 0.1, "seconds": 1.0}

    # the remembered settings fail here; the recipe beside them passes its screening
    results = [
        result(
            b,
            "inaccurate"
            if b["origin"] == "memory"
            else "screened"
            if b["candidate"]["key"] == "int8-dynamic"
            else "failed",
        )
        for b in batch
    ]
    state, nxt = rounds.select(state, results)
    search = state.kinds["int8-dynamic"]
    assert search.mode == "memory, then full" and search.stopped is None
    # not the recipe again: its neighbours, the search going on from the best so far
    assert nxt and all(b["origin"] == "neighbour of int8-dynamic" for b in nxt)
    assert not {b["candidate"]["key"] for b in nxt} & set(keys)
