"""The transformers models of the corpus: each model type's class, kind and the config overrides
that make it small (beyond the shared ``SMALL`` sizes), and the decoders also exported with
their KV-cache inputs."""

from __future__ import annotations

from typing import Any

SMALL = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 1000,
    "max_position_embeddings": 128,
}

# the encoder-decoders' sizes (the BART family's names)
_ENCODER_DECODER: dict[str, Any] = {
    "d_model": 64,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
}

# the ViT family's image and patch (4 x 4 patches)
_VIT: dict[str, Any] = {"image_size": 64, "patch_size": 16}

# the wav2vec2 family's feature encoder, made small
_CONV_AUDIO: dict[str, Any] = {
    "conv_dim": [32, 32],
    "conv_stride": [5, 2],
    "conv_kernel": [10, 3],
    "num_conv_pos_embeddings": 16,
    "num_conv_pos_embedding_groups": 4,
}


# model_type -> (model class, kind, config overrides beyond SMALL)
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "bert": ("BertModel", "encoder", {}),
    "roberta": ("RobertaModel", "encoder", {"pad_token_id": 1}),
    "deberta-v2": ("DebertaV2Model", "encoder", {}),
    "electra": ("ElectraModel", "encoder", {"embedding_size": 64}),
    "albert": ("AlbertModel", "encoder", {"embedding_size": 32}),
    "distilbert": (
        "DistilBertModel",
        "encoder",
        {"dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 128},
    ),
    "xlm-roberta": ("XLMRobertaModel", "encoder", {"pad_token_id": 1}),
    "mpnet": ("MPNetModel", "encoder", {}),
    "mobilebert": (
        "MobileBertModel",
        "encoder",
        {"embedding_size": 32, "intra_bottleneck_size": 32, "true_hidden_size": 32},
    ),
    "funnel": (
        "FunnelModel",
        "encoder",
        {"block_sizes": [1, 1], "d_model": 64, "n_head": 4, "d_head": 16, "d_inner": 128},
    ),
    "gpt2": ("GPT2Model", "decoder", {}),
    "gpt_neox": ("GPTNeoXModel", "decoder", {}),
    "llama": ("LlamaModel", "decoder", {"num_key_value_heads": 2}),
    "mistral": ("MistralModel", "decoder", {"num_key_value_heads": 2}),
    "qwen2": ("Qwen2Model", "decoder", {"num_key_value_heads": 2}),
    "phi": ("PhiModel", "decoder", {}),
    "phi3": ("Phi3Model", "decoder", {"pad_token_id": 0}),
    "gemma": ("GemmaModel", "decoder", {"num_key_value_heads": 2, "head_dim": 16}),
    "opt": ("OPTModel", "decoder", {"ffn_dim": 128, "word_embed_proj_dim": 64}),
    "bloom": ("BloomModel", "decoder", {"n_layer": 2, "n_head": 4}),
    "t5": (
        "T5Model",
        "seq2seq",
        {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_heads": 4},
    ),
    "bart": (
        "BartModel",
        "seq2seq",
        _ENCODER_DECODER,
    ),
    "marian": (
        "MarianModel",
        "seq2seq",
        {
            **_ENCODER_DECODER,
            "pad_token_id": 0,
            "decoder_start_token_id": 0,
        },
    ),
    "whisper": (
        "WhisperModel",
        "speech2seq",
        {
            **_ENCODER_DECODER,
            "num_mel_bins": 80,
            "max_source_positions": 100,
            "max_target_positions": 64,
        },
    ),
    "vit": ("ViTModel", "image", _VIT),
    "deit": ("DeiTModel", "image", _VIT),
    "beit": ("BeitModel", "image", _VIT),
    "dinov2": ("Dinov2Model", "image", _VIT),
    "swin": (
        "SwinModel",
        "image",
        {
            "image_size": 64,
            "patch_size": 4,
            "embed_dim": 32,
            "depths": [1, 1],
            "num_heads": [2, 4],
            "window_size": 4,
        },
    ),
    "convnext": (
        "ConvNextModel",
        "image",
        {"hidden_sizes": [32, 64], "depths": [1, 1], "num_stages": 2},
    ),
    "segformer": (
        "SegformerModel",
        "image",
        {
            "num_encoder_blocks": 2,
            "depths": [1, 1],
            "sr_ratios": [2, 1],
            "hidden_sizes": [32, 64],
            "num_attention_heads": [1, 2],
            "patch_sizes": [7, 3],
            "strides": [4, 2],
            "mlp_ratios": [2, 2],
        },
    ),
    "mobilevit": (
        "MobileViTModel",
        "image",
        {
            "image_size": 64,
            "hidden_sizes": [32, 48, 64],
            "neck_hidden_sizes": [8, 16, 24, 32, 40, 48, 160],
        },
    ),
    "detr": (
        "DetrModel",
        "detr",
        {
            **_ENCODER_DECODER,
            "encoder_layers": 1,
            "decoder_layers": 1,
            "num_queries": 10,
            "use_timm_backbone": False,
            "use_pretrained_backbone": False,
        },
    ),
    "clip": ("CLIPModel", "clip", {}),
    "wav2vec2": (
        "Wav2Vec2Model",
        "audio",
        _CONV_AUDIO,
    ),
    "hubert": (
        "HubertModel",
        "audio",
        _CONV_AUDIO,
    ),
}


CACHED = ["gpt2", "llama", "mistral", "qwen2", "phi", "gemma", "opt"]
