"""Model folder -> ONNX artifact folder (fused, fp32 / fp16 / int8), with a parity gate."""
