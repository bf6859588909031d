"""transformers: encoders, decoders (with and without KV-cache inputs), encoder-decoders, vision
and audio models, each from its library config made small (2 layers, width 64), random weights.

Text models take ``input_ids`` and ``attention_mask`` (the mask subgraph is part of what real
exports carry); decoders with a cache take the past keys and values as inputs and return the
present ones."""

from __future__ import annotations

from typing import Any

from bench.corpus import Spec, spec
from bench.corpus.hf_models import CACHED, MODELS, SMALL

SPECS: list[Spec] = [
    spec(f"hf-{t}", "transformers", f"transformers:{cls}", "bench.corpus.hf:build", model_type=t)
    for t, (cls, _, _) in MODELS.items()
] + [
    spec(
        f"hf-{t}-kv",
        "transformers",
        f"transformers:{MODELS[t][0]} with past key values",
        "bench.corpus.hf:build",
        model_type=t,
        cache=True,
    )
    for t in CACHED
]


def _config(model_type: str) -> Any:
    import transformers

    _cls, kind, extra = MODELS[model_type]
    overrides = dict(SMALL)
    overrides.update(extra)
    config_cls = transformers.CONFIG_MAPPING[model_type]
    if kind == "clip":
        text = {**SMALL, "max_position_embeddings": 32}
        vision = {
            k: v for k, v in SMALL.items() if k not in ("vocab_size", "max_position_embeddings")
        }
        vision.update(image_size=32, patch_size=8)
        return config_cls(text_config=text, vision_config=vision, projection_dim=32)
    if kind == "detr":
        overrides.pop("hidden_size")
        overrides.pop("vocab_size")
        backbone = transformers.ResNetConfig(
            embedding_size=16,
            hidden_sizes=[16, 32, 64, 128],
            depths=[1, 1, 1, 1],
            out_features=["stage4"],
        )
        overrides["backbone_config"] = backbone
    return config_cls(**overrides)


def build(model_type: str, cache: bool = False) -> Any:
    import os

    import torch
    import transformers

    from bench.corpus.torch_export import Built

    cls, kind, _ = MODELS[model_type]
    config = _config(model_type)
    if os.environ.get("CORPUS_EXPORTER") == "torchscript":
        # the TorchScript exporter has no scaled_dot_product_attention below opset 14: its users
        # export the eager attention (matmuls, the additive mask), as this does
        config._attn_implementation = "eager"
    inner = getattr(transformers, cls)(config).eval()
    batch, seq = 2, 16

    if kind == "encoder" or (kind == "decoder" and not cache):

        class Text(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner = inner

            def forward(
                self, input_ids: torch.Tensor, attention_mask: torch.Tensor
            ) -> torch.Tensor:
                kw: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
                if kind == "decoder":
                    kw["use_cache"] = False
                return self.inner(**kw).last_hidden_state

        mask = torch.ones(batch, seq, dtype=torch.int64)
        mask[1, -4:] = 0
        return Built(
            Text(),
            {"input_ids": torch.randint(3, 900, (batch, seq)), "attention_mask": mask},
            ["last_hidden_state"],
            {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}},
        )
    if kind == "decoder":
        return _with_cache(inner, config, batch, seq)
    if kind in ("seq2seq", "speech2seq"):

        class Seq2Seq(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner = inner

            def forward(
                self, encoder_input: torch.Tensor, decoder_input_ids: torch.Tensor
            ) -> torch.Tensor:
                key = "input_features" if kind == "speech2seq" else "input_ids"
                kw = {
                    key: encoder_input,
                    "decoder_input_ids": decoder_input_ids,
                    "use_cache": False,
                }
                return self.inner(**kw).last_hidden_state

        if kind == "speech2seq":
            enc = torch.randn(1, config.num_mel_bins, 2 * config.max_source_positions)
            dyn: dict[str, dict[int, str]] = {"encoder_input": {0: "batch"}}
        else:
            enc = torch.randint(3, 900, (batch, seq))
            dyn = {"encoder_input": {0: "batch", 1: "seq"}}
        dec = torch.randint(3, 900, (enc.shape[0], 8))
        dyn["decoder_input_ids"] = {0: "batch", 1: "decoder_seq"}
        return Built(
            Seq2Seq(), {"encoder_input": enc, "decoder_input_ids": dec}, ["last_hidden_state"], dyn
        )
    if kind in ("image", "detr"):

        class Image(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner = inner

            def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
                return self.inner(pixel_values=pixel_values).last_hidden_state

        size = getattr(config, "image_size", 64)
        size = size if isinstance(size, int) else 64
        return Built(
            Image(),
            {"pixel_values": torch.randn(1, 3, size, size)},
            ["last_hidden_state"],
            {"pixel_values": {0: "batch"}},
        )
    if kind == "clip":

        class Clip(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner = inner

            def forward(
                self,
                input_ids: torch.Tensor,
                attention_mask: torch.Tensor,
                pixel_values: torch.Tensor,
            ) -> torch.Tensor:
                out = self.inner(
                    input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values
                )
                return out.logits_per_image

        mask = torch.ones(batch, 8, dtype=torch.int64)
        return Built(
            Clip(),
            {
                "input_ids": torch.randint(3, 900, (batch, 8)),
                "attention_mask": mask,
                "pixel_values": torch.randn(1, 3, 32, 32),
            },
            ["logits_per_image"],
            {
                "input_ids": {0: "texts"},
                "attention_mask": {0: "texts"},
                "pixel_values": {0: "images"},
            },
        )
    if kind == "audio":

        class Audio(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner = inner

            def forward(self, input_values: torch.Tensor) -> torch.Tensor:
                return self.inner(input_values=input_values).last_hidden_state

        return Built(
            Audio(),
            {"input_values": torch.randn(1, 4000)},
            ["last_hidden_state"],
            {"input_values": {0: "batch", 1: "samples"}},
        )
    raise ValueError(kind)


def _with_cache(inner: Any, config: Any, batch: int, seq: int) -> Any:
    import torch
    from transformers import DynamicCache

    from bench.corpus.torch_export import Built

    layers = config.num_hidden_layers
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    past = 8

    class Cached(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(
            self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *kv: torch.Tensor
        ) -> tuple[torch.Tensor, ...]:
            cache = DynamicCache(config=config)
            for i in range(layers):
                cache.update(kv[2 * i], kv[2 * i + 1], i)
            out = self.inner(
                input_ids=input_ids,
                attention_mask=attention_mask,
                past_key_values=cache,
                use_cache=True,
            )
            present = out.past_key_values
            flat: list[torch.Tensor] = []
            for i in range(layers):
                flat += [present.layers[i].keys, present.layers[i].values]
            return (out.last_hidden_state, *flat)

    inputs: dict[str, Any] = {
        "input_ids": torch.randint(3, 900, (batch, 1)),
        "attention_mask": torch.ones(batch, past + 1, dtype=torch.int64),
    }
    dyn: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch"},
        "attention_mask": {0: "batch", 1: "total"},
    }
    outputs = ["last_hidden_state"]
    for i in range(layers):
        for kind in ("key", "value"):
            inputs[f"past_{kind}_{i}"] = torch.randn(batch, heads, past, head_dim)
            dyn[f"past_{kind}_{i}"] = {0: "batch", 2: "past"}
            outputs.append(f"present_{kind}_{i}")
    return Built(Cached(), inputs, outputs, dyn)
