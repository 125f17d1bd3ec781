"""Engine throughput of the exported artifact against PyTorch on the same weights, in one run.

CUDA: the fp16 artifact (ORT, IO binding; packed = padding removed, padded, padded + CUDA graph; "+kernels":
the graph on custom_kernels' fused GEMM + bias + GELU operator, when its library is built; "+kernels
ort-attention": that graph with ORT's PackedMultiHeadAttention in place of our PackedAttention; "+kernels
ort-remove-padding": with ORT's RemovePadding in place of ours; "+kernels three-products": each layer's Q, K
and V as three products and PackedAttention, in place of one product and PackedQKVAttention; "+kernels
no-mean": without the mean_embedding output, what pooling the mean in the graph costs every batch; "host-packed
+kernels": export's host-packed graph of it, the per-sequence outputs from tokens packed on the host, its last
layer for the [CLS] rows only, "full-last-layer": without that, each also replayed as a CUDA graph)
against PyTorch fp16 SDPA eager. CPU: the fp32 and int8 artifacts against PyTorch fp32. Workloads:
fixed length (--seq) at each of --batches, and real text of varying length (Python docstrings of
the standard library, 16..256 tokens) where padding costs the engines that keep it.

  python bench/engine_throughput.py --device cuda --preset base              # GPU machine: the served graphs
  python bench/engine_throughput.py --device cuda --packed-attention PackedAttention,PackedMultiHeadAttention
  python bench/engine_throughput.py --device cpu --preset tiny --batches 1,8 --iters 3   # smoke test
  python bench/engine_throughput.py --device cuda --untuned   # +kernels graphs also on cuBLASLt's first pick

Prints a table; writes engine_throughput.json under $OUT when set (or --json PATH).
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import random
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import numpy as np  # noqa: E402
import torch  # noqa: E402

from artifact.manifest import INPUT_NAMES, MEAN_EMBEDDING  # noqa: E402
from artifact.session import kernels_library, open_session, require_cuda  # noqa: E402
from export import ExportError  # noqa: E402
from export.onnx_graph import EmbeddingGraph  # noqa: E402
from export.pipeline import default_packed_attention, export_artifact  # noqa: E402
from training.model import BertForPreTraining, preset_config  # noqa: E402
from training.model_folder import save_model_folder  # noqa: E402
from training.wordpiece import save_tokenizer, train_wordpiece  # noqa: E402

VOCAB_SIZE = 30522  # BERT-base's, so the embedding table has the real size
MIN_LEN, MAX_LEN = 16, 256


def stdlib_docstrings(limit: int) -> list[str]:
    """Docstrings of modules, classes and functions in the standard library: real English-and-code text."""
    texts: list[str] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    texts.append(" ".join(doc.split()))
        if len(texts) >= limit:
            break
    return texts


PACKED_KINDS = {"PackedAttention": "packed", "PackedMultiHeadAttention": "packed-mha"}  # artifact name per operator


def build(preset: str, device: str, work: Path, texts: list[str], packed_attention: list[str]):
    """Tokenizer trained on `texts`, a random-weight model of `preset`, and its artifact(s): on CUDA the
    padded one and a packed one per operator in `packed_attention`."""
    tokenizer = train_wordpiece(texts[:5000], vocab_size=8000, min_frequency=2)
    save_tokenizer(tokenizer, work / "tokenizer")
    torch.manual_seed(0)
    model = BertForPreTraining(preset_config(preset, vocab_size=VOCAB_SIZE)).eval()
    model_dir = save_model_folder(model, work / "tokenizer", work / "model")
    artifacts = {}
    t = time.perf_counter()
    if device == "cpu":
        artifacts["cpu"] = export_artifact(model_dir, work / "cpu", device="cpu", int8=True)
    else:
        # padded first: CUDA graphs need its fixed shapes, and it stands in if packing fails here
        artifacts["padded"] = export_artifact(model_dir, work / "padded", device="cuda", remove_padding=False)
        for op in packed_attention:
            kind = PACKED_KINDS[op]
            try:
                artifacts[kind] = export_artifact(model_dir, work / kind, device="cuda", packed_attention=op,
                                                  cuda_graphs=False)  # "padded" above is that graph
            except ExportError as e:
                print(f"{kind} fp16 export failed, benchmarking without it: {e}", flush=True)
    print(f"export ({device}): {time.perf_counter() - t:.1f} s", flush=True)
    return tokenizer, model, artifacts


def fixed_batch(batch: int, seq: int, rng: np.random.Generator, vocab_size: int = VOCAB_SIZE) -> dict[str, np.ndarray]:
    """Full-length rows of ordinary token ids, all below `vocab_size`: a larger id makes the embedding
    lookup read past the table (CUDA error 700 where that memory is unmapped, BENCHMARKS.md)."""
    high = min(8000, vocab_size)
    ids = rng.integers(min(1000, high // 2), high, (batch, seq)).astype(np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}


def text_batches(tokenizer, texts: list[str], batch: int, count: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """`count` batches of docstrings in random order (not sorted by length, as a request queue
    delivers them), each right-padded to its longest member."""
    encs = [e.ids[:MAX_LEN] for e in tokenizer.encode_batch(texts)]
    encs = [ids for ids in encs if len(ids) >= MIN_LEN]
    random.Random(seed).shuffle(encs)
    batches = []
    for i in range(count):
        rows = [encs[(i * batch + j) % len(encs)] for j in range(batch)]
        width = max(map(len, rows))
        feed = {k: np.zeros((batch, width), dtype=np.int64) for k in INPUT_NAMES}
        for r, ids in enumerate(rows):
            feed["input_ids"][r, :len(ids)] = ids
            feed["attention_mask"][r, :len(ids)] = 1
        batches.append(feed)
    return batches


class TorchEngine:
    def __init__(self, model: BertForPreTraining, device: str, dtype: torch.dtype):
        self.graph = EmbeddingGraph(model, True, True).eval().to(device=device, dtype=dtype)
        self.device = device

    def prepare(self, feed):
        return [torch.from_numpy(feed[k]).to(self.device) for k in INPUT_NAMES]

    def run(self, prepared):
        with torch.inference_mode():
            return self.graph(*prepared)

    def sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()


class DeviceBoundSession:
    """One graph file in a session as the server opens it (artifact.session), timed with IO binding:
    inputs already on the device, outputs left there (as a server that copies back only what it returns
    would do). Not the server's OrtEngine, which also copies the batch in and the outputs out."""

    def __init__(self, path: Path, device: str, threads: int | None = None, cuda_graph: bool = False,
                 kernels_library: Path | None = None):
        import onnxruntime as ort

        self.ort, self.device, self.cuda_graph = ort, device, cuda_graph
        # kernels_library: custom_kernels' operators, for the *_kernels.onnx graphs
        self.session = open_session(path, device, library=kernels_library, cuda_graph=cuda_graph,
                                    intra_op_threads=threads)
        self.outputs = [o.name for o in self.session.get_outputs()]

    def prepare(self, feed):
        io = self.session.io_binding()
        keep = []
        for name in INPUT_NAMES:
            value = self.ort.OrtValue.ortvalue_from_numpy(feed[name], self.device, 0)
            keep.append(value)
            io.bind_ortvalue_input(name, value)
        if self.cuda_graph:  # a CUDA graph replays fixed addresses: preallocate the outputs
            b, s = feed["input_ids"].shape
            for o in self.session.get_outputs():
                shape = [b if d == "batch" else s if d == "sequence" else d for d in o.shape]
                value = self.ort.OrtValue.ortvalue_from_shape_and_type(shape, np.float32, "cuda", 0)
                keep.append(value)
                io.bind_ortvalue_output(o.name, value)
        else:
            for name in self.outputs:
                io.bind_output(name, self.device)
        return io, keep

    def run(self, prepared):
        self.session.run_with_iobinding(prepared[0])

    def sync(self):
        pass  # run_with_iobinding returns once the device stream is done


