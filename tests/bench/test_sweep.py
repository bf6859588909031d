"""The sweep's judgement of the anchors: which output counts as the best one."""

from __future__ import annotations

import onnx
import onnx.helper as oh

from bench.sweep import best_anchor, node_domains, render


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

    from bench import sweep

    monkeypatch.setattr(sweep, "_SCRATCH", tmp_path / "scratch")
    (tmp_path / "scratch").mkdir()

    script = "import os, bench; open('scratch.onnx', 'w').write(os.getcwd())"
    _, proc = sweep._wall([sys.executable, "-c", script], timeout=60)
    assert proc is not None and proc.returncode == 0, proc and proc.stderr
    scratch = sweep._scratch()
    assert (scratch / "scratch.onnx").read_text() == str(scratch)
    assert not (sweep.REPO / "scratch.onnx").exists()
    assert sweep.REPO not in scratch.parents
