"""graphtrim's benchmark: graphtrim beside the other ONNX optimizers on a suite built offline."""
