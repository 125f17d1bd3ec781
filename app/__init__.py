"""HTTP embedding server over ONNX Runtime; reads only the artifact folder, never imports torch."""
