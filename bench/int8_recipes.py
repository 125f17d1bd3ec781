"""int8 recipes on one checkpoint: the export gate's figures (min cosine to PyTorch fp32 over its random
and real-text batches), the mean-pooled figure on other batches (to choose on without tuning to the
gate) and CPU cost, for the shipped recipe (export.optimize.quantize_int8) and the
alternatives it was chosen over. Cost: CPU seconds for one batch of 32 texts of 40-100 words on one
thread (the server runs one single-threaded batch per core), median over interleaved repeats; CPU time
rather than wall time because the VM is shared.

  python bench/int8_recipes.py --model MODEL_DIR [--json OUT] [--repeats 6]
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from bench.http_load import make_texts  # noqa: E402
from export import smoothing  # noqa: E402
from export.onnx_graph import EmbeddingGraph, trace_to_onnx  # noqa: E402
from export.optimize import optimize_graph, quantize_int8  # noqa: E402
from export.parity import compare, random_batches, reference_outputs, text_batches  # noqa: E402
from export.checkpoint_layout import read_layout  # noqa: E402
from export.pipeline import _load_tokenizer, _served_length, parity_feeds, special_token_ids  # noqa: E402
from training.wordpiece import CLS, PAD, SEP  # noqa: E402
from training.model_folder import LoadedModel, load_model_folder  # noqa: E402

FIGURES = ("cls_embedding", "pooled_embedding", "mean_pooling", "max_pooling", "token_embeddings")


@dataclass
class Checkpoint:
    """A model folder as export reads it, with the parity gate's and calibration's feeds."""
    loaded: LoadedModel
    tokenizer: Tokenizer
    specials: dict[str, int]
    graph: EmbeddingGraph  # PyTorch, eval mode: the reference
    served_length: int
    gate: list[dict[str, np.ndarray]]
    calibration: list[dict[str, np.ndarray]]


def load_checkpoint(model: Path) -> Checkpoint:
    layout = read_layout(model)
    loaded = load_model_folder(layout.encoder_dir)
    tokenizer = _load_tokenizer(layout.encoder_dir, loaded.config.vocab_size)
    specials = special_token_ids(tokenizer)
    graph = EmbeddingGraph(loaded.model, loaded.has_pooler, loaded.has_nsp_head).eval()
    served_length = _served_length(layout, loaded.config.max_position_embeddings, None)
    gate, calibration = parity_feeds(tokenizer, specials, loaded.config.vocab_size, served_length)
    return Checkpoint(loaded, tokenizer, specials, graph, served_length, gate, calibration)


def dynamic(src: Path, dst: Path, **options) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    logging.getLogger().setLevel(logging.ERROR)
    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8,
                     extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT}, **options)


def recipes(fp32: Path, config, calibration) -> dict:
    """name -> function(dst) writing that int8 graph."""
    import export.optimize as optimize

    names = [n.name for n in onnx.load(str(fp32), load_external_data=False).graph.node]
    layer0 = [n for n in names if "/encoder/layer.0/" in n and n.endswith("MatMul")]
    ffn_out = [n for n in names if "/output/dense/MatMul" in n and "attention" not in n]
    dense = ["MatMul", "Attention"]

    def shipped(alpha: float = 0.7, keep=((0, "output"),)):
        """quantize_int8 with smoothing's alpha and KEEP_FP32 set to these."""
        def build(dst: Path) -> None:
            real = optimize.KEEP_FP32
            smoothing.ALPHA, optimize.KEEP_FP32 = alpha, keep
            try:
                quantize_int8(fp32, dst, config, calibration)
            finally:
                smoothing.ALPHA, optimize.KEEP_FP32 = 0.7, real
        return build

    every_attention = tuple((layer, "attention") for layer in range(config.num_hidden_layers))
    return {
        "ORT defaults (per-tensor weights)": lambda d: dynamic(fp32, d),
        "per-channel": lambda d: dynamic(fp32, d, per_channel=True),
        "per-channel, layer 0's MatMuls fp32": lambda d: dynamic(fp32, d, per_channel=True, nodes_to_exclude=layer0),
        "per-channel, embeddings fp32": lambda d: dynamic(fp32, d, per_channel=True, op_types_to_quantize=dense),
        "per-channel, every FFN output MatMul fp32": lambda d: dynamic(
            fp32, d, per_channel=True, nodes_to_exclude=ffn_out),
        "smoothing alpha 0.6, embeddings and layer-0 FFN output fp32": shipped(0.6),
        "smoothing alpha 0.7, same (the recipe before)": shipped(0.7),
        "smoothing alpha 0.8, same": shipped(0.8),
        "alpha 0.7, same + every Attention fp32": shipped(keep=((0, "output"),) + every_attention),
        "alpha 0.7, same + layer 1 FFN output, layer 2 attention fp32": shipped(
            keep=((0, "output"), (1, "output"), (2, "attention"))),
        "alpha 0.7, same + layer 1 FFN output, layer 2 attention and FFN input fp32 (shipped)": shipped(
            keep=optimize.KEEP_FP32),
    }


