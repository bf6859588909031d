"""The corpus's catalogue and manifest: breadth as the specs promise it, and a manifest that
survives builders running at once, lists failures with their reasons and forgets removed specs."""

from __future__ import annotations

import json
from collections import Counter

import onnx
import onnx.helper as oh

from bench.corpus import Manifest, all_specs, describe
from bench.corpus.__main__ import _reason


def test_the_catalogue_is_broad():
    specs = all_specs()
    families = Counter(s.family for s in specs)
    assert len(specs) >= 150, len(specs)
    assert len(families) >= 8, families
    assert families["timm"] >= 40 and families["transformers"] >= 30
    assert {"torchvision", "ultralytics", "control-flow", "classical-ml", "quantized"} <= set(
        families
    )
    # both torch exporters for the torch families
    assert all(
        set(s.exporters) == {"dynamo", "torchscript"}
        for s in specs
        if s.family in ("timm", "torchvision", "transformers")
    )
    # derived models name a source that is itself a corpus export
    keys = {s.key(e) for s in specs for e in s.exporters}
    assert all(s.kwargs()["source_key"] in keys for s in specs if s.derive)


def _entry(key: str, status: str = "ok", **extra) -> dict:
    return {"key": key, "family": "f", "file": f"{key}.onnx", "status": status, **extra}


def test_two_builders_on_one_directory_keep_each_others_entries(tmp_path):
    a, b = Manifest(tmp_path), Manifest(tmp_path)
    a.put(_entry("one"))
    b.put(_entry("two", "failed", reason="RuntimeError: no"))
    a.put(_entry("three"))
    on_disk = {e["key"]: e for e in json.loads((tmp_path / "manifest.json").read_text())["models"]}
    assert set(on_disk) == {"one", "two", "three"}
    assert on_disk["two"]["reason"] == "RuntimeError: no"
    assert {e["key"] for e in Manifest(tmp_path).ok()} == {"one", "three"}
    assert not list(tmp_path.glob("*.tmp"))


def test_entries_no_spec_describes_are_dropped_with_their_files(tmp_path):
    m = Manifest(tmp_path)
    for key in ("kept", "gone"):
        (tmp_path / f"{key}.onnx").write_bytes(b"x")
        m.put(_entry(key))
    assert m.prune({"kept"}) == ["gone"]
    assert not (tmp_path / "gone.onnx").exists() and (tmp_path / "kept.onnx").exists()
    assert set(Manifest(tmp_path).entries) == {"kept"}


def test_a_failed_export_is_listed_with_the_exception_line():
    stderr = (
        "Traceback (most recent call last):\n  File 'x'\nValueError: bad config\nwarning: later"
    )
    assert _reason(stderr) == "ValueError: bad config"
    assert _reason("") == "failed without a message"


def test_describe_counts_subgraph_nodes_and_reads_the_opset(tmp_path):
    then = oh.make_graph(
        [oh.make_node("Identity", ["x"], ["t"])],
        "then",
        [],
        [oh.make_tensor_value_info("t", onnx.TensorProto.FLOAT, [1])],
    )
    other = oh.make_graph(
        [oh.make_node("Neg", ["x"], ["e"])],
        "else",
        [],
        [oh.make_tensor_value_info("e", onnx.TensorProto.FLOAT, [1])],
    )
    graph = oh.make_graph(
        [oh.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
        "g",
        [
            oh.make_tensor_value_info("c", onnx.TensorProto.BOOL, []),
            oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1]),
        ],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )
    path = tmp_path / "m.onnx"
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]), path)
    info = describe(path)
    assert info["nodes"] == 3 and info["opset"] == 17 and len(info["sha256"]) == 64


def test_trained_weights_give_each_use_of_a_constant_weight_its_own_values():
    import numpy as np
    from onnx import numpy_helper

    from bench.corpus.derived import trained_weights

    ones, zeros = np.ones(4, np.float32), np.zeros(4, np.float32)
    w = np.arange(4, dtype=np.float32)  # not constant-valued: kept
    graph = oh.make_graph(
        [
            oh.make_node("Mul", ["x", "ones"], ["a"]),
            oh.make_node("Add", ["a", "zeros"], ["b"]),
            oh.make_node("Mul", ["b", "ones"], ["c"]),
            oh.make_node("Add", ["c", "w"], ["y"]),
        ],
        "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(a, n) for a, n in ((ones, "ones"), (zeros, "zeros"), (w, "w"))],
    )
    model = oh.make_model(graph)
    assert trained_weights(model) == 3
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert "ones" not in inits and "zeros" not in inits and np.array_equal(inits["w"], w)
    first, second = (inits[n.input[1]] for n in model.graph.node if n.op_type == "Mul")
    assert not np.array_equal(first, second)  # each use its own copy
    assert np.all(np.abs(first - 1) < 0.6) and not np.all(first == 1)
    onnx.checker.check_model(model)


def test_other_exporters_have_their_own_families_and_environments():
    """tf2onnx (Keras), paddle2onnx and the scikit-learn converters each build in an export
    venv of their own, made from a pinned requirements file that holds the exporter."""
    from bench.corpus import EXPORT_ENVS, ROOT

    specs = all_specs()
    families = Counter(s.family for s in specs)
    assert families["tf2onnx"] >= 12 and families["paddle2onnx"] >= 8
    assert families["sklearn-pipelines"] >= 10
    envs = {s.family: s.env for s in specs}
    assert envs["tf2onnx"] == "tf" and envs["paddle2onnx"] == "paddle"
    assert envs["sklearn-pipelines"] == "sklearn" and envs["timm"] == "torch"
    wanted = {"tf": "tf2onnx", "paddle": "paddle2onnx", "sklearn": "skl2onnx", "torch": "torch"}
    folders = set()
    for env, (folder, requirements) in EXPORT_ENVS.items():
        pins = (ROOT / requirements).read_text().lower().splitlines()
        assert any(p.startswith(f"{wanted[env]}==") for p in pins), (env, requirements)
        assert all("==" in p for p in pins if p.strip()), requirements  # pinned
        folders.add(folder)
    assert len(folders) == len(EXPORT_ENVS)
    # every exporter of these families is the library's own, one file per model
    assert {e for s in specs if s.env == "tf" for e in s.exporters} == {"tf2onnx"}
    assert {e for s in specs if s.env == "paddle" for e in s.exporters} == {"paddle2onnx"}


def test_an_unknown_export_environment_is_refused():
    import pytest

    from bench.corpus import spec

    with pytest.raises(ValueError, match="unknown export environment"):
        spec("m", "f", "src", "mod:fn", env="jax")


def test_the_opsets_of_the_converted_families_are_spread():
    from bench.corpus import keras_tf, paddle_models

    for module, names in (
        (keras_tf, [*keras_tf.APPLICATIONS, *keras_tf.LAYERS]),
        (paddle_models, [*paddle_models.VISION, *paddle_models.LAYERS]),
    ):
        assert {module.opset_for(n) for n in names} == set(module.OPSETS)
        assert all(module.opset_for(n) == module.opset_for(n) for n in names)