class HostPackedSession(DeviceBoundSession):
    """A host-packed graph (export/host_packing.py: the per-sequence outputs, from tokens packed here) timed as
    DeviceBoundSession times the others: each batch packed on the host and put on the device in `prepare`,
    outside the timing; with `cuda_graph`, replayed as the server replays it (one graph per batch shape)."""

    def __init__(self, path: Path, kernels_library: Path | None = None, cuda_graph: bool = False):
        super().__init__(path, "cuda", cuda_graph=cuda_graph, kernels_library=kernels_library)
        self._graph_ids = 0

    def prepare(self, feed):
        from artifact.host_packing import HOST_PACKED_INPUTS, pack_on_host

        real = feed["attention_mask"].astype(bool)
        lengths = real.sum(1)
        rows, width = real.shape
        inputs = pack_on_host(lengths, feed["input_ids"][real], feed["token_type_ids"][real], rows,
                              int(lengths.sum()), width, 0)
        io, keep = self.session.io_binding(), []
        for name, array in zip(HOST_PACKED_INPUTS, inputs):
            value = self.ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), "cuda", 0)
            keep.append(value)
            io.bind_ortvalue_input(name, value)
        options = None
        if self.cuda_graph:
            for o in self.session.get_outputs():
                value = self.ort.OrtValue.ortvalue_from_shape_and_type([rows, *o.shape[1:]], np.float32, "cuda", 0)
                keep.append(value)
                io.bind_ortvalue_output(o.name, value)
            options = self.ort.RunOptions()
            options.add_run_config_entry("gpu_graph_id", str(self._graph_ids))
            self._graph_ids += 1
        else:
            for name in self.outputs:
                io.bind_output(name, "cuda")
        return io, keep, options

    def run(self, prepared):
        self.session.run_with_iobinding(prepared[0], prepared[2])


