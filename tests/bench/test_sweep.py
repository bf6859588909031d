"""The sweep's judgement of the anchors: which output counts as the best one."""

from __future__ import annotations

import onnx
import onnx.helper as oh

from bench.sweep import best_anchor, render
from bench.sweep_tools import node_domains


def _result(anchors: dict) -> dict:
    return {
        "key": "m",
        "family": "f",
        "original_nodes": 10,
        "graphtrim": {"ok": True, "exit": 0, "nodes": 6, "bytes": 100, "parity_ok": True},
        "anchors": anchors,
    }


def test_an_anchor_output_in_another_domain_is_not_the_best_one():
    r = _result(
        {
            "onnxsim": {
                "ok": True,
                "parity_ok": True,
                "nodes": 4,
                "bytes": 90,
                "domains_added": ["com.microsoft"],
            },
            "onnxslim": {"ok": True, "parity_ok": True, "nodes": 7, "bytes": 95},
            "onnxoptimizer": {"ok": True, "parity_ok": False, "nodes": 3, "bytes": 80},
        }
    )
    assert best_anchor(r) == (7, ["onnxslim"], 95)
    text = render([r])
    assert "onnxsim's output (4 nodes) adds the operator domain com.microsoft" in text
    assert "| 1 / 0 / 0 |" in text  # graphtrim's 6 wins over the portable 7


def test_node_domains_reads_subgraphs(tmp_path):
    then = oh.make_graph(
        [oh.make_node("FusedGemm", ["a"], ["b"], domain="com.microsoft")],
        "then",
        [],
        [oh.make_tensor_value_info("b", onnx.TensorProto.FLOAT, [1])],
    )
    graph = oh.make_graph(
        [oh.make_node("If", ["c"], ["y"], then_branch=then, else_branch=then)],
        "g",
        [oh.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )
    path = tmp_path / "m.onnx"
    onnx.save(oh.make_model(graph), path)
    assert node_domains(path) == {"", "com.microsoft"}


def test_tools_run_outside_the_checkout_with_bench_importable(tmp_path, monkeypatch):
    import sys

    from bench import sweep_tools

    monkeypatch.setattr(sweep_tools, "_SCRATCH", tmp_path / "scratch")
    (tmp_path / "scratch").mkdir()

    script = "import os, bench; open('scratch.onnx', 'w').write(os.getcwd())"
    _, proc = sweep_tools._wall([sys.executable, "-c", script], timeout=60)
    assert proc is not None and proc.returncode == 0, proc and proc.stderr
    scratch = sweep_tools._scratch()
    assert (scratch / "scratch.onnx").read_text() == str(scratch)
    assert not (sweep_tools.REPO / "scratch.onnx").exists()
    assert sweep_tools.REPO not in scratch.parents


def test_a_folder_of_models_is_swept_as_corpus_entries(tmp_path):
    """``--models DIR``: every .onnx under the folder, its subfolder the family, the --dim
    sizes of the dims its inputs name."""
    from bench.sweep import FolderModels

    graph = oh.make_graph(
        [oh.make_node("Relu", ["x"], ["y"])],
        "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 4])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 4])],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    (tmp_path / "vision").mkdir()
    onnx.save(model, str(tmp_path / "vision" / "a b.onnx"))
    onnx.save(model, str(tmp_path / "top.onnx"))
    (tmp_path / "notes.txt").write_text("not a model")
    found = FolderModels(tmp_path, {"batch": 8, "seq": 3})
    entries = {e["key"]: e for e in found.ok()}
    assert set(entries) == {"vision_a_b", "top"}
    assert entries["vision_a_b"]["family"] == "vision"
    assert entries["top"]["family"] == tmp_path.name
    assert entries["top"]["dims"] == {"batch": 8} and entries["top"]["opset"] == 17
    assert found.model_path(entries["vision_a_b"]) == tmp_path / "vision" / "a b.onnx"
