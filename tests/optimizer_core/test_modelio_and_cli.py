"""Safe loading and saving, and the ``graphtrim`` command line.

Every refusal must exit 2 with one line on stderr naming the problem, create no output and leave
the input (model and external data) byte-for-byte and mtime-for-mtime as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest

from graphtrim.cli import main
from graphtrim.errors import InvalidModelError, VerificationError
from graphtrim.graph import presets
from graphtrim.modelio import load_model, read_proto
from graphtrim.optimize_file import optimize_file
from graphtrim.verify import verify
from tests.optimizer_core.test_verify import PlantedBug

REPO = Path(__file__).resolve().parents[2]
FLOAT = onnx.TensorProto.FLOAT


def make_model(opset: int = 17, hidden: int = 64) -> onnx.ModelProto:
    """x[N, hidden] -> Identity -> MatMul(W) -> *1 -> Transpose pair -> +b -> Relu.

    W is hidden*hidden float32 (16 KiB for 64), above the 1 KiB threshold at which the saver
    moves a tensor to external data; Identity, the Mul by one and the Transpose pair are redundant.
    """
    rng = np.random.default_rng(0)
    w = onh.from_array(rng.standard_normal((hidden, hidden)).astype(np.float32) / 8, "W")
    b = onh.from_array(rng.standard_normal(hidden).astype(np.float32), "b")
    one = onh.from_array(np.ones((), np.float32), "one")
    nodes = [
        oh.make_node("Identity", ["x"], ["i"]),
        oh.make_node("MatMul", ["i", "W"], ["m"]),
        oh.make_node("Mul", ["m", "one"], ["m1"]),
        oh.make_node("Transpose", ["m1"], ["t1"], perm=[1, 0]),
        oh.make_node("Transpose", ["t1"], ["t2"], perm=[1, 0]),
        oh.make_node("Add", ["t2", "b"], ["a"]),
        oh.make_node("Relu", ["a"], ["y"]),
    ]
    graph = oh.make_graph(
        nodes,
        "g",
        [oh.make_tensor_value_info("x", FLOAT, ["N", hidden])],
        [oh.make_tensor_value_info("y", FLOAT, ["N", hidden])],
        [w, b, one],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)], ir_version=8)


def save_plain(path: Path, proto: onnx.ModelProto | None = None) -> Path:
    # raw serialization: onnx.save would not stop us from writing the broken models below
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes((proto or make_model()).SerializeToString())
    return path


def save_external(path: Path, location: str = "w.bin") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(
        make_model(),
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=location,
        size_threshold=0,
    )
    return path


def set_location(model_path: Path, tensor: str, location: str) -> None:
    proto = onnx.load(str(model_path), load_external_data=False)
    for init in proto.graph.initializer:
        if init.name == tensor:
            for entry in init.external_data:
                if entry.key == "location":
                    entry.value = location
    model_path.write_bytes(proto.SerializeToString())


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``root``: bytes and mtime."""
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("graphtrim: error: "), err
    assert "Traceback" not in err
    return lines[0]


def graphtrim_cmd() -> list[str]:
    script = Path(sys.executable).parent / "graphtrim"
    assert script.exists(), f"console script not installed at {script}"
    return [str(script)]


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [*graphtrim_cmd(), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
        check=False,
    )


# ------------------------------------------------------------------ refusals


def _random_bytes(d: Path) -> Path:
    p = d / "random.onnx"
    p.write_bytes(np.random.default_rng(1).bytes(4096))
    return p


def _text_file(d: Path) -> Path:
    p = d / "notes.onnx"
    p.write_text("this is a text file, not a model\nsecond line\n")
    return p


def _empty(d: Path) -> Path:
    p = d / "empty.onnx"
    p.write_bytes(b"")
    return p


