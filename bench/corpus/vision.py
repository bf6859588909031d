"""torchvision: classifiers, a video classifier, detectors, segmenters and keypoint models (random
weights, no pretrained backbone). The detectors' post-processing brings NMS, RoiAlign and the
``If``/``Loop`` nodes of their TorchScript exports."""

from __future__ import annotations

from typing import Any

from bench.corpus import Spec, spec

CLASSIFIERS = [
    "resnet18",
    "resnext50_32x4d",
    "wide_resnet50_2",
    "squeezenet1_1",
    "mobilenet_v2",
    "mobilenet_v3_small",
    "shufflenet_v2_x0_5",
    "mnasnet0_5",
    "efficientnet_b0",
    "efficientnet_v2_s",
    "regnet_y_400mf",
    "googlenet",
    "densenet121",
    "alexnet",
    "convnext_tiny",
    "swin_t",
    "swin_v2_t",
    "vit_b_32",
    "maxvit_t",
]

DETECTORS = [
    "fasterrcnn_mobilenet_v3_large_320_fpn",
    "retinanet_resnet50_fpn",
    "fcos_resnet50_fpn",
    "ssdlite320_mobilenet_v3_large",
    "maskrcnn_resnet50_fpn",
    "keypointrcnn_resnet50_fpn",
]

SEGMENTERS = ["fcn_resnet50", "deeplabv3_mobilenet_v3_large", "lraspp_mobilenet_v3_large"]

SPECS: list[Spec] = (
    [
        spec(
            f"tv-{a}",
            "torchvision",
            f"torchvision.models:{a}",
            "bench.corpus.vision:classifier",
            arch=a,
        )
        for a in CLASSIFIERS
    ]
    + [
        spec(
            "tv-r3d_18",
            "torchvision",
            "torchvision.models.video:r3d_18",
            "bench.corpus.vision:video",
            arch="r3d_18",
        )
    ]
    + [
        spec(
            f"tv-{a}",
            "torchvision",
            f"torchvision.models.detection:{a}",
            "bench.corpus.vision:detector",
            arch=a,
        )
        for a in DETECTORS
    ]
    + [
        spec(
            f"tv-{a}",
            "torchvision",
            f"torchvision.models.segmentation:{a}",
            "bench.corpus.vision:segmenter",
            arch=a,
        )
        for a in SEGMENTERS
    ]
)


def classifier(arch: str) -> Any:
    import torch
    import torchvision

    from bench.corpus.torch_export import Built

    model = torchvision.models.get_model(arch, weights=None)
    size = 299 if arch == "inception_v3" else 224
    return Built(
        model, {"image": torch.randn(1, 3, size, size)}, ["logits"], {"image": {0: "batch"}}
    )


def video(arch: str) -> Any:
    import torch
    import torchvision

    from bench.corpus.torch_export import Built

    model = torchvision.models.get_model(arch, weights=None)
    return Built(
        model, {"clip": torch.randn(1, 3, 8, 112, 112)}, ["logits"], {"clip": {0: "batch"}}
    )


def detector(arch: str) -> Any:
    import torch
    import torchvision

    from bench.corpus.torch_export import Built

    inner = torchvision.models.get_model(
        arch, weights=None, weights_backbone=None, num_classes=91 if "keypoint" not in arch else 2
    )

    class Detect(torch.nn.Module):
        """One image in (C, H, W), the first image's boxes, scores and labels out."""

        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            out = self.inner([image])[0]
            return out["boxes"], out["scores"], out["labels"]

    size = 320 if "320" in arch else 256
    return Built(
        Detect(),
        {"image": torch.rand(3, size, size)},
        ["boxes", "scores", "labels"],
        {"image": {1: "height", 2: "width"}},
        opset=11 if "ssd" not in arch else 13,
    )


def segmenter(arch: str) -> Any:
    import torch
    import torchvision

    from bench.corpus.torch_export import Built

    inner = torchvision.models.get_model(arch, weights=None, weights_backbone=None, num_classes=21)

    class Segment(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, image: torch.Tensor) -> torch.Tensor:
            return self.inner(image)["out"]

    return Built(
        Segment(), {"image": torch.randn(1, 3, 224, 224)}, ["mask"], {"image": {0: "batch"}}
    )