def cpu_seconds(path: Path, feed: dict, repeats: int) -> list[float]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    session.run(None, feed)
    times = []
    for _ in range(repeats):
        start = time.process_time()
        session.run(None, feed)
        times.append(time.process_time() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args(argv)

    c = load_checkpoint(args.model)
    loaded, tokenizer, specials, graph, served_length = c.loaded, c.tokenizer, c.specials, c.graph, c.served_length
    gate, calibration = c.gate, c.calibration
    references = [reference_outputs(graph, feed) for feed in gate]
    # Other batches than the gate's, to choose a recipe on: calibration's, more seeded random ids, more text.
    words = sorted(i for i in tokenizer.get_vocab().values()
                   if i not in set(specials.values()) and i < loaded.config.vocab_size)
    other = calibration + [batch for seed in (7, 8) for batch in random_batches(
        words, specials[CLS], specials[SEP], specials[PAD], served_length, seed=seed)]
    other += text_batches(tokenizer, make_texts(32, 3, 5, 60), served_length, specials[PAD])
    other_references = [reference_outputs(graph, feed) for feed in other]
    encodings = [tokenizer.encode(t) for t in make_texts(32, 0, 40, 100)]
    width = max(len(e.ids) for e in encodings)
    feed = {k: np.zeros((32, width), dtype=np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")}
    for row, e in enumerate(encodings):
        feed["input_ids"][row, :len(e.ids)], feed["attention_mask"][row, :len(e.ids)] = e.ids, 1

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        trace_to_onnx(graph, tmp / "traced.onnx")
        optimize_graph(tmp / "traced.onnx", tmp / "fp32.onnx", loaded.config, use_gpu=False, float16=False)
        files, rows = {"fp32 (fused, no int8)": tmp / "fp32.onnx"}, {}
        for i, (name, build) in enumerate(recipes(tmp / "fp32.onnx", loaded.config, calibration).items()):
            files[name] = tmp / f"int8_{i}.onnx"
            build(files[name])
        smoothing.ALPHA = 0.7
        for name, path in files.items():
            session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            figures = compare(session, graph, gate, references)
            rows[name] = {f: round(figures[f"{f}_min_cosine"], 4) for f in FIGURES if f"{f}_min_cosine" in figures}
            rows[name]["mean_pooling_other_batches"] = round(
                compare(session, graph, other, other_references)["mean_pooling_min_cosine"], 4)
            print(f"figures: {name}", file=sys.stderr)
        times: dict[str, list[float]] = {name: [] for name in files}
        for _ in range(max(1, args.repeats // 2)):  # interleaved: the shared VM's load moves
            for name, path in files.items():
                times[name] += cpu_seconds(path, feed, 2)
    print(f"| recipe | {' | '.join(FIGURES)} | mean_pooling, other batches | CPU s per batch of 32 (1 thread) "
          "| texts/s per core |")
    print("| --- |" + " --- |" * (len(FIGURES) + 3))
    for name, row in rows.items():
        seconds = statistics.median(times[name])
        row.update(cpu_s_batch32=round(seconds, 3), texts_per_s_per_core=round(32 / seconds, 1))
        print(f"| {name} | " + " | ".join(f"{row.get(f, float('nan')):.4f}" for f in FIGURES + ("mean_pooling_other_batches",))
              + f" | {seconds:.3f} | {32 / seconds:.1f} |")
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "batch_tokens": [32, width], "rows": rows},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
