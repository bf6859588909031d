"""A language model through the whole pipeline: a Llama-like decoder logged with MLflow's
transformers flavor, exported with its KV cache, optimized, built as int4-weight and
int8-weight, judged on perplexity / greedy continuation / decode speed on token ids, registered
with its weight settings as tags, and generated from with ``mlflow.pyfunc.load_model``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from graphtrim.cli import main
from graphtrim.examples import language
from graphtrim.integrations.registry import logged_model_id

pytestmark = [pytest.mark.slow]

mlflow = pytest.importorskip("mlflow")
NAME = "tiny-llama"
LAYERS, KV_HEADS, HEAD = 2, 2, 16


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lm-pipeline")
    tracking = f"sqlite:///{root / 'mlflow.db'}"
    mlflow.set_tracking_uri(tracking)
    exp = mlflow.create_experiment("lm", artifact_location=(root / "mlruns").as_uri())
    model, tok = language.llama(), language.tokenizer()
    with mlflow.start_run(experiment_id=exp):
        mlflow.transformers.log_model(
            {"model": model, "tokenizer": tok},
            name="model",
            task="text-generation",
            registered_model_name=NAME,
            pip_requirements=["transformers", "torch"],
        )
    ids = tok(language.zen_text())["input_ids"]
    seq = 24
    n = len(ids) // seq
    np.savez(root / "tokens.npz", input_ids=np.array(ids[: n * seq]).reshape(n, seq))
    policy = {
        "defaults": {
            "latency": {
                "runs": 20,
                "warmup": 2,
                "blocks": 2,
                "decode_past": 32,
                "prefill_tokens": 16,
                "min_speedup": None,
            },
        },
        "variants": {
            # random weights spread the next-token choice thin: the 4-bit gate is loose here
            "int4-weight": {
                "accuracy": {
                    "min_cosine": 0.5,
                    "min_top1_agreement": 0.2,
                    "max_perplexity_ratio": 1.5,
                    "max_metric_drop": None,
                }
            },
            "int4-fp16": {
                "accuracy": {
                    "min_cosine": 0.5,
                    "min_top1_agreement": 0.2,
                    "max_perplexity_ratio": 1.5,
                    "max_metric_drop": None,
                }
            },
            "int8-weight": {
                "accuracy": {
                    "min_cosine": 0.99,
                    "min_top1_agreement": 0.9,
                    "max_perplexity_ratio": 1.05,
                    "min_greedy_match": 0.5,
                }
            },
        },
    }
    code = main(
        [
            "pipeline",
            "run",
            "--model",
            f"models:/{NAME}/1",
            "--tracking-uri",
            tracking,
            "--artifacts",
            str(root / "artifacts"),
            "--variants",
            "graph,int4-weight,int8-weight,int4-fp16",
            # every layer's attention (KV cache, grouped-query heads), its rotary embeddings
            # and the RMS norms as the standard ops: the variants are built from that graph
            "--opset",
            "23",
            "--eval-data",
            str(root / "tokens.npz"),
            "--policy-json",
            json.dumps(policy),
            "--workdir",
            str(root / "work"),
            "--json",
            str(root / "records.json"),
            "-q",
        ]
    )
    return {
        "code": code,
        "records": json.loads((root / "records.json").read_text()),
        "tracking": tracking,
        "model": model,
    }


def test_the_run_exports_the_cache_and_registers_every_variant(run: dict[str, Any]) -> None:
    records = run["records"]
    export = records["export"]["export"]
    assert export["flavor"] == "transformers (text-generation)"
    assert export["decoder"]["kv_heads"] == KV_HEADS and export["decoder"]["layers"] == LAYERS
    registered = records["register"]["registered"]
    assert set(registered) == {"graph", "int4-weight", "int8-weight", "int4-fp16"}, records[
        "register"
    ]["failed"]
    assert run["code"] == 0


def test_the_optimize_stage_raised_the_opset_and_fused_the_decoder(run: dict[str, Any]) -> None:
    import onnx

    client = mlflow.MlflowClient(run["tracking"])
    version = run["records"]["register"]["registered"]["graph"]["version"]
    mv = client.get_model_version(NAME, version)
    assert client.get_logged_model(logged_model_id(mv)).params["opset"] == "23"
    folder = Path(
        mlflow.artifacts.download_artifacts(
            f"models:/{NAME}/{version}", tracking_uri=run["tracking"]
        )
    )
    proto = onnx.load(next(folder.rglob("*.onnx")))
    ops = [n.op_type for n in proto.graph.node]
    assert {o.domain: o.version for o in proto.opset_import}[""] == 23
    assert ops.count("Attention") == LAYERS and ops.count("RotaryEmbedding") == 2 * LAYERS


def test_language_gates_were_measured(run: dict[str, Any]) -> None:
    verdicts = run["records"]["validate"]["variants"]
    for variant in ("graph", "int4-weight", "int8-weight"):
        gates = verdicts[variant]["gates"]
        assert set(gates.values()) == {"pass"} and {"accuracy", "latency", "serving"} <= set(gates)
        metrics = verdicts[variant]["metrics"]
        assert metrics["reference_perplexity"] > 1 and metrics["perplexity"] > 1
        assert 0 <= metrics["greedy_match"] <= 1
        assert metrics["decode_tokens_per_s"] > 0 and metrics["prefill_p50_ms"] > 0
    graph = verdicts["graph"]["metrics"]
    assert graph["perplexity_ratio"] == pytest.approx(1.0, abs=1e-4)
    assert graph["greedy_match"] == 1.0
    assert verdicts["int8-weight"]["metrics"]["perplexity_ratio"] < 1.05


def test_weight_settings_are_on_the_registered_version(run: dict[str, Any]) -> None:
    client = mlflow.MlflowClient(run["tracking"])
    registered = run["records"]["register"]["registered"]
    mv = client.get_model_version(NAME, registered["int4-weight"]["version"])
    assert mv.tags["graphtrim.weights.bits"] == "4"
    assert mv.tags["graphtrim.weights.form"] == "portable"
    assert mv.tags["graphtrim.weights.block_size"] == "32"
    assert int(mv.tags["graphtrim.weights.matmuls"]) == 7 * LAYERS + 1  # and the LM head
    mixed = client.get_model_version(NAME, registered["int4-fp16"]["version"])
    assert mixed.tags["graphtrim.weights.activations"] == "float16"
    assert mixed.tags["graphtrim.weights.bits"] == "4"


def test_a_registered_variant_generates_through_pyfunc(run: dict[str, Any]) -> None:
    import torch

    mlflow.set_tracking_uri(run["tracking"])
    version = run["records"]["register"]["registered"]["int8-weight"]["version"]
    served = mlflow.pyfunc.load_model(f"models:/{NAME}/{version}")
    prompt = np.array([[5, 17, 42, 7]], dtype=np.int64)
    cache = {
        f"past_key_values.{i}.{kv}": np.zeros((1, KV_HEADS, 0, HEAD), dtype=np.float32)
        for i in range(LAYERS)
        for kv in ("key", "value")
    }
    ids, tokens = prompt, []
    for _ in range(8):
        feeds = {
            "input_ids": ids,
            "attention_mask": np.ones(
                (1, cache["past_key_values.0.key"].shape[2] + ids.shape[1]), dtype=np.int64
            ),
            **cache,
        }
        out = served.predict(feeds)
        nxt = int(np.asarray(out["logits"])[0, -1].argmax())
        tokens.append(nxt)
        cache = {
            name: np.asarray(out[name.replace("past_key_values", "present")]) for name in cache
        }
        ids = np.array([[nxt]], dtype=np.int64)
    with torch.no_grad():
        ref = run["model"].generate(torch.from_numpy(prompt), max_new_tokens=8, do_sample=False)
    want = ref[0, prompt.shape[1] :].tolist()
    # 8-bit weights: the continuation starts as the float model's
    assert tokens[:2] == want[:2], (tokens, want)


def test_the_pipeline_builds_the_weight_settings_asked_for(
    run: dict[str, Any], tmp_path: Path
) -> None:
    """``--weight-form ort --quantize-embeddings`` on the pipeline: the config carries them
    (and its hash changes), the quantize stage builds MatMulNBits and GatherBlockQuantized."""
    from graphtrim.stages.context import PipelineConfig

    records = run["records"]
    inputs = []
    for stage in ("export", "optimize"):
        path = tmp_path / f"{stage}.json"
        path.write_text(json.dumps(records[stage]))
        inputs += ["--input", f"{stage}={path}"]
    out = tmp_path / "quantize.json"
    args = ["--tracking-uri", run["tracking"], "--artifacts", str(tmp_path / "artifacts")]
    code = main(
        [
            "pipeline",
            "stage",
            "quantize",
            *args,
            "--variants",
            "int4-weight",
            "--weight-form",
            "ort",
            "--quantize-embeddings",
            "--no-fallback",
            "--workdir",
            str(tmp_path / "work"),
            *inputs,
            "--output",
            str(out),
            "-q",
        ]
    )
    assert code == 0
    built = json.loads(out.read_text())["variants"]["int4-weight"]
    assert built["conversion"]["form"] == "ort" and built["conversion"]["embeddings"] is True
    assert built["conversion"]["gathers_quantized"] == 1
    assert built["conversion"]["matmuls_quantized"] == 7 * LAYERS + 1
    plain = PipelineConfig(variants=("int4-weight",))
    chosen = PipelineConfig(
        variants=("int4-weight",), weights={"weight_form": "ort", "quantize_embeddings": True}
    )
    assert plain.config_hash != chosen.config_hash
    assert PipelineConfig.from_json(chosen.to_json()).config_hash == chosen.config_hash
    assert plain.to_json()["weights"] is None


def test_the_weight_settings_come_as_one_json_object_for_orchestrators(tmp_path: Path) -> None:
    """``--weights-json`` (what the Kubeflow pipeline's ``weights`` parameter passes) gives the
    config the flags give; both at once, bad JSON or an unknown key are refused."""
    from graphtrim.cli.main import build_parser
    from graphtrim.cli.pipeline_context import _context_and_config
    from graphtrim.errors import GraphtrimError

    def config(*extra: str) -> Any:
        argv = [
            "pipeline",
            "stage",
            "quantize",
            "--output",
            str(tmp_path / "q.json"),
            "--tracking-uri",
            f"sqlite:///{tmp_path / 'db'}",
            "--variants",
            "int4-weight",
            *extra,
        ]
        return _context_and_config(build_parser(argv).parse_args(argv))[1]

    flags = config("--weight-form", "ort", "--quantize-embeddings", "--block-size", "64")
    given = config(
        "--weights-json", '{"weight_form": "ort", "quantize_embeddings": true, "block_size": 64}'
    )
    assert (
        given.weights
        == flags.weights
        == {"weight_form": "ort", "quantize_embeddings": True, "block_size": 64}
    )
    assert given.config_hash == flags.config_hash
    # the orchestrator's default ({} or empty): the defaults, the hash as without the option
    assert config("--weights-json", "{}").config_hash == config().config_hash
    assert config("--weights-json", "").weights is None
    with pytest.raises(GraphtrimError, match="give one"):
        config("--weights-json", '{"block_size": 64}', "--weight-form", "ort")
    with pytest.raises(GraphtrimError, match="not JSON"):
        config("--weights-json", "{block_size: 64}")
    with pytest.raises(GraphtrimError, match="a JSON object"):
        config("--weights-json", "[64]")
    with pytest.raises(GraphtrimError, match="unknown weight setting"):
        config("--weights-json", '{"form": "ort"}')


def test_the_opset_to_raise_to_is_checked_and_enters_the_config_hash(tmp_path: Path) -> None:
    """``--opset`` (the orchestrators' ``opset`` parameter; empty: none) reaches the config; a
    run without it hashes as before the option existed."""
    from graphtrim.cli.main import build_parser
    from graphtrim.cli.pipeline_context import _context_and_config
    from graphtrim.errors import GraphtrimError

    def config(*extra: str) -> Any:
        argv = [
            "pipeline",
            "stage",
            "optimize",
            "--output",
            str(tmp_path / "o.json"),
            "--tracking-uri",
            f"sqlite:///{tmp_path / 'db'}",
            *extra,
        ]
        return _context_and_config(build_parser(argv).parse_args(argv))[1]

    plain, raised = config(), config("--opset", "23")
    assert plain.opset is None and config("--opset", "").opset is None and raised.opset == 23
    assert plain.config_hash != raised.config_hash
    assert plain.hash_for("preset", "opset") == plain.hash_for("preset")
    assert plain.to_json()["opset"] is None
    assert type(raised).from_json(raised.to_json()).config_hash == raised.config_hash
    with pytest.raises(GraphtrimError, match="opset: 99 is not between 7 and"):
        config("--opset", "99")
    with pytest.raises(SystemExit):
        config("--opset", "twenty")