def host_packed_variants(packed_kernels: Path) -> dict[str, Path]:
    """The packed kernels graph as export's host-packed graph without the mean (the last layer for the [CLS]
    rows only, export.last_layer_rows) and as it was before that rewrite (every row through the last layer)."""
    import onnx

    from export.host_packing import host_packed
    from export.last_layer_rows import last_layer_for_cls_rows

    full = host_packed(onnx.load(str(packed_kernels)), mean=False)
    variants = {"host-packed+kernels full-last-layer": packed_kernels.with_name("host_packed_full_last_layer.onnx")}
    onnx.save(full, str(variants["host-packed+kernels full-last-layer"]))
    if last_layer_for_cls_rows(full):
        variants["host-packed+kernels"] = packed_kernels.with_name("host_packed_cls_rows.onnx")
        onnx.save(full, str(variants["host-packed+kernels"]))
    return variants


def untuned(make):
    """make() with custom_kernels' autotuning off: its kernels read the switch when the session is made."""
    with mock.patch.dict(os.environ, BERTSERVE_KERNELS_AUTOTUNE="0"):
        return make()


def timed(engine, feeds: list, iters: int, warmup: int = 3) -> float:
    """Seconds per pass over `feeds` (each prepared once, outside the timing)."""
    prepared = [engine.prepare(f) for f in feeds]
    for _ in range(warmup if len(feeds) == 1 else 1):
        for p in prepared:
            engine.run(p)
    engine.sync()
    t = time.perf_counter()
    for _ in range(iters):
        for p in prepared:
            engine.run(p)
    engine.sync()
    return (time.perf_counter() - t) / iters


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--preset", choices=["base", "tiny"], default="base")
    p.add_argument("--batches", default="1,8,32,128,256")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--text-batches", default="32,128", help="batch sizes of the varying-length workload")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=1,
                   help="time every engine this many times, in turn, and report each one's median: differences of "
                        "a few percent then outlast the card's drift in clock from one engine to the next")
    p.add_argument("--texts", type=int, default=8000, help="docstrings to read (fewer: faster start)")
    p.add_argument("--threads", type=int, default=2, help="CPU mode: threads per engine")
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--packed-attention", default="served",
                   help="comma-separated ORT operators of the packed graphs to build and time: "
                        f"{', '.join(PACKED_KINDS)}; 'served' (the default): the one export picks, as the server runs")
    p.add_argument("--variants", default="all",
                   help="comma-separated A/B variants of the +kernels graphs to time (three-products, ort-attention, "
                        "ort-remove-padding, no-mean, host-packed), 'all' or 'none'")
    p.add_argument("--untuned", action="store_true",
                   help="also time each +kernels graph with the operator's autotuning off (BERTSERVE_KERNELS_AUTOTUNE=0)")
    p.add_argument("--json", help="where to write the JSON (default: $OUT/engine_throughput.json)")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    text_sizes = [int(b) for b in args.text_batches.split(",") if b]
    cuda = args.device == "cuda"
    served = default_packed_attention(kernels_library("auto", args.device))
    packed_attention = [served if op == "served" else op for op in args.packed_attention.split(",") if op]
    if unknown := [op for op in packed_attention if op not in PACKED_KINDS]:
        p.error(f"--packed-attention: unknown {', '.join(unknown)} (known: {', '.join(PACKED_KINDS)})")
    args.packed_attention = packed_attention

    if cuda:
        require_cuda()
        card = torch.cuda.get_device_name()
    else:
        torch.set_num_threads(args.threads)
        card = f"{platform.processor() or platform.machine()}, {args.threads} threads"
    texts = stdlib_docstrings(args.texts)
    with tempfile.TemporaryDirectory(prefix="engine-throughput-") as work:  # the exported models go with it
        return _measure(args, Path(work), texts, batches, text_sizes, card)