def _truncated(d: Path) -> Path:
    # The first half of the bytes ends inside W's raw_data (16 KiB of the ~17 KiB model), a
    # length-delimited field whose declared length runs past the end: protobuf rejects it.
    # test_every_truncation_is_rejected checks that no prefix at all parses.
    data = make_model().SerializeToString()
    p = d / "truncated.onnx"
    p.write_bytes(data[: len(data) // 2])
    return p


def _missing_external(d: Path) -> Path:
    p = save_external(d / "m.onnx")
    (d / "w.bin").unlink()
    return p


def _traversal(d: Path) -> Path:
    # the file exists and is long enough: the refusal is about where it is, not what it holds
    p = save_external(d / "model" / "m.onnx")
    shutil.copy(d / "model" / "w.bin", d / "private.bin")
    set_location(p, "W", "../private.bin")
    return p


def _absolute(d: Path) -> Path:
    p = save_external(d / "model" / "m.onnx")
    shutil.copy(d / "model" / "w.bin", d / "private.bin")
    set_location(p, "W", str(d / "private.bin"))
    return p


def _too_short(d: Path) -> Path:
    p = save_external(d / "m.onnx")
    data = (d / "w.bin").read_bytes()
    (d / "w.bin").write_bytes(data[: len(data) // 3])
    return p


def set_entry(model_path: Path, tensor: str, key: str, value: str | None) -> None:
    """Set (or with None remove) one external data entry of ``tensor``."""
    proto = onnx.load(str(model_path), load_external_data=False)
    init = next(t for t in proto.graph.initializer if t.name == tensor)
    entries = [(e.key, e.value) for e in init.external_data if e.key != key]
    if value is not None:
        entries.append((key, value))
    del init.external_data[:]
    for k, v in entries:
        entry = init.external_data.add()
        entry.key, entry.value = k, v
    model_path.write_bytes(proto.SerializeToString())


def _symlink_escape(d: Path) -> Path:
    # a name inside the folder that resolves outside it
    p = save_external(d / "model" / "m.onnx")
    shutil.copy(d / "model" / "w.bin", d / "private.bin")
    (d / "model" / "link.bin").symlink_to(d / "private.bin")
    set_location(p, "W", "link.bin")
    return p


def _entry(key: str, value: str | None, truncate: bool = False) -> Callable[[Path], Path]:
    def build(d: Path) -> Path:
        p = save_external(d / "m.onnx")
        set_entry(p, "W", key, value)
        if truncate:
            (d / "w.bin").write_bytes((d / "w.bin").read_bytes()[:100])
        return p

    return build


def _opset(version: int) -> Callable[[Path], Path]:
    def build(d: Path) -> Path:
        return save_plain(d / f"opset{version}.onnx", make_model(opset=version))

    return build


def _missing_input(d: Path) -> Path:
    return d / "does-not-exist.onnx"


def _directory(d: Path) -> Path:
    (d / "adir.onnx").mkdir()
    return d / "adir.onnx"


REFUSALS = {
    "random-bytes": (_random_bytes, "not an ONNX model"),
    "text-file": (_text_file, "not an ONNX model"),
    "empty": (_empty, "empty file"),
    "truncated": (_truncated, "not an ONNX model"),
    "missing-external-data": (
        _missing_external,
        "external data file 'w.bin' of tensor 'W' is missing",
    ),
    "path-traversal": (_traversal, "points outside the model folder: '../private.bin'"),
    "absolute-location": (_absolute, "points outside the model folder"),
    "external-data-too-short": (_too_short, "too short for tensor"),
    "symlink-escape": (_symlink_escape, "resolves outside the model folder: 'link.bin'"),
    "offset-not-a-number": (_entry("offset", "abc"), "invalid external data offset: 'abc'"),
    "offset-negative": (_entry("offset", "-8"), "invalid external data offset: '-8'"),
    "length-not-a-number": (_entry("length", "1e3"), "invalid external data length: '1e3'"),
    # W is 64 x 64 float32: 16384 bytes
    "length-too-small": (_entry("length", "4"), "length 4 of tensor 'W' does not match"),
    "length-too-large": (_entry("length", "16388"), "length 16388 of tensor 'W' does not match"),
    "no-length-short-file": (_entry("length", None, truncate=True), "too short for tensor 'W'"),
    "opset-0": (_opset(0), "unsupported opset 0"),
    "opset-99": (_opset(99), "unsupported opset 99"),
    "missing-input": (_missing_input, "no such file"),
    "directory": (_directory, "not a regular file"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_cli_refuses_bad_input(case, tmp_path, capsys):
    build, expected = REFUSALS[case]
    src = build(tmp_path)
    out = tmp_path / "out" / "o.onnx"
    before = snapshot(tmp_path)

    rc = main(
        ["optimize", str(src), "-o", str(out), "--verify", "--report", str(tmp_path / "r.json")]
    )

    captured = capsys.readouterr()
    assert rc == 2
    line = one_line_error(captured.err)
    assert expected in line
    assert str(src) in line  # names the file
    assert captured.out == ""
    assert not out.exists()
    assert not (tmp_path / "r.json").exists()
    # nothing created (no output, no staging folder), nothing touched (bytes and mtimes)
    assert snapshot(tmp_path) == before
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", list(REFUSALS))
def test_load_model_raises_invalid_model_error(case, tmp_path):
    build, expected = REFUSALS[case]
    src = build(tmp_path)
    with pytest.raises(InvalidModelError) as info:
        load_model(src)
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_every_truncation_is_rejected(tmp_path):
    # No strict prefix of a serialized model is accepted: a cut inside a length-delimited field
    # (graph, tensor bytes, opset import) does not decode, and a cut between top-level fields
    # loses the graph or the opset imports, which onnx writes last (field 8).
    data = make_model(hidden=4).SerializeToString()
    p = tmp_path / "cut.onnx"
    accepted = []
    for cut in range(1, len(data)):
        p.write_bytes(data[:cut])
        try:
            read_proto(p)
        except InvalidModelError:
            continue
        accepted.append(cut)
    assert accepted == []
    p.write_bytes(data)
    read_proto(p)  # the whole model is fine


@pytest.mark.parametrize("target", ["same", "dot-path", "external-data"])
def test_cli_refuses_to_overwrite_the_input(target, tmp_path, capsys):
    src = save_external(tmp_path / "m.onnx")
    out = {
        "same": src,
        "dot-path": tmp_path / "." / "m.onnx",
        "external-data": tmp_path / "w.bin",
    }[target]
    before = snapshot(tmp_path)
    rc = main(["optimize", str(src), "-o", str(out)])
    captured = capsys.readouterr()
    assert rc == 2
    assert "would overwrite the input" in one_line_error(captured.err)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("outdir", "is a directory"),
        ("afile/o.onnx", "is not a folder"),
        ("afile/deeper/o.onnx", "is not a folder"),
    ],
)
def test_cli_refuses_an_unusable_output_path(target, expected, tmp_path, capsys):
    src = save_external(tmp_path / "m.onnx")
    (tmp_path / "outdir").mkdir()
    (tmp_path / "afile").write_bytes(b"a file, not a folder")
    before = snapshot(tmp_path)
    rc = main(["optimize", str(src), "-o", str(tmp_path / target)])
    captured = capsys.readouterr()
    assert rc == 2
    assert expected in one_line_error(captured.err)
    assert snapshot(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "m.onnx", "outdir", "w.bin"]


def test_cli_write_failure_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    import graphtrim.optimize_file as optimize_module

    real_save = optimize_module.save_model

    def save_then_fail(model, path, **kw):
        real_save(model, path, **kw)  # the bytes reach the staging folder, then the disk fills
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(optimize_module, "save_model", save_then_fail)
    src = save_plain(tmp_path / "in.onnx")
    before = snapshot(tmp_path)
    rc = main(["optimize", str(src), "-o", str(tmp_path / "o.onnx")])
    captured = capsys.readouterr()
    assert rc == 2
    assert "No space left on device" in one_line_error(captured.err)
    assert snapshot(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.onnx"]  # staging removed


def test_cli_refusal_in_a_subprocess_is_one_line(tmp_path):
    src = _text_file(tmp_path)
    before = snapshot(tmp_path)
    proc = run_cli("optimize", str(src), "-o", str(tmp_path / "o.onnx"))
    assert proc.returncode == 2, proc.stderr
    assert "not an ONNX model" in one_line_error(proc.stderr)
    assert proc.stdout == ""
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------ success


def _check_report(report: dict, out: Path) -> None:
    assert report["output"] == str(out)
    opt = report["optimization"]
    per_pass = opt["per_pass"]
    for name in presets.PRESETS["default"]:
        assert set(per_pass[name]) >= {"nodes_removed", "nodes_added", "seconds", "rules"}
        assert per_pass[name]["seconds"] >= 0
    assert per_pass["identity"]["nodes_removed"] >= 1
    assert per_pass["identity"]["rules"]["identity"] == 1
    # Identity, the Mul by one and the Transpose pair go (a later pass may fuse more)
    assert sum(p["nodes_removed"] for p in per_pass.values()) >= 4
    assert opt["records"], "the modifying pass invocations are logged"
    for rec in opt["records"]:
        assert {"pass_name", "iteration", "nodes_removed", "seconds", "rules"} <= set(rec)
    assert report["before"]["nodes"] == 7
    assert report["after"]["nodes"] <= 3
    assert not {"Identity", "Mul", "Transpose"} & set(report["after"]["op_counts"])
    assert report["verification"]["ok"] is True
    assert report["verification"]["trials"] == 3


def test_cli_optimize_happy_path(tmp_path, capsys):
    src = save_plain(tmp_path / "in.onnx")
    src_before = snapshot(tmp_path)
    out = tmp_path / "out.onnx"
    rc = main(
        ["optimize", str(src), "-o", str(out), "--verify", "--report", str(tmp_path / "r.json")]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    table = captured.out
    assert "nodes" in table
    assert "Transpose" in table and "Identity" in table and "MatMul" in table
    assert "verification: equal" in table
    assert f"wrote {out}" in table
    report = json.loads((tmp_path / "r.json").read_text())
    _check_report(report, out)
    nodes_row = next(ln for ln in table.splitlines() if ln.startswith("nodes")).split()
    after_nodes = report["after"]["nodes"]
    assert nodes_row[1:] == ["7", str(after_nodes), f"{after_nodes - 7:+d}"]

    result = onnx.load(str(out))
    onnx.checker.check_model(result, full_check=True)
    assert len(result.graph.node) == after_nodes
    assert not {"Identity", "Mul", "Transpose"} & {n.op_type for n in result.graph.node}
    assert verify(src, out).ok
    # the input is untouched; only the output and the report were added
    after = snapshot(tmp_path)
    assert {k: after[k] for k in src_before} == src_before
    assert set(after) - set(src_before) == {"out.onnx", "r.json"}


def test_console_script_optimizes(tmp_path):
    src = save_plain(tmp_path / "in.onnx")
    out = tmp_path / "sub" / "out.onnx"
    proc = run_cli(
        "optimize", str(src), "-o", str(out), "--verify", "--report", str(tmp_path / "r.json")
    )
    assert proc.returncode == 0, proc.stderr
    assert "nodes" in proc.stdout and "Transpose" in proc.stdout
    _check_report(json.loads((tmp_path / "r.json").read_text()), out)
    assert verify(src, out).ok


def test_module_entry_point_lists_passes(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "graphtrim.cli", "passes"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "presets:" in proc.stdout


def test_cli_passes_rules_lists_every_rule_of_the_tables(capsys):
    assert main(["passes", "--rules"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(presets.all_rules())
    for line, (pass_name, rule) in zip(lines, presets.all_rules(), strict=True):
        assert line.split()[:2] == [pass_name, rule.name] and line.endswith(rule.math)


def test_a_reader_that_goes_away_is_not_an_error():
    """``graphtrim passes --rules | head -1``: the pipe closes before the output is written;
    the command ends quietly with 0, not with an error line and exit 2."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "graphtrim.cli", "passes", "--rules"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the child has imported anything, so its first write fails
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0, err
    assert "Broken pipe" not in err and "Traceback" not in err, err


def test_cli_passes(capsys):
    assert main(["passes"]) == 0
    out = capsys.readouterr().out
    assert "passes:" in out and "presets:" in out
    for name in presets.PASSES:
        assert name in out
    for preset in ("default", "compact", "safe", "minimal"):
        assert any(line.strip().startswith(preset) for line in out.splitlines())
    reassociate = next(line for line in out.splitlines() if line.strip().startswith("reassociate"))
    assert "rounds" in reassociate


def test_cli_verify(tmp_path, capsys):
    a = save_plain(tmp_path / "a.onnx")
    same = tmp_path / "same.onnx"
    optimize_file(a, same)
    capsys.readouterr()
    assert main(["verify", str(a), str(same)]) == 0
    assert capsys.readouterr().out.startswith("equal")

    different = make_model()
    for init in different.graph.initializer:
        if init.name == "b":
            init.CopyFrom(onh.from_array(onh.to_array(init) + np.float32(0.01), "b"))
    b = save_plain(tmp_path / "b.onnx", different)
    assert main(["verify", str(a), str(b)]) == 1
    assert "MISMATCH" in capsys.readouterr().out

    assert main(["verify", str(a), str(b), "--json"]) == 1
    record = json.loads(capsys.readouterr().out)
    assert record["ok"] is False and record["outputs"][0]["name"] == "y"

    # a loose enough tolerance accepts the difference
    assert main(["verify", str(a), str(b), "--atol", "1", "--rtol", "1"]) == 0
    capsys.readouterr()

    # a bad model is a bad input, not a mismatch
    bad = _text_file(tmp_path)
    assert main(["verify", str(a), str(bad)]) == 2
    assert "not an ONNX model" in one_line_error(capsys.readouterr().err)


def test_cli_optimize_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["optimize", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--verify" in out and "--verify-each-pass" in out and "--report" in out


def _commands(parser, prefix=()):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*prefix, name), sub
                yield from _commands(sub, (*prefix, name))


def test_every_help_states_defaults_once_and_only_real_ones():
    """No ``(default: None)`` or ``(default: False)``, no default on a required option, and no
    option whose help gives its default twice; the alias that promote and rollback move is
    named, never a hidden default."""
    from graphtrim.cli.main import build_parser

    commands = dict(_commands(build_parser()))
    assert {("optimize",), ("pipeline", "run"), ("promote",), ("trigger",)} <= set(commands)
    for name, parser in commands.items():
        text = " ".join(parser.format_help().split())
        assert "(default: None)" not in text and "(default: False)" not in text, name
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.help:
                continue
            shown = formatter._get_help_string(action)
            if action.required or action.default is None or "default" in action.help.lower():
                # nothing appended: no default to tell, or the help tells it already
                assert shown == action.help, (name, action.dest, shown)
    for command in (("promote",), ("rollback",)):
        alias = next(a for a in commands[command]._actions if a.dest == "alias")
        assert alias.required and alias.default is None


def test_external_data_model_round_trip(tmp_path, capsys):
    src = save_external(tmp_path / "in" / "m.onnx")
    assert onnx.load(str(src), load_external_data=False).graph.initializer[0].data_location == (
        onnx.TensorProto.EXTERNAL
    )
    before = snapshot(tmp_path / "in")
    out = tmp_path / "out" / "o.onnx"
    report_path = tmp_path / "r.json"
    rc = main(["optimize", str(src), "-o", str(out), "--verify", "--report", str(report_path)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "verification: equal" in captured.out
    # file sizes count the external data on both sides
    report = json.loads(report_path.read_text())
    data_in = tmp_path / "in" / "w.bin"
    assert report["before"]["file_bytes"] == src.stat().st_size + data_in.stat().st_size
    assert report["after"]["file_bytes"] == sum(
        p.stat().st_size for p in (out, out.with_name("o.onnx.data"))
    )

    data = out.with_name("o.onnx.data")
    assert data.is_file() and data.stat().st_size >= 64 * 64 * 4
    proto = onnx.load(str(out), load_external_data=False)
    locations = {
        e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"
    }
    assert locations == {"o.onnx.data"}  # its own file, beside it, not the input's w.bin
    onnx.checker.check_model(str(out), full_check=True)
    assert not {"Identity", "Mul", "Transpose"} & {n.op_type for n in proto.graph.node}
    assert verify(src, out).ok
    assert snapshot(tmp_path / "in") == before
    # the output stands alone: it still runs when the input folder is gone
    shutil.rmtree(tmp_path / "in")
    assert verify(out, out).ok


def test_external_data_model_optimized_from_another_cwd(tmp_path, monkeypatch):
    # external data is found beside the model, not relative to the working directory
    src = save_external(tmp_path / "a" / "m.onnx")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    report = optimize_file(src, tmp_path / "b" / "o.onnx", check=True)
    assert report.verification is not None and report.verification.ok
    # and with a relative path from inside the model's folder
    monkeypatch.chdir(tmp_path / "a")
    report = optimize_file("m.onnx", "o2.onnx", check=True)
    assert report.verification is not None and report.verification.ok
    assert (tmp_path / "a" / "o2.onnx.data").is_file()


# ------------------------------------------------------------------ verification failure


@pytest.fixture
def planted_bug(monkeypatch):
    monkeypatch.setitem(presets.PASSES, PlantedBug.name, PlantedBug)
    return ["identity", PlantedBug.name, "dead-code"]


def test_failed_verification_writes_nothing(tmp_path, planted_bug):
    src = save_plain(tmp_path / "in.onnx")
    out = tmp_path / "o.onnx"
    before = snapshot(tmp_path)
    with pytest.raises(VerificationError) as info:
        optimize_file(src, out, passes=planted_bug, check=True)
    assert "does not match" in str(info.value)
    assert info.value.record is not None and not info.value.record.ok
    assert not out.exists()
    assert snapshot(tmp_path) == before  # no staging folder left behind either


def test_failed_verification_keeps_an_existing_output(tmp_path, planted_bug):
    src = save_external(tmp_path / "in.onnx")
    out = tmp_path / "o.onnx"
    out.write_bytes(b"previous result")
    out.with_name("o.onnx.data").write_bytes(b"previous weights")
    before = snapshot(tmp_path)
    with pytest.raises(VerificationError):
        optimize_file(src, out, passes=planted_bug, check=True)
    assert snapshot(tmp_path) == before


def test_cli_failed_verification_exit_1(tmp_path, planted_bug, capsys):
    src = save_plain(tmp_path / "in.onnx")
    out = tmp_path / "o.onnx"
    before = snapshot(tmp_path)
    rc = main(["optimize", str(src), "-o", str(out), "--passes", ",".join(planted_bug), "--verify"])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.strip().startswith("graphtrim: verification failed:")
    assert len(err.strip().splitlines()) == 1
    assert snapshot(tmp_path) == before

    rc = main(
        [
            "optimize",
            str(src),
            "-o",
            str(out),
            "--passes",
            ",".join(planted_bug),
            "--verify-each-pass",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1
    assert "pass 'planted-bug'" in err and "add-to-sub" in err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("flag", ["--verify", "--verify-each-pass"])
def test_cli_unverifiable_model_is_one_line_exit_2(flag, tmp_path, capsys):
    # random inputs cannot fill a sequence input: nothing can be compared, which is not a
    # difference (exit 2, not 1); nothing is written
    graph = oh.make_graph(
        [oh.make_node("Identity", ["s"], ["a"]), oh.make_node("Identity", ["a"], ["y"])],
        "g",
        [oh.make_tensor_sequence_value_info("s", FLOAT, [2])],
        [oh.make_tensor_sequence_value_info("y", FLOAT, [2])],
    )
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    src = save_plain(tmp_path / "s.onnx", proto)
    before = snapshot(tmp_path)
    rc = main(["optimize", str(src), "-o", str(tmp_path / "o.onnx"), flag])
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("graphtrim: error: cannot verify"), err
    assert "seq(tensor(float))" in lines[0]
    assert snapshot(tmp_path) == before


def _listed_out_of_order(cycle: bool) -> onnx.ModelProto:
    """y = Neg(Relu(x)) with the Neg listed first (onnxruntime's fp16 converter appends the
    Casts of the inputs it keeps in float32 after the nodes that read them); with ``cycle`` the
    Relu reads the Neg's output instead: no order exists."""
    graph = oh.make_graph(
        [
            oh.make_node("Neg", ["r"], ["y"]),
            oh.make_node("Relu", ["y" if cycle else "x"], ["r"]),
        ],
        "g",
        [oh.make_tensor_value_info("x", FLOAT, ["N", 3])],
        [oh.make_tensor_value_info("y", FLOAT, ["N", 3])],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)


def test_nodes_listed_out_of_order_are_read_in_order(tmp_path, capsys):
    src = tmp_path / "m.onnx"
    onnx.save(_listed_out_of_order(cycle=False), src)
    before = src.read_bytes()
    rc = main(["optimize", str(src), "-o", str(tmp_path / "o.onnx"), "--verify"])
    assert rc == 0, capsys.readouterr().err
    assert [n.op_type for n in onnx.load(str(tmp_path / "o.onnx")).graph.node] == ["Relu", "Neg"]
    assert src.read_bytes() == before


def test_a_cycle_is_still_refused(tmp_path, capsys):
    src = tmp_path / "m.onnx"
    onnx.save(_listed_out_of_order(cycle=True), src)
    rc = main(["optimize", str(src), "-o", str(tmp_path / "o.onnx")])
    err = capsys.readouterr().err
    assert rc == 2 and "topologically sorted" in err
    assert not (tmp_path / "o.onnx").exists()


def test_inference_at_load_leaves_weights_out_and_finds_the_same_types(tmp_path):
    # a 16 KiB weight and a 2 KiB int64 index table: inference needs the weight's type only,
    # the index table's values too (it fixes the Gather's output shape)
    from graphtrim.modelio.load import _without_weights

    rng = np.random.default_rng(0)
    graph = oh.make_graph(
        [
            oh.make_node("MatMul", ["x", "w"], ["h"]),
            oh.make_node("Gather", ["h", "idx"], ["g"], axis=1),
            oh.make_node("Shape", ["g"], ["s"]),
            oh.make_node("Reshape", ["g", "s"], ["y"]),
        ],
        "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 64])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 256])],
        [
            onh.from_array(rng.standard_normal((64, 64)).astype(np.float32), "w"),
            onh.from_array(rng.integers(0, 64, (256,)).astype(np.int64), "idx"),
        ],
    )
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    proto.ir_version = 8
    light = _without_weights(proto)
    assert light is not None
    assert [t.name for t in light.graph.initializer] == ["idx"]
    assert [i.name for i in light.graph.input] == ["x", "w"]
    full = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    path = tmp_path / "m.onnx"
    onnx.save(proto, path)
    model = load_model(path)
    values = {v.name: v for n in model.graph for v in n.outputs}
    for vi in full.graph.value_info:
        dims = [d.dim_value or d.dim_param for d in vi.type.tensor_type.shape.dim]
        assert [d if isinstance(d, int) else str(d) for d in values[vi.name].shape] == dims
    assert list(values["g"].shape)[1] == 256
    assert len(model.graph.initializers) == 2  # the weights themselves are all there


def test_large_weights_are_written_from_their_buffers_and_read_back_the_same(tmp_path):
    import onnx_ir as ir

    from graphtrim.modelio import save_model

    rng = np.random.default_rng(0)
    big = rng.standard_normal((128, 256)).astype(np.float32)  # 128 KiB: written by hand
    half = rng.standard_normal((256, 128)).astype(np.float16)  # 64 KiB: serialized
    graph = oh.make_graph(
        [
            oh.make_node("MatMul", ["x", "w"], ["h"]),
            oh.make_node("Cast", ["h"], ["hc"], to=onnx.TensorProto.FLOAT16),
            oh.make_node("MatMul", ["hc", "v"], ["m"]),
            oh.make_node("Cast", ["m"], ["mc"], to=onnx.TensorProto.FLOAT),
            oh.make_node("Add", ["mc", "b"], ["y"]),
        ],
        "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 128])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 128])],
        [
            onh.from_array(big, "w"),
            onh.from_array(half, "v"),
            onh.from_array(np.ones(128, np.float32), "b"),
        ],
    )
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    proto.ir_version = 8
    src = tmp_path / "m.onnx"
    onnx.save(proto, src)
    model = load_model(src)
    order = list(model.graph.initializers)
    save_model(model, tmp_path / "out.onnx")
    assert list(model.graph.initializers) == order  # the model in memory is as it was
    ir.save(model, tmp_path / "ref.onnx")
    ours, ref = onnx.load(tmp_path / "out.onnx"), onnx.load(tmp_path / "ref.onnx")
    onnx.checker.check_model(ours, full_check=True)
    by_name = lambda t: t.name  # noqa: E731
    assert sorted(ours.graph.initializer, key=by_name) == sorted(ref.graph.initializer, key=by_name)
    assert sorted(ours.graph.value_info, key=by_name) == sorted(ref.graph.value_info, key=by_name)
    np.testing.assert_array_equal(
        onh.to_array(next(t for t in ours.graph.initializer if t.name == "w")), big
    )
    for p in (ours, ref):
        p.graph.ClearField("initializer")
        p.graph.ClearField("value_info")
    assert ours == ref


@pytest.mark.parametrize(
    ("argv", "module", "extra"),
    [
        (["promote", "models:/m/1", "--alias", "champion", "--why", "x"], "mlflow", "pipeline"),
        (["optimize", "IN", "-o", "OUT", "--verify"], "onnxruntime", "cpu"),
    ],
)
def test_a_command_whose_extra_is_missing_names_the_extra(
    argv, module, extra, tmp_path, monkeypatch, capsys
):
    """One line naming the extra to install, exit 2: not a traceback."""
    import sys

    if "IN" in argv:
        src = save_plain(tmp_path / "m.onnx")
        paths = {"IN": str(src), "OUT": str(tmp_path / "o.onnx")}
        argv = [paths.get(a, a) for a in argv]
    else:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", str(tmp_path / "mlruns"))
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"pip install 'graphtrim[{extra}]'" in one_line_error(err), err
    assert not (tmp_path / "o.onnx").exists()


def test_the_core_install_pulls_no_orchestrator_registry_torch_plots_or_runtime_build():
    """``pip install graphtrim`` brings the optimizer's own needs only; onnxruntime's CPU and
    CUDA builds conflict, so the user picks one (``[cpu]`` / ``[gpu]``)."""
    import re

    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = {re.split(r"[<>=\[ ;]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    assert core == {"numpy", "onnx", "onnx-ir", "pyyaml"}
    extras = project["optional-dependencies"]
    assert extras["cpu"] == ["onnxruntime>=1.20"] and extras["gpu"] == ["onnxruntime-gpu>=1.20"]
    assert not any(d.startswith("onnxruntime") for d in extras["pipeline"] + extras["airflow"])


def test_verify_of_an_input_that_cannot_run_at_the_default_dim_names_the_dim(tmp_path, capsys):
    """Reshape(x, [-1, 4]) cannot run with N=2 elements: not a changed result (exit 1) but a bad
    input (exit 2) naming the size used and how to set it; with --dim it verifies."""
    x = oh.make_tensor_value_info("x", FLOAT, ["N"])
    y = oh.make_tensor_value_info("y", FLOAT, ["A", 4])
    shape = onh.from_array(np.array([-1, 4], dtype=np.int64), "shape")
    graph = oh.make_graph([oh.make_node("Reshape", ["x", "shape"], ["y"])], "g", [x], [y], [shape])
    src = save_plain(
        tmp_path / "m.onnx", oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    )
    out = tmp_path / "o.onnx"
    assert main(["optimize", str(src), "-o", str(out), "--verify", "-q"]) == 2
    err = one_line_error(capsys.readouterr().err)
    assert "N=2" in err and "--dim NAME=SIZE" in err, err
    assert not out.exists()
    assert main(["optimize", str(src), "-o", str(out), "--verify", "-q", "--dim", "N=8"]) == 0


def test_verification_opens_its_sessions_after_the_optimizers_mappings_are_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The optimized model's weights are mapped from the input and read to write the output;
    when verification opens a session they are mapped no more (a model of several GiB would
    otherwise be in the process once more beside the session's weights). Released weights read
    again from the file where needed."""
    import onnx_ir as ir

    import graphtrim.optimize_file as module
    import graphtrim.verify

    rng = np.random.default_rng(0)
    w = onh.from_array(rng.standard_normal((64, 64)).astype(np.float32), "w")
    zero = onh.from_array(np.zeros(64, dtype=np.float32), "zero")
    graph = oh.make_graph(
        [oh.make_node("MatMul", ["x", "w"], ["m"]), oh.make_node("Add", ["m", "zero"], ["y"])],
        "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 64])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 64])],
        [w, zero],
    )
    src = tmp_path / "in" / "model.onnx"
    src.parent.mkdir()
    onnx.save(
        oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]),
        str(src),
        save_as_external_data=True,
        size_threshold=0,
    )
    released: list[ir.Model] = []
    mapped_at_verify: list[int] = []
    inner_release, inner_verify = module.release_weights, graphtrim.verify.verify_isolated

    def release(model: ir.Model) -> None:
        inner_release(model)
        released.append(model)

    def verify_spy(*args: object, **kwargs: object) -> object:
        mapped_at_verify.append(
            sum(
                isinstance(v.const_value, ir.ExternalTensor) and v.const_value.raw is not None
                for m in released
                for g in m.graphs()
                for v in g.initializers.values()
            )
        )
        return inner_verify(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(module, "release_weights", release)
    monkeypatch.setattr(graphtrim.verify, "verify_isolated", verify_spy)
    report = optimize_file(src, tmp_path / "out" / "model.onnx", check=True)
    assert report.verification is not None and report.verification.ok
    assert released and mapped_at_verify == [0]
    weight = next(
        v.const_value
        for v in released[0].graph.initializers.values()
        if isinstance(v.const_value, ir.ExternalTensor)
    )
    assert weight.raw is None
    np.testing.assert_array_equal(weight.numpy(), onh.to_array(w))  # read again on demand
