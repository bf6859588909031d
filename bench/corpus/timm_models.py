"""timm image classifiers: each architecture's smallest configuration, random weights, batch 1 at
the model's own input size (its default config)."""

from __future__ import annotations

from typing import Any

from bench.corpus import Spec, spec

ARCHITECTURES = [
    "resnet18",
    "resnet26d",
    "resnext26ts",
    "seresnext26d_32x4d",
    "resnest14d",
    "res2net50_26w_4s",
    "regnetx_002",
    "regnety_004",
    "efficientnet_b0",
    "efficientnetv2_rw_t",
    "tf_efficientnetv2_b0",
    "mobilenetv3_small_100",
    "mobilenetv3_large_100",
    "mobilenetv4_conv_small",
    "mobilenetv4_hybrid_medium",
    "ghostnet_100",
    "ghostnetv2_100",
    "convnext_atto",
    "convnextv2_atto",
    "repvgg_a0",
    "mobileone_s0",
    "densenet121",
    "inception_v3",
    "legacy_xception",
    "hrnet_w18_small",
    "dla34",
    "dpn68",
    "cspdarknet53",
    "ese_vovnet19b_dw",
    "rexnet_100",
    "lcnet_050",
    "mixnet_s",
    "mnasnet_100",
    "fbnetc_100",
    "tinynet_a",
    "selecsls42b",
    "nf_resnet26",
    "vit_tiny_patch16_224",
    "deit_tiny_distilled_patch16_224",
    "cait_xxs24_224",
    "xcit_nano_12_p16_224",
    "pit_ti_224",
    "crossvit_tiny_240",
    "swin_tiny_patch4_window7_224",
    "maxvit_rmlp_pico_rw_256",
    "coatnet_nano_rw_224",
    "levit_128s",
    "mobilevit_xxs",
    "mobilevitv2_050",
    "efficientformer_l1",
    "efficientformerv2_s0",
    "poolformer_s12",
    "edgenext_xx_small",
    "fastvit_t8",
    "repvit_m1",
    "efficientvit_b0",
    "gcvit_xxtiny",
    "visformer_tiny",
]

SPECS: list[Spec] = [
    spec(f"timm-{a}", "timm", f"timm:{a}", "bench.corpus.timm_models:build", arch=a)
    for a in ARCHITECTURES
]


def build(arch: str) -> Any:
    import timm
    import torch

    from bench.corpus.torch_export import Built

    model = timm.create_model(arch, pretrained=False)
    size = tuple(model.pretrained_cfg.get("input_size", (3, 224, 224)))
    return Built(
        module=model,
        inputs={"image": torch.randn(1, *size)},
        outputs=["logits"],
        dynamic={"image": {0: "batch"}},
    )