def _variant(path: Path, suffix: str, rewrite) -> Path | None:
    """The graph at `path` as `rewrite(model)` changes it in place, written beside it with `suffix`; None
    when rewrite finds nothing to change (returns False)."""
    import onnx

    model = onnx.load(str(path))
    if not rewrite(model):
        return None
    out = path.with_name(f"{path.stem}_{suffix}.onnx")
    onnx.save(model, str(out))
    return out


def with_ort_remove_padding(path: Path) -> Path | None:
    """The kernels graph at `path` with bertserve.RemovePadding put back to ORT's (our padding removal
    against ORT's in one run); None when the graph has none."""
    def rewrite(model) -> bool:
        swapped = [n for n in model.graph.node if n.op_type == "RemovePadding" and n.domain == "bertserve"]
        for node in swapped:
            node.domain = "com.microsoft"
        return bool(swapped)

    return _variant(path, "ort_remove_padding", rewrite)


def with_three_products(path: Path) -> Path | None:
    """The kernels graph at `path` with each layer's one Q|K|V product and PackedQKVAttention put back to
    three products and PackedAttention (one product against three in one run); None when the graph has none."""
    from onnx import helper, numpy_helper

    def rewrite(model) -> bool:
        producer = {out: node for node in model.graph.node for out in node.output}
        initializers = {t.name: t for t in model.graph.initializer}
        attentions = [n for n in model.graph.node if n.op_type == "PackedQKVAttention" and n.domain == "bertserve"]
        products = {id(producer[n.input[0]]) for n in attentions}
        nodes = []
        for node in model.graph.node:
            if id(node) in products:
                continue
            if node in attentions:
                x, weight, bias = producer[node.input[0]].input
                weights = np.split(numpy_helper.to_array(initializers[weight]), 3, axis=1)
                biases = np.split(numpy_helper.to_array(initializers[bias]), 3)
                names = [f"{node.input[0]}_{part}" for part in "qkv"]
                for name, w, b in zip(names, weights, biases):
                    model.graph.initializer.extend([numpy_helper.from_array(w, f"{name}_w"),
                                                    numpy_helper.from_array(b, f"{name}_b")])
                    nodes.append(helper.make_node("MatMulBias", [x, f"{name}_w", f"{name}_b"], [name],
                                                  domain="bertserve"))
                attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
                node = helper.make_node("PackedAttention", [*names, *node.input[1:3]], list(node.output),
                                        name=node.name, domain="bertserve", **attrs)
            nodes.append(node)
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        read = {name for node in nodes for name in node.input}
        kept = [t for t in model.graph.initializer if t.name in read]
        del model.graph.initializer[:]
        model.graph.initializer.extend(kept)
        return bool(attentions)

    return _variant(path, "three_products", rewrite)


def with_ort_attention(path: Path) -> Path | None:
    """The kernels graph at `path` with each bertserve.PackedAttention put back to ORT's
    PackedMultiHeadAttention (our attention kernel against ORT's in one run); None when the graph has none
    (a library built without nvcc, or Q, K and V from one product: take with_three_products' graph)."""
    from onnx import helper

    def rewrite(model) -> bool:
        swapped = [n for n in model.graph.node if n.op_type == "PackedAttention" and n.domain == "bertserve"]
        for node in swapped:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            node.CopyFrom(helper.make_node("PackedMultiHeadAttention", [*node.input[:3], "", *node.input[3:5]],
                                           list(node.output), name=node.name, domain="com.microsoft",
                                           num_heads=attrs["num_heads"], scale=attrs["scale"]))
        return bool(swapped)

    return _variant(path, "ort_attention", rewrite)


