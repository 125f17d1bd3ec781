"""Model folder -> ONNX artifact folder (fused, fp32 / fp16 / int8), with a parity gate."""


class ExportError(RuntimeError):
    """The export cannot produce a correct artifact; the message (one line) says why. Nothing is written."""
