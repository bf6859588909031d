"""Work in a child process: a crash or a hang fails one item, never the caller."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from graphtrim import forkserver
from graphtrim.errors import GraphtrimError
from graphtrim.isolation import ChildFailed, call_isolated, map_isolated, step
from graphtrim.quantize.build import QuantizeError

HERE = "tests.optimizer_core.test_isolation"


def work(item: str, *, factor: int = 1) -> object:
    """The child's side: what each item makes the process do."""
    step(f"handling {item}")
    if item == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    if item == "abort":
        os.abort()
    if item == "hang":
        time.sleep(3600)
    if item == "exit":
        os._exit(3)
    if item.startswith("segfault-on-go:"):  # started, then a crash when told
        folder = Path(item.partition(":")[2])
        (folder / "started").write_text("")
        deadline = time.monotonic() + 600  # only against a hang
        while not (folder / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGSEGV)
    if item == "quantize-error":
        raise QuantizeError("no calibration data")
    if item == "value-error":
        raise ValueError("bad value")
    return {
        "item": item,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "mark": os.environ.get("GRAPHTRIM_TEST_MARK"),
        "double": len(item) * factor,
        "mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
    }


def test_results_come_back_from_a_child_process() -> None:
    out = map_isolated(f"{HERE}:work", ["a", "bb"], common={"factor": 2})
    assert [r["double"] for r in out] == [2, 4]
    assert out[0]["pid"] != os.getpid()
    assert out[0]["pid"] == out[1]["pid"]  # one child for the whole list


def test_a_crash_fails_its_item_and_the_others_go_on() -> None:
    out = map_isolated(f"{HERE}:work", ["a", "segfault", "b", "abort", "c"])
    assert out[0]["item"] == "a" and out[2]["item"] == "b" and out[4]["item"] == "c"
    for i, sig in ((1, "SIGSEGV"), (3, "SIGABRT")):
        assert isinstance(out[i], ChildFailed)
        assert out[i].signal_name == sig
        assert out[i].step == f"handling {['a', 'segfault', 'b', 'abort', 'c'][i]}"
        assert sig in str(out[i]) and "while handling" in str(out[i])
    assert out[0]["pid"] != out[2]["pid"] != out[4]["pid"]  # a new child after each crash


def test_fresh_gives_each_item_its_own_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory a child held for one item is not held through the next: one process each,
    large allocations mapped one by one; a crash still fails its item alone."""
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    out = map_isolated(f"{HERE}:work", ["a", "bb", "segfault", "ccc"], fresh=True)
    assert [out[i]["item"] for i in (0, 1, 3)] == ["a", "bb", "ccc"]
    assert len({out[i]["pid"] for i in (0, 1, 3)} | {os.getpid()}) == 4
    assert isinstance(out[2], ChildFailed) and out[2].signal_name == "SIGSEGV"
    assert {out[i]["mmap_threshold"] for i in (0, 1, 3)} == {str(1 << 20)}
    assert map_isolated(f"{HERE}:work", ["a"])[0]["mmap_threshold"] is None


def test_children_are_forked_from_a_server_of_the_callers_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """By default the children come from one fork server (their parent is not the caller); a
    changed environment gets a server started under it; ``spawn`` starts them itself."""
    monkeypatch.delenv("GRAPHTRIM_ISOLATION", raising=False)
    monkeypatch.setenv("GRAPHTRIM_TEST_MARK", "one")
    a, b = map_isolated(f"{HERE}:work", ["a", "bb"], fresh=True)
    assert a["pid"] != b["pid"] and a["ppid"] == b["ppid"] != os.getpid()
    assert a["mark"] == "one"
    monkeypatch.setenv("GRAPHTRIM_TEST_MARK", "two")
    (c,) = map_isolated(f"{HERE}:work", ["c"])
    assert c["mark"] == "two" and c["ppid"] not in (a["ppid"], os.getpid())
    monkeypatch.setenv("GRAPHTRIM_ISOLATION", "spawn")
    (d,) = map_isolated(f"{HERE}:work", ["d"])
    assert d["ppid"] == os.getpid() and d["mark"] == "two"


def test_a_replaced_server_still_reports_how_its_children_ended(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A child of a server replaced while it runs (another thread's call under a changed
    environment) is still reported by the signal that ended it."""
    monkeypatch.delenv("GRAPHTRIM_ISOLATION", raising=False)
    monkeypatch.setenv("GRAPHTRIM_TEST_MARK", "first")
    got: list[object] = []
    first = threading.Thread(
        target=lambda: got.extend(map_isolated(f"{HERE}:work", [f"segfault-on-go:{tmp_path}"]))
    )
    first.start()
    deadline = time.monotonic() + 600  # only against a hang
    while not (tmp_path / "started").exists():
        assert first.is_alive() and time.monotonic() < deadline, got
        time.sleep(0.02)
    monkeypatch.setenv("GRAPHTRIM_TEST_MARK", "second")
    (other,) = map_isolated(f"{HERE}:work", ["b"])  # a server of its own; the first retired
    assert other["mark"] == "second"
    (tmp_path / "go").write_text("")
    first.join()
    (crashed,) = got
    assert isinstance(crashed, ChildFailed) and crashed.signal_name == "SIGSEGV", crashed


def test_a_server_that_does_not_answer_leaves_the_child_to_a_fresh_interpreter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("GRAPHTRIM_ISOLATION", raising=False)
    monkeypatch.setenv("GRAPHTRIM_TEST_MARK", "unanswered")  # a server started for this call
    monkeypatch.setattr(forkserver, "REPLY_TIMEOUT", 0.0)  # still importing when asked
    monkeypatch.setattr(forkserver, "_broken", False)
    out = map_isolated(f"{HERE}:work", ["a", "bb"])
    assert [r["item"] for r in out] == ["a", "bb"]
    assert out[0]["ppid"] == os.getpid()  # spawned by the caller
    assert forkserver._broken and forkserver._server is None


def test_a_hang_is_stopped_at_the_timeout() -> None:
    # the timeout bounds each item, the start of a new child included: the one that takes
    # "a" after the hang must start within it on a busy machine too
    out = map_isolated(f"{HERE}:work", ["hang", "a"], timeout=10)
    assert isinstance(out[0], ChildFailed) and out[0].timed_out
    assert "no result after 10 s while handling hang" in str(out[0])
    assert out[1]["item"] == "a"


def test_an_exit_without_a_result_is_reported() -> None:
    out = map_isolated(f"{HERE}:work", ["exit"], what=lambda item: f"variant {item}")
    assert isinstance(out[0], ChildFailed)
    assert str(out[0]).startswith("variant exit: the process exited with status 3")


def test_errors_raised_in_the_child_keep_their_class() -> None:
    with pytest.raises(QuantizeError, match="no calibration data"):
        call_isolated(f"{HERE}:work", "quantize-error")
    with pytest.raises(GraphtrimError, match="ValueError: bad value"):
        call_isolated(f"{HERE}:work", "value-error")


def test_step_is_a_no_op_in_the_parent() -> None:
    step("anything")  # no file, no error


def chatty(item: str) -> str:
    for i in range(3):
        step(f"{item}: part {i}")
        time.sleep(0.3)
    return item


def test_steps_reach_the_parent_as_progress() -> None:
    seen: list[str] = []
    assert map_isolated(f"{HERE}:chatty", ["x"], on_step=seen.append) == ["x"]
    assert seen and set(seen) <= {"x: part 0", "x: part 1", "x: part 2"}
    assert seen == sorted(seen)