def without_mean(path: Path) -> Path | None:
    """The graph at `path` without its mean_embedding output and the nodes that compute it (what the mean in
    the graph costs every batch: ONNX Runtime runs every node whatever outputs are asked for); None when the
    graph has none."""
    from export.mean_output import is_mean_node

    def rewrite(model) -> bool:
        kept = [n for n in model.graph.node if not is_mean_node(n)]
        if len(kept) == len(model.graph.node):
            return False
        del model.graph.node[:]
        model.graph.node.extend(kept)
        outputs = [o for o in model.graph.output if o.name != MEAN_EMBEDDING]
        del model.graph.output[:]
        model.graph.output.extend(outputs)
        return True

    return _variant(path, "no_mean", rewrite)


def kernels_variants(path: Path) -> dict[str, Path]:
    """The kernels graph's A/B variants that apply to it, by name, each written beside it: export's rewrites
    undone one at a time (ORT's attention on the three products' graph, since it takes Q, K and V apart)."""
    variants = {}
    if (three := with_three_products(path)) is not None:
        variants["three-products"] = three
    if (ort_attention := with_ort_attention(three or path)) is not None:
        variants["ort-attention"] = ort_attention
    if (ort_remove_padding := with_ort_remove_padding(path)) is not None:
        variants["ort-remove-padding"] = ort_remove_padding
    if (no_mean := without_mean(path)) is not None:
        variants["no-mean"] = no_mean
    return variants


