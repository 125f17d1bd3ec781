"""Which ONNX Runtime CUDA settings move fp16 BERT-base throughput at length 128 (padded graph, IO binding).

  python bench/ort_cuda_settings.py build          # random-weight base model + padded fp16 export under /tmp/explore
  python bench/ort_cuda_settings.py NAME [JSON]    # batch 32 and 256 throughput with CUDA provider options JSON
  python bench/ort_cuda_settings.py profile        # plus ORT's per-operator profile (host-side times)
Environment variables (ORT_DISABLE_*_ATTENTION, ORT_CUDA_GEMM_OPTIONS) are read per process: bench/gpu_suite.sh ortsettings
runs each variant in its own process."""
import json, os, subprocess, sys, time, tempfile
from pathlib import Path
import numpy as np

def build(work: Path):
    import torch
    sys.path.insert(0, os.getcwd())
    from training.model import BertForPreTraining, preset_config
    from training.model_folder import save_model_folder
    from training.wordpiece import save_tokenizer, train_wordpiece
    from export.pipeline import export_artifact
    texts = [f"word{i} and more text number {i % 97} here" for i in range(3000)]
    save_tokenizer(train_wordpiece(texts, 2000), work / "tok")
    torch.manual_seed(0)
    m = BertForPreTraining(preset_config("base", vocab_size=30522))
    save_model_folder(m, work / "tok", work / "model")
    export_artifact(work / "model", work / "padded", device="cuda", remove_padding=False)

def measure(path, batches, provider_opts, profile=False):
    import onnxruntime as ort
    ort.preload_dlls()
    so = ort.SessionOptions()
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = "/tmp/ortprof"
    s = ort.InferenceSession(str(path), so, providers=[("CUDAExecutionProvider", provider_opts)])
    res = {}
    for b in batches:
        ids = np.random.randint(1000, 30000, (b, 128)).astype(np.int64)
        feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
        io = s.io_binding(); keep = []
        for k, v in feed.items():
            ov = ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0); keep.append(ov); io.bind_ortvalue_input(k, ov)
        for o in s.get_outputs():
            io.bind_output(o.name, "cuda")
        for _ in range(5): s.run_with_iobinding(io)
        n = 30 if not profile else 5
        t = time.perf_counter()
        for _ in range(n): s.run_with_iobinding(io)
        dt = (time.perf_counter() - t) / n
        res[b] = round(b / dt)
    if profile:
        f = s.end_profiling()
        ev = json.load(open(f))
        agg = {}
        for e in ev:
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
                op = e["args"].get("op_name", "?")
                agg[op] = agg.get(op, 0) + e["dur"]
        tot = sum(agg.values())
        res["profile_top"] = sorted(((k, round(v / tot, 3)) for k, v in agg.items()), key=lambda x: -x[1])[:10]
    return res

if __name__ == "__main__":
    work = Path("/tmp/explore")
    if sys.argv[1] == "build":
        work.mkdir(exist_ok=True); build(work)
    else:
        variant = sys.argv[1]
        opts = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
        prof = variant == "profile"
        r = measure(work / "padded" / "model_fp16.onnx", [32, 256], opts, profile=prof)
        print(variant, json.dumps(opts), os.environ.get("VAR", ""), r, flush=True)
