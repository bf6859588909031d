"""ultralytics detectors built from their YAML definitions (random weights), exported through
ultralytics' own ONNX exporter with its simplifier off: the graph a YOLO user starts from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.corpus import Spec, spec

CONFIGS = [
    "yolov5n.yaml",
    "yolov6n.yaml",
    "yolov9t.yaml",
    "yolov8n.yaml",
    "yolov8n-seg.yaml",
    "yolov8n-pose.yaml",
    "yolov8n-obb.yaml",
    "yolov8n-cls.yaml",
    "yolov10n.yaml",
    "yolo11n.yaml",
    "yolo11n-seg.yaml",
    "yolo11n-pose.yaml",
    "yolo12n.yaml",
    "rtdetr-l.yaml",
]

SPECS: list[Spec] = [
    spec(
        "yolo-" + c.removesuffix(".yaml"),
        "ultralytics",
        f"ultralytics:{c}",
        "bench.corpus.yolo:build",
        exporters=("ultralytics",),
        config=c,
    )
    for c in CONFIGS
]


def build(config: str) -> Any:
    def write(out: Path, exporter: str) -> dict[str, Any]:
        import os
        import shutil
        import tempfile

        from ultralytics import RTDETR, YOLO

        with tempfile.TemporaryDirectory() as tmp:
            os.chdir(tmp)
            model = (RTDETR if config.startswith("rtdetr") else YOLO)(config)
            imgsz = 224 if "-cls" in config else 320
            produced = model.export(format="onnx", simplify=False, imgsz=imgsz, dynamic=False)
            shutil.move(str(produced), out)
        return {"dynamic": False}

    return write