def _measure(args, work: Path, texts: list[str], batches: list[int], text_sizes: list[int], card: str) -> int:
    cuda = args.device == "cuda"
    tokenizer, model, artifacts = build(args.preset, args.device, work, texts, args.packed_attention)

    def graph_file(kind: str, precision: str) -> Path:
        return work / kind / artifacts[kind].graph(precision).file

    def kernels_file(kind: str) -> Path | None:
        """The fp16 graph on custom_kernels' fused operator, when export made one (library built)."""
        variant = artifacts[kind].graph("fp16").custom_kernels
        return work / kind / variant.file if variant else None

    library = kernels_library("auto", args.device)
    chosen = set(args.variants.split(","))

    def wanted(variant: str) -> bool:
        return "all" in chosen or variant in chosen

    if cuda:
        engines = {"torch fp16 sdpa": lambda: TorchEngine(model, "cuda", torch.float16)}
        packed = [kind for kind in PACKED_KINDS.values() if kind in artifacts]
        # export's host-packed graphs of the first packed kernels graph (the served one), built once
        served = next((kind for kind in packed if kernels_file(kind)), None)
        host_packed = host_packed_variants(kernels_file(served)) if served and wanted("host-packed") else {}
        for kind in packed:
            engines[f"ort fp16 {kind}"] = lambda kind=kind: DeviceBoundSession(graph_file(kind, "fp16"), "cuda")
        engines["ort fp16 padded"] = lambda: DeviceBoundSession(graph_file("padded", "fp16"), "cuda")
        for kind in (*packed, "padded"):
            if kind in artifacts and kernels_file(kind):
                engines[f"ort fp16 {kind}+kernels"] = (
                    lambda kind=kind: DeviceBoundSession(kernels_file(kind), "cuda", kernels_library=library))
                for variant, path in kernels_variants(kernels_file(kind)).items():
                    if not wanted(variant):
                        continue
                    engines[f"ort fp16 {kind}+kernels {variant}"] = (
                        lambda path=path: DeviceBoundSession(path, "cuda", kernels_library=library))
                if kind == served:
                    for variant, path in host_packed.items():
                        engines[f"ort fp16 {variant}"] = (
                            lambda path=path: HostPackedSession(path, kernels_library=library))
                if args.untuned:
                    engines[f"ort fp16 {kind}+kernels untuned"] = (
                        lambda kind=kind: untuned(lambda: DeviceBoundSession(kernels_file(kind), "cuda",
                                                                             kernels_library=library)))
        baseline = "torch fp16 sdpa"
    else:
        engines = {
            "torch fp32": lambda: TorchEngine(model, "cpu", torch.float32),
            "ort fp32": lambda: DeviceBoundSession(graph_file("cpu", "fp32"), "cpu", args.threads),
            "ort int8": lambda: DeviceBoundSession(graph_file("cpu", "int8"), "cpu", args.threads),
        }
        baseline, host_packed = "torch fp32", {}
    built = {name: make() for name, make in engines.items()}

    rng = np.random.default_rng(0)
    rows = []  # (workload, batch, engine, ms per batch, seq/s, real tokens/s)

    def record(workload, batch, name, seconds_per_pass, feeds):
        n_seq = sum(f["input_ids"].shape[0] for f in feeds)
        n_tok = sum(int(f["attention_mask"].sum()) for f in feeds)
        rows.append({"workload": workload, "batch": batch, "engine": name,
                     "ms_per_batch": 1e3 * seconds_per_pass / len(feeds),
                     "seq_per_s": n_seq / seconds_per_pass, "tokens_per_s": n_tok / seconds_per_pass})
        print(f"{workload:>10} b={batch:<4} {name:<36} {rows[-1]['ms_per_batch']:9.3f} ms  "
              f"{rows[-1]['seq_per_s']:10,.0f} seq/s", flush=True)

    def in_turn(feeds, iters) -> dict[str, float]:
        """Each engine's median seconds a pass over `feeds`, over args.rounds rounds of every engine in turn."""
        passes = {name: [] for name in built}
        for _ in range(args.rounds):
            for name, engine in built.items():
                passes[name].append(timed(engine, feeds, iters))
        return {name: float(np.median(seconds)) for name, seconds in passes.items()}

    for b in batches:
        feeds = [fixed_batch(b, args.seq, rng)]
        for name, seconds in in_turn(feeds, args.iters).items():
            record(f"fixed{args.seq}", b, name, seconds, feeds)
        graphs = {"ort fp16 padded+cudagraph": (graph_file("padded", "fp16"), None)} if cuda else {}
        if cuda and kernels_file("padded"):
            graphs["ort fp16 padded+kernels+cudagraph"] = (kernels_file("padded"), library)
        for variant, path in host_packed.items():
            graphs[f"ort fp16 {variant}+cudagraph"] = (path, library)
        for name, (path, kernels) in graphs.items() if not args.no_cuda_graph else ():
            try:
                engine = (HostPackedSession(path, kernels, cuda_graph=True) if "host-packed" in name else
                          DeviceBoundSession(path, "cuda", cuda_graph=True, kernels_library=kernels))
                record(f"fixed{args.seq}", b, name, timed(engine, feeds, args.iters), feeds)
                del engine
            except Exception as e:  # report, do not hide: the table says why the row is missing
                print(f"{name} b={b}: failed: {' '.join(str(e).split())[:200]}", flush=True)

    for b in text_sizes:
        feeds = text_batches(tokenizer, texts, b, count=max(4, 256 // b))
        real = sum(int(f["attention_mask"].sum()) for f in feeds) / sum(f["attention_mask"].size for f in feeds)
        print(f"docstrings b={b}: {len(feeds)} batches, {100 * (1 - real):.0f}% padding", flush=True)
        for name, seconds in in_turn(feeds, max(2, args.iters // 4)).items():
            record("docstrings", b, name, seconds, feeds)

    print(f"\n{args.preset} ({model.config.num_hidden_layers}L/{model.config.hidden_size}H), {args.device} on {card}")
    print(f"{'workload':>10} {'batch':>5} {'engine':<36} {'ms/batch':>9} {'seq/s':>10} {'tokens/s':>11} {'vs ' + baseline:>16}")
    base = {(r["workload"], r["batch"]): r["seq_per_s"] for r in rows if r["engine"] == baseline}
    for r in rows:
        r["speedup_vs_baseline"] = r["seq_per_s"] / base[(r["workload"], r["batch"])]
        print(f"{r['workload']:>10} {r['batch']:>5} {r['engine']:<36} {r['ms_per_batch']:9.3f} "
              f"{r['seq_per_s']:10,.0f} {r['tokens_per_s']:11,.0f} {r['speedup_vs_baseline']:15.2f}x")
    graphs = {f"{kind}/{p}": g for kind, m in artifacts.items() for p, g in m.graphs.items()}
    result = {"device": args.device, "card": card, "preset": args.preset, "seq": args.seq, "baseline": baseline,
              "versions": next(iter(artifacts.values())).versions,
              "fused_operators": {k: g.fused_operators for k, g in graphs.items()},
              "parity": {k: g.parity for k, g in graphs.items()},
              "custom_kernels_parity": {k: g.custom_kernels.parity for k, g in graphs.items() if g.custom_kernels},
              "rows": rows}
    out = args.json or (os.path.join(os.environ["OUT"], "engine_throughput.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
