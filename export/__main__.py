"""python -m export --model MODEL_DIR --out ARTIFACT_DIR [--device cpu|cuda] [--int8] [--keep-padding]
                   [--custom-kernels auto|on|off] [--no-cuda-graphs] [--max-length N]"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")  # before ONNX Runtime loads: see app/__main__.py

from artifact.manifest import ManifestError  # noqa: E402
from export import ExportError  # noqa: E402
from export.pipeline import CLS_ROWS_MAX_LAYERS, export_artifact  # noqa: E402
from training.model_folder import ModelFolderError  # noqa: E402
from training.stop_signals import (exit_with, finishing, forget_caught_interrupt,  # noqa: E402
                                   interrupted_exit_code, sigterm_as_interrupt)
from training.writes import settled_path, write_failed  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m export",
        description="Turn a BERT model folder (ours or a Hugging Face checkpoint) into the artifact folder "
                    "the server loads: fused ONNX graphs, tokenizer.json, manifest.json.")
    parser.add_argument("--model", required=True, help="model folder: config.json, weights, vocab.txt or tokenizer.json")
    parser.add_argument("--out", required=True, help="artifact folder to write: absent, empty or an earlier artifact, replaced whole when the export succeeds")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: also build the fp16 graph and check it on the GPU (needs onnxruntime-gpu)")
    parser.add_argument("--int8", action="store_true", help="also build a dynamically quantised int8 CPU graph")
    parser.add_argument("--keep-padding", action="store_true",
                        help="fp16 graph without ORT's padding removal (fixed shapes, e.g. for CUDA graphs)")
    parser.add_argument("--custom-kernels", choices=["auto", "on", "off"], default="auto",
                        help="with --device cuda, also write the fp16 graph on our operators (GEMMs with their bias "
                             "and GELU fused, the packed attention where the library has it; custom_kernels/): "
                             "auto when its library is built, on: required")
    parser.add_argument("--attention-kernel", action=argparse.BooleanOptionalAction, default=True,
                        help="with the custom-kernels graph, run its packed attention on our kernel where the library "
                             "has it and this GPU runs it (the default); --no-attention-kernel keeps ONNX Runtime's "
                             "PackedMultiHeadAttention there")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="with --device cuda (the default there), also write a host-packed copy of the packed "
                             "fp16 graph (and of its custom-kernels variant) that the server replays as CUDA "
                             "graphs: batches of texts cost less CPU and a lone text is answered sooner, for about "
                             "2 x the fp16 graph's size on disk (BENCHMARKS.md)")
    parser.add_argument("--max-length", type=int, default=None, metavar="N",
                        help="longest input served, in tokens (at most the model's position embeddings). Default: "
                             "the length the model was trained at: training_summary.json max_length, "
                             "sentence_bert_config.json max_seq_length, tokenizer_config.json model_max_length, "
                             "else its positions")
    parser.add_argument("--cpu-cls-rows", choices=["auto", "on", "off"], default="auto",
                        help="also write each CPU graph with its last layer at the [CLS] position only, which the "
                             "server runs for batches that need no token vectors or mean: auto for models of at "
                             f"most {CLS_ROWS_MAX_LAYERS} layers, where it saves 8-39%% of such a batch, for the "
                             "graph's size again on disk and in the server's memory")
    args = parser.parse_args(argv)
    args.out = settled_path(args.out)  # `--out a/x/../x`: see training.writes.settled_path

    try:
        with sigterm_as_interrupt():
            manifest = export_artifact(args.model, args.out, device=args.device, int8=args.int8,
                                       remove_padding=not args.keep_padding, kernels=args.custom_kernels,
                                       cuda_graphs=args.cuda_graphs, max_length=args.max_length,
                                       attention_kernel=args.attention_kernel, cls_rows=args.cpu_cls_rows)
    except (ExportError, ModelFolderError, ManifestError, OSError) as e:
        if isinstance(e, OSError):  # a full disk, a folder that cannot be written: the file and the reason
            e = write_failed(Path(e.filename or args.out), e)
        message = " ".join(str(e).split())  # one line, however the cause formats itself
        print(f"export failed: {message if len(message) <= 600 else message[:597] + '...'}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        forget_caught_interrupt()
        print(f"export interrupted; nothing was written to {args.out}", file=sys.stderr)
        return interrupted_exit_code()
    with finishing():  # the artifact is complete
        _summary(args.out, manifest)
    return 0


def _parity_figures(parity: dict[str, float]) -> str:
    """A graph's parity figures, cosines to six decimals: at three significant digits an int8 graph's 0.9996
    read as 1, exact parity."""
    return ", ".join(f"{k} {v:.6f}" if k.endswith("_min_cosine") else f"{k} {v:.3g}"
                     for k, v in parity.items() if k != "batches")


def _summary(out: str, manifest) -> None:
    """What the export wrote: the model's serving defaults, then each graph with its parity."""
    print(f"serves up to {manifest.max_length} tokens (of {manifest.max_position_embeddings} positions); default "
          f"pooling {manifest.default_pooling}"
          + "".join(f", Dense {d['in_features']} -> {d['out_features']} ({d['activation']})"
                    for d in manifest.sentence_dense)
          + (", normalised" if manifest.default_normalize else "")
          + (f"; prompts {', '.join(manifest.prompts)}" if manifest.prompts else "")
          + (f" ({manifest.default_prompt_name} before every text unless a request names another)"
             if manifest.default_prompt_name else "")
          + _head(manifest.classifier_labels))
    for precision, info in manifest.graphs.items():
        fused = ", ".join(f"{k} {v}" for k, v in info.fused_operators.items() if v)
        print(f"{precision}: {out}/{info.file} on {info.device}; fused: {fused}; parity over "
              f"{int(info.parity['batches'])} batches: {_parity_figures(info.parity)}")
        if kernels := info.custom_kernels:
            ops = ", ".join(f"{k} {v}" for k, v in kernels.operators.items())
            print(f"{precision} with custom kernels: {out}/{kernels.file}; {ops}; parity: "
                  f"{_parity_figures(kernels.parity)}")
        if replayed := info.host_packed:
            print(f"{precision} host-packed (CUDA graphs): {out}/{replayed.file}"
                  + (f" and {replayed.custom_kernels.file}" if replayed.custom_kernels else "")
                  + f"; parity: {_parity_figures(replayed.parity)}")
        elif info.padded:
            print(f"{precision}: CUDA graphs replay {out}/{info.padded.file} itself")
        if rows := info.cls_rows:
            print(f"{precision} with its last layer at [CLS] only ({', '.join(rows.outputs)}): {out}/{rows.file}; "
                  f"parity: {_parity_figures(rows.parity)}")


def _head(labels: list[str]) -> str:
    """The summary's words for a sequence classifier's head, if the model has one."""
    if len(labels) == 1:
        return "; a cross-encoder: one score per pair (/rerank, /predict)"
    return f"; a classifier of {len(labels)} labels, {', '.join(labels)} (/predict)" if labels else ""


if __name__ == "__main__":
    exit_with(main())
