"""custom_kernels: the graph rewrite, the hand-declared ONNX Runtime ABI of our operator library, and how
export and the server choose the custom-kernels graph. The library runs here through its host-reference
build: the same registration, shape checks and errors, with a plain-loop kernel on the CPU provider.
The CUDA kernel itself is tested on the GPU (tests/test_export_gpu.py)."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from tokenizers import Tokenizer

import custom_kernels
from artifact.manifest import CustomKernelsGraph, ManifestError, read_manifest
from artifact.session import SessionError, kernels_library, open_graph
from custom_kernels.fusion import (MATMUL_BIAS, MATMUL_BIAS_GELU, PACKED_ATTENTION, PACKED_QKV_ATTENTION,
                                   REMOVE_PADDING, attention_on_packed_kernel, fuse_attention_bias,
                                   fuse_matmul_bias_gelu, fuse_qkv_products, offers_packed_attention,
                                   offers_remove_padding, packed_attention_head_sizes, packed_attention_model,
                                   remove_padding_model, remove_padding_on_our_kernel)
from export import ExportError
from export.pipeline import export_artifact
from tests.attention_reference import softmax_attention
from tests.feeds import padded_feed
from tests.padding_reference import ort_token_offset

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hostref_library(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kernels")
    subprocess.run(["bash", str(ROOT / "custom_kernels" / "build.sh"), "--host-reference", str(out)],
                   check=True, capture_output=True, text=True)
    return out / "libbertserve_ops_hostref.so"


def _session(path_or_bytes, library: Path | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    if library is not None:
        options.register_custom_ops_library(str(library))
    source = path_or_bytes if isinstance(path_or_bytes, bytes) else str(path_or_bytes)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def _padded_feed(artifact: Path) -> dict[str, np.ndarray]:
    tok = Tokenizer.from_file(str(artifact / "tokenizer.json"))
    return padded_feed([tok.encode("The quick brown fox."), tok.encode("Dynamic batching packs queued requests", "a pair")])


def test_fusion_replaces_every_feed_forward_pair(tiny_artifact_dir):
    model = onnx.load(str(tiny_artifact_dir / "model.onnx"))
    before = Counter(n.op_type for n in model.graph.node)
    layers = read_manifest(tiny_artifact_dir).num_layers
    assert before["BiasGelu"] == layers
    assert fuse_matmul_bias_gelu(model) == layers
    after = Counter(n.op_type for n in model.graph.node)
    assert after["BiasGelu"] == 0 and after[MATMUL_BIAS_GELU] == layers
    assert after["MatMul"] == before["MatMul"] - layers
    assert custom_kernels.DOMAIN in {o.domain for o in model.opset_import}
    produced = {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer}
    for node in model.graph.node:  # still in topological order
        assert all(not name or name in produced for name in node.input), node.name
        produced.update(node.output)


def test_fused_graph_gives_the_plain_graphs_outputs(tiny_artifact_dir, hostref_library):
    model = onnx.load(str(tiny_artifact_dir / "model.onnx"))
    fuse_matmul_bias_gelu(model)
    feed = _padded_feed(tiny_artifact_dir)
    plain = _session(tiny_artifact_dir / "model.onnx")
    fused = _session(model.SerializeToString(), hostref_library)
    names = [o.name for o in plain.get_outputs()]
    for name, want, got in zip(names, plain.run(names, feed), fused.run(names, feed)):
        np.testing.assert_allclose(got, want, atol=2e-5, err_msg=name)


def _one_node_graph() -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", 4])
    w = helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 3])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, ["n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    node = helper.make_node(MATMUL_BIAS_GELU, ["x", "w", "b"], ["y"], domain=custom_kernels.DOMAIN)
    graph = helper.make_graph([node], "one", [x, w, b], [y])
    # IR 8 (opset 17's): a newer onnx package writes an IR version that ONNX Runtime may not read yet
    model = helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17),
                                                                  helper.make_opsetid(custom_kernels.DOMAIN, 1)])
    return model.SerializeToString()


def test_operator_errors_reach_the_caller_and_the_session_keeps_working(hostref_library):
    session = _session(_one_node_graph(), hostref_library)
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((5, 4), dtype=np.float32), rng.standard_normal((4, 3), dtype=np.float32)
    with pytest.raises(Exception, match="do not fit"):
        session.run(None, {"x": x, "w": w, "b": np.zeros(2, np.float32)})
    b = rng.standard_normal(3, dtype=np.float32)
    (y,) = session.run(None, {"x": x, "w": w, "b": b})
    z = (x @ w + b).astype(np.float64)
    gelu = 0.5 * z * (1 + np.vectorize(math.erf)(z / np.sqrt(2)))
    np.testing.assert_allclose(y, gelu, atol=1e-5)


def test_fusion_leaves_a_product_that_is_read_elsewhere():
    w = numpy_helper.from_array(np.ones((4, 3), np.float32), "w")
    b = numpy_helper.from_array(np.ones(3, np.float32), "b")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]),
             helper.make_node("BiasGelu", ["mm", "b"], ["y"], domain="com.microsoft"),
             helper.make_node("Identity", ["mm"], ["also"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "also")],
                              [w, b])
    model = helper.make_model(graph)
    assert fuse_matmul_bias_gelu(model) == 0
    assert [n.op_type for n in model.graph.node] == ["MatMul", "BiasGelu", "Identity"]


def _multi_head_attention_graph(model_dir: Path, tmp_path: Path) -> onnx.ModelProto:
    """The model fused by ORT with MultiHeadAttention (Q, K, V MatMuls outside it, their bias inside), fp32:
    the unpacked form of the packed graph on PackedMultiHeadAttention, which has a CPU kernel."""
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    from export.onnx_graph import EmbeddingGraph, trace_to_onnx
    from training.model_folder import load_model_folder

    loaded = load_model_folder(model_dir)
    trace_to_onnx(EmbeddingGraph(loaded.model, True, True).eval(), tmp_path / "traced.onnx")
    options = FusionOptions("bert")
    options.use_multi_head_attention = True
    fused = optimizer.optimize_model(str(tmp_path / "traced.onnx"), model_type="bert", opt_level=1,
                                     num_heads=loaded.config.num_attention_heads,
                                     hidden_size=loaded.config.hidden_size, optimization_options=options)
    assert fused.get_fused_operator_statistics()["MultiHeadAttention"] == loaded.config.num_hidden_layers
    return fused.model


def test_attention_bias_moves_into_the_q_k_v_products(tiny_model_dir, tmp_path, hostref_library):
    model = _multi_head_attention_graph(tiny_model_dir, tmp_path)
    plain = _session(model.SerializeToString())
    layers = sum(n.op_type == "MultiHeadAttention" for n in model.graph.node)
    assert fuse_attention_bias(model) == 3 * layers
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops[MATMUL_BIAS] == 3 * layers
    for node in model.graph.node:
        if node.op_type == "MultiHeadAttention":
            assert node.input[3] == ""  # no bias left for the attention to add into a copy
    initializers = {t.name for t in model.graph.initializer}
    assert all(name in initializers for n in model.graph.node if n.op_type == MATMUL_BIAS for name in n.input[1:])
    assert not any(name.endswith("qkv_bias") for name in initializers)  # the [3·hidden] bias is gone
    fused = _session(model.SerializeToString(), hostref_library)
    feed = _padded_feed(tiny_model_dir)
    names = [o.name for o in plain.get_outputs()]
    for name, want, got in zip(names, plain.run(names, feed), fused.run(names, feed)):
        np.testing.assert_allclose(got, want, atol=2e-5, err_msg=name)


def test_attention_bias_stays_when_a_product_is_read_elsewhere(tiny_model_dir, tmp_path):
    model = _multi_head_attention_graph(tiny_model_dir, tmp_path)
    first = next(n for n in model.graph.node if n.op_type == "MultiHeadAttention")
    name, key = first.name, first.input[1]
    model.graph.node.append(helper.make_node("Identity", [key], ["key_too"]))
    model.graph.output.append(helper.make_tensor_value_info("key_too", TensorProto.FLOAT, None))
    layers = sum(n.op_type == "MultiHeadAttention" for n in model.graph.node)
    assert fuse_attention_bias(model) == 3 * (layers - 1)
    assert next(n for n in model.graph.node if n.name == name).input[3]  # that layer keeps its bias
    assert next(n for n in model.graph.node if key in n.output).op_type == "MatMul"


def test_the_kernels_choice_is_read_in_one_place(tmp_path, monkeypatch):
    """artifact.session.kernels_library, for export, server and benchmarks alike."""
    library = tmp_path / custom_kernels.LIBRARY_FILE
    library.write_bytes(b"")
    monkeypatch.setenv(custom_kernels.LIBRARY_ENV, str(library))
    assert kernels_library("auto", "cuda") == kernels_library("on", "cuda") == library
    assert kernels_library("off", "cuda") is None and kernels_library("auto", "cpu") is None
    with pytest.raises(SessionError, match="CUDA only"):
        kernels_library("on", "cpu")
    with pytest.raises(SessionError, match="must be one of"):
        kernels_library("maybe", "cuda")
    monkeypatch.setenv(custom_kernels.LIBRARY_ENV, str(tmp_path / "missing.so"))
    with pytest.raises(SessionError, match="does not exist"):
        kernels_library("auto", "cuda")
    monkeypatch.delenv(custom_kernels.LIBRARY_ENV)
    monkeypatch.setattr(custom_kernels, "_BUILT_HERE", tmp_path / "not-built.so")
    assert kernels_library("auto", "cuda") is None
    with pytest.raises(SessionError, match="was not found"):
        kernels_library("on", "cuda")


def test_export_refuses_an_unknown_kernels_choice(tiny_model_dir, tmp_path):
    with pytest.raises(ExportError, match="custom kernels must be one of"):
        export_artifact(tiny_model_dir, tmp_path / "art", kernels="maybe")
    assert not (tmp_path / "art").exists()


def test_manifest_naming_a_missing_kernels_graph_is_refused(tiny_artifact_dir, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact_dir, art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["graphs"]["fp32"]["custom_kernels"] = {"file": "model_kernels.onnx", "operators": {}, "parity": {}}
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="lacks model_kernels.onnx"):
        read_manifest(art)


def test_manifest_graph_variants_are_types_that_survive_the_json(tiny_artifact_dir, tmp_path):
    """packed / padded x plain / custom kernels, and the CPU graphs' [CLS]-rows variant, written as export
    writes them and read back as dataclasses; a manifest with a key this version does not know asks for a
    re-export."""
    from artifact.manifest import ClsRowsGraph, HostPackedGraph, Manifest, PaddedGraph

    manifest = read_manifest(tiny_artifact_dir)
    graph = manifest.graph("fp32")
    graph.custom_kernels = CustomKernelsGraph("k.onnx", {MATMUL_BIAS_GELU: 2}, {"batches": 1.0})
    graph.padded = PaddedGraph("p.onnx", {"Attention": 2}, {"batches": 1.0},
                               CustomKernelsGraph("pk.onnx", {MATMUL_BIAS_GELU: 2}, {}))
    graph.host_packed = HostPackedGraph("h.onnx", ["cls_embedding"], {"batches": 1.0},
                                        CustomKernelsGraph("hk.onnx", {MATMUL_BIAS_GELU: 2}, {}))
    back = Manifest.from_dict(json.loads(manifest.to_json())).graph("fp32")
    assert back == graph and isinstance(back.padded.custom_kernels, CustomKernelsGraph)
    assert isinstance(back.host_packed, HostPackedGraph) and isinstance(back.host_packed.custom_kernels,
                                                                        CustomKernelsGraph)
    assert isinstance(back.cls_rows, ClsRowsGraph)  # the tiny model has 2 layers: export wrote it
    assert back.files() == [graph.file, "k.onnx", "p.onnx", "pk.onnx", "h.onnx", "hk.onnx",
                            "model_cls_rows.onnx"] and not back.packed
    assert manifest.graph("int8").custom_kernels is None
    assert manifest.graph("int8").files() == ["model_int8.onnx", "model_int8_cls_rows.onnx"]

    stale = json.loads(manifest.to_json())
    stale["graphs"]["fp32"]["custom_kernels"]["library"] = custom_kernels.LIBRARY_FILE  # written before the types
    with pytest.raises(ManifestError, match="malformed .*library.*re-export"):
        Manifest.from_dict(stale)


def test_a_graph_opens_on_its_kernels_variant_or_falls_back_to_the_plain_one(tiny_artifact_dir, hostref_library,
                                                                             tmp_path):
    """artifact.session.open_graph on the CPU (the host-reference library): the custom-kernels graph with a
    library that loads; the plain graph, with a warning, when the library does not load; an error when
    kernels are required and the library does not load or the artifact has no kernels graph."""
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact_dir, art)
    model = onnx.load(str(art / "model.onnx"))
    fuse_matmul_bias_gelu(model)
    onnx.save(model, str(art / "model_kernels.onnx"))
    manifest = read_manifest(art)
    graph = manifest.graph("fp32")
    graph.custom_kernels = CustomKernelsGraph("model_kernels.onnx", {}, {})
    plain = ort.InferenceSession(str(art / graph.file), providers=["CPUExecutionProvider"])

    path, session = open_graph(art, graph, "cpu", library=hostref_library, kernels_required=True)
    assert path.name == "model_kernels.onnx"
    feed = _padded_feed(art)
    names = [o.name for o in session.get_outputs()]
    for got, want in zip(session.run(names, feed), plain.run(names, feed)):
        np.testing.assert_allclose(got, want, atol=2e-5)

    not_a_library = tmp_path / "libbroken.so"
    not_a_library.write_bytes(b"not an ELF file")
    path, session = open_graph(art, graph, "cpu", library=not_a_library, kernels_required=False)
    assert path.name == graph.file
    with pytest.raises(SessionError, match="could not load model_kernels.onnx"):
        open_graph(art, graph, "cpu", library=not_a_library, kernels_required=True)
    graph.custom_kernels = None
    with pytest.raises(SessionError, match="no custom-kernels graph"):
        open_graph(art, graph, "cpu", library=hostref_library, kernels_required=True)

    from app.engine import EngineError, OrtEngine  # the server says the same, as its own error

    with pytest.raises(EngineError, match="CUDA only"):
        OrtEngine(art, manifest, "cpu", "fp32", kernels="on")


def _packed_attention_node_graph(heads: int, size: int, elem=TensorProto.FLOAT) -> bytes:
    # the width left open, so that the operator's own shape check is what a wrong width meets
    return packed_attention_model(heads, size, elem, width="W").SerializeToString()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_packed_attention_attends_within_each_sequence_only(hostref_library, dtype):
    """The operator's contract (the CUDA kernel is held to the same on the GPU): sequences of different
    lengths packed back to back, each attending over its own rows; token_offset gives only its shape."""
    heads, size, lengths = 2, 8, [3, 1, 6]
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    session = _session(_packed_attention_node_graph(heads, size, elem), hostref_library)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((sum(lengths), heads * size)).astype(dtype) for _ in range(3))
    feed = {"q": q, "k": k, "v": v, "token_offset": np.zeros((3, max(lengths)), np.int32),
            "cu": np.array([0, 3, 4, 10], np.int32)}
    (out,) = session.run(None, feed)
    assert out.dtype == dtype
    np.testing.assert_allclose(out, softmax_attention(q, k, v, lengths, heads), atol=2e-6 if dtype == np.float32 else 2e-3)
    # a row of another sequence changes nothing in this one
    k2 = k.copy()
    k2[4:] += 5
    (again,) = session.run(None, {**feed, "k": k2})
    np.testing.assert_array_equal(again[:4], out[:4])


def test_packed_attention_refuses_shapes_it_cannot_read_and_keeps_working(hostref_library):
    session = _session(_packed_attention_node_graph(2, 4), hostref_library)
    q = np.ones((4, 8), np.float32)
    feed = {"q": q, "k": q, "v": q, "token_offset": np.zeros((2, 3), np.int32), "cu": np.array([0, 1, 4], np.int32)}
    with pytest.raises(Exception, match="do not fit"):
        session.run(None, {**feed, "cu": np.array([0, 4], np.int32)})
    with pytest.raises(Exception, match="do not fit"):
        session.run(None, {**feed, "q": np.ones((4, 6), np.float32)})
    with pytest.raises(Exception, match="runs past"):
        session.run(None, {**feed, "cu": np.array([0, 1, 9], np.int32)})
    (out,) = session.run(None, feed)
    np.testing.assert_allclose(out, q)


def _packed_multi_head_attention_graph(heads: int = 2, size: int = 4, bias: bool = False) -> onnx.ModelProto:
    """Two PackedMultiHeadAttention nodes over Q, K and V products and one cumulative_sequence_length,
    as the packed graph has them (bias already moved into the products unless `bias`)."""
    width = heads * size
    weights = [numpy_helper.from_array(np.ones((width, width), np.float32), f"w{i}") for i in range(3)]
    initializers = weights + ([numpy_helper.from_array(np.zeros(3 * width, np.float32), "qkv_bias")] if bias else [])
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [name]) for i, name in enumerate("qkv")]
    nodes += [helper.make_node("PackedMultiHeadAttention", ["q", "k", "v", "qkv_bias" if bias else "", "token_offset",
                                                            "cu_seqlens"], [out], domain="com.microsoft", num_heads=heads)
              for out in ("a", "b")]
    int32 = TensorProto.INT32
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", width]),
                                           helper.make_tensor_value_info("token_offset", int32, ["B", "S"]),
                                           helper.make_tensor_value_info("cu_seqlens", int32, ["B1"])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["T", width]) for n in "ab"],
                              initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def test_packed_multi_head_attention_moves_onto_our_kernel():
    """Each node becomes bertserve.PackedAttention on the same inputs less the (empty) bias, with the head
    count, the head size and 1/sqrt(head size); the graph around it is unchanged."""
    model = _packed_multi_head_attention_graph(heads=2, size=4)
    assert packed_attention_head_sizes(model) == {4}
    assert attention_on_packed_kernel(model) == 2
    assert [n.op_type for n in model.graph.node] == ["MatMul"] * 3 + [PACKED_ATTENTION] * 2
    first = model.graph.node[3]
    assert first.domain == custom_kernels.DOMAIN and list(first.output) == ["a"]
    assert list(first.input) == ["q", "k", "v", "token_offset", "cu_seqlens"]
    attrs = {a.name: helper.get_attribute_value(a) for a in first.attribute}
    assert attrs["num_heads"] == 2 and attrs["head_size"] == 4 and attrs["scale"] == pytest.approx(0.5)
    assert custom_kernels.DOMAIN in {o.domain for o in model.opset_import}


def test_attention_with_its_bias_stays_on_packed_multi_head_attention():
    model = _packed_multi_head_attention_graph(bias=True)
    assert packed_attention_head_sizes(model) == set()
    assert attention_on_packed_kernel(model) == 0
    assert [n.op_type for n in model.graph.node].count("PackedMultiHeadAttention") == 2


def test_attention_whose_query_no_product_makes_stays_on_packed_multi_head_attention():
    """The head size comes from the query's product; a query from any other node leaves the node alone."""
    model = _packed_multi_head_attention_graph()
    model.graph.node.insert(3, helper.make_node("Identity", ["q"], ["q_copy"]))
    model.graph.node[4].input[0] = "q_copy"
    assert packed_attention_head_sizes(model) == {4}  # the second node still qualifies
    assert attention_on_packed_kernel(model) == 1
    assert [n.op_type for n in model.graph.node] == ["MatMul"] * 3 + ["Identity", "PackedMultiHeadAttention",
                                                                      PACKED_ATTENTION]


def test_the_packed_attention_probe_answers_no_where_it_cannot_run(hostref_library):
    """Export asks before it rewrites. Without CUDA the probe answers False rather than raising, and the
    kernels graph keeps PackedMultiHeadAttention (the GPU test checks the yes)."""
    assert offers_packed_attention(hostref_library, 64) is False


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("lengths,width", [([2, 0, 5, 3], 5), ([1], 1), ([7] * 3, 7), ([0, 0], 4)])
def test_remove_padding_gives_what_ort_gives(hostref_library, dtype, lengths, width):
    """ONNX Runtime's layout (tests/padding_reference.py), which RestorePadding and the attention read:
    the real tokens in order, their offsets and then the padding's, the cumulative lengths, the longest."""
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    session = _session(remove_padding_model(elem).SerializeToString(), hostref_library)
    x = np.random.default_rng(0).standard_normal((len(lengths), width, 6)).astype(dtype)
    out, offset, cumulative, longest = session.run(None, {"input": x, "sequence_token_count": np.array(lengths, np.int32)})
    want_offset, want_cumulative = ort_token_offset(lengths, width)
    assert offset.shape == (len(lengths), width) and offset.ravel().tolist() == want_offset
    assert cumulative.tolist() == want_cumulative and longest.tolist() == [max(lengths)]
    assert out.dtype == dtype
    np.testing.assert_array_equal(out, x.reshape(-1, 6)[want_offset[:sum(lengths)]])


def test_remove_padding_refuses_shapes_it_cannot_read_and_keeps_working(hostref_library):
    session = _session(remove_padding_model(TensorProto.FLOAT).SerializeToString(), hostref_library)
    x = np.ones((2, 3, 4), np.float32)
    with pytest.raises(Exception, match="do not fit"):
        session.run(None, {"input": x, "sequence_token_count": np.array([1, 2, 3], np.int32)})
    out, *_ = session.run(None, {"input": x, "sequence_token_count": np.array([1, 2], np.int32)})
    assert out.shape == (3, 4)


def test_remove_padding_moves_onto_our_operator_and_nothing_else_changes(tiny_model_dir, tmp_path):
    """The packed graph's RemovePadding (built on the CPU as export builds it for CUDA) becomes ours, with
    the same inputs and outputs, and the host-packed variant is still made from it."""
    from export.host_packing import host_packed
    from export.onnx_graph import EmbeddingGraph, trace_to_onnx
    from export.optimize import optimize_graph
    from training.model_folder import load_model_folder

    loaded = load_model_folder(tiny_model_dir)
    trace_to_onnx(EmbeddingGraph(loaded.model, True, True).eval(), tmp_path / "traced.onnx")
    optimize_graph(tmp_path / "traced.onnx", tmp_path / "packed.onnx", loaded.config, use_gpu=False, float16=True,
                   remove_padding=True, packed_attention="PackedMultiHeadAttention")
    model = onnx.load(str(tmp_path / "packed.onnx"))
    before = [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node]
    assert remove_padding_on_our_kernel(model) == 1
    assert [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node] == before
    (ours,) = [n for n in model.graph.node if n.op_type == REMOVE_PADDING]
    assert ours.domain == custom_kernels.DOMAIN and custom_kernels.DOMAIN in {o.domain for o in model.opset_import}
    assert remove_padding_on_our_kernel(model) == 0  # nothing of ORT's left
    rewritten = host_packed(model)
    assert not [n for n in rewritten.graph.node if n.op_type in (REMOVE_PADDING, "RestorePadding")]


def test_the_remove_padding_probe_answers_no_where_it_cannot_run(hostref_library):
    assert offers_remove_padding(hostref_library) is False


def _attention_layers(heads: int = 2, size: int = 4, layers: int = 2, seed: int = 0) -> onnx.ModelProto:
    """`layers` PackedMultiHeadAttention layers, each over its own Q, K and V MatMuls of the layer before's
    output, with a random bias: what export's packed graph has, before our rewrites."""
    rng = np.random.default_rng(seed)
    width, initializers, nodes, x = heads * size, [], [], "x"
    for layer in range(layers):
        for part in "qkv":
            weight = rng.standard_normal((width, width)).astype(np.float32)
            initializers.append(numpy_helper.from_array(weight, f"w{layer}{part}"))
            nodes.append(helper.make_node("MatMul", [x, f"w{layer}{part}"], [f"{part}{layer}"]))
        initializers.append(numpy_helper.from_array(rng.standard_normal(3 * width).astype(np.float32), f"b{layer}"))
        nodes.append(helper.make_node("PackedMultiHeadAttention", [f"q{layer}", f"k{layer}", f"v{layer}", f"b{layer}",
                                                                   "token_offset", "cu_seqlens"],
                                      [f"a{layer}"], domain="com.microsoft", num_heads=heads))
        x = f"a{layer}"
    int32 = TensorProto.INT32
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", width]),
                                           helper.make_tensor_value_info("token_offset", int32, ["B", "S"]),
                                           helper.make_tensor_value_info("cu_seqlens", int32, ["B1"])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["T", width])], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def test_the_three_products_become_one_that_the_attention_reads_in_place(hostref_library):
    """Each layer's Q, K and V products become one MatMulBias over the weights and biases side by side, and
    the attention PackedQKVAttention over its thirds: the same outputs, the old weights gone."""
    model = _attention_layers()
    assert fuse_attention_bias(model) == 6 and attention_on_packed_kernel(model) == 2
    three = model.SerializeToString()
    assert fuse_qkv_products(model) == 2
    assert [n.op_type for n in model.graph.node] == [MATMUL_BIAS, PACKED_QKV_ATTENTION] * 2
    assert sorted(t.name for t in model.graph.initializer) == ["a0_qkv_bias", "a0_qkv_weight", "a1_qkv_bias",
                                                               "a1_qkv_weight"]
    assert [list(t.dims) for t in model.graph.initializer if t.name == "a0_qkv_weight"] == [[8, 24]]
    attrs = {a.name: helper.get_attribute_value(a) for a in model.graph.node[1].attribute}
    assert attrs["num_heads"] == 2 and attrs["head_size"] == 4
    rng = np.random.default_rng(1)
    lengths = [3, 1, 5]
    feed = {"x": rng.standard_normal((sum(lengths), 8)).astype(np.float32),
            "token_offset": np.zeros((3, 5), np.int32), "cu_seqlens": np.array([0, 3, 4, 9], np.int32)}
    (want,) = _session(three, hostref_library).run(None, feed)
    (got,) = _session(model.SerializeToString(), hostref_library).run(None, feed)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_the_benchmarks_variants_of_the_served_graph_undo_one_rewrite_each(hostref_library, tmp_path):
    """bench/engine_throughput.py's A/B variants: the three products' graph answers what the one product's
    does, and ORT's attention goes in on it (ORT's takes Q, K and V apart); a rewrite with nothing to undo
    gives no variant, never a silent copy."""
    from bench.engine_throughput import kernels_variants

    model = _attention_layers()
    fuse_attention_bias(model)
    attention_on_packed_kernel(model)
    fuse_qkv_products(model)
    served = tmp_path / "served.onnx"
    onnx.save(model, str(served))
    variants = kernels_variants(served)
    assert set(variants) == {"three-products", "ort-attention"}  # no RemovePadding in this graph
    three = onnx.load(str(variants["three-products"]))
    assert [n.op_type for n in three.graph.node] == ([MATMUL_BIAS] * 3 + [PACKED_ATTENTION]) * 2
    ort_attention = onnx.load(str(variants["ort-attention"]))
    assert [(n.op_type, n.domain) for n in ort_attention.graph.node if "Attention" in n.op_type] == \
        [("PackedMultiHeadAttention", "com.microsoft")] * 2
    assert kernels_variants(variants["ort-attention"]) == {}
    rng = np.random.default_rng(2)
    feed = {"x": rng.standard_normal((9, 8)).astype(np.float32), "token_offset": np.zeros((3, 5), np.int32),
            "cu_seqlens": np.array([0, 3, 4, 9], np.int32)}
    (want,) = _session(served, hostref_library).run(None, feed)
    (got,) = _session(variants["three-products"], hostref_library).run(None, feed)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_products_read_elsewhere_stay_three():
    model = _attention_layers(layers=1)
    fuse_attention_bias(model)
    attention_on_packed_kernel(model)
    model.graph.node.append(helper.make_node("Identity", ["k0"], ["k_copy"]))
    model.graph.output.append(helper.make_tensor_value_info("k_copy", TensorProto.FLOAT, None))
    assert fuse_qkv_products(model) == 0
    assert [n.op_type for n in model.graph.node] == [MATMUL_BIAS] * 3 + [PACKED_ATTENTION, "Identity"]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_packed_qkv_attention_reads_the_thirds_of_one_product(hostref_library, dtype):
    """PackedQKVAttention over [Q | K | V] rows answers what PackedAttention answers over Q, K and V apart."""
    heads, size, lengths = 2, 8, [3, 1, 6]
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    width = heads * size
    node = helper.make_node(PACKED_QKV_ATTENTION, ["qkv", "token_offset", "cu"], ["out"], domain=custom_kernels.DOMAIN,
                            num_heads=heads, head_size=size, scale=size ** -0.5)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("qkv", elem, ["T", "W3"]),
                                            helper.make_tensor_value_info("token_offset", TensorProto.INT32, ["B", "S"]),
                                            helper.make_tensor_value_info("cu", TensorProto.INT32, ["B1"])],
                              [helper.make_tensor_value_info("out", elem, ["T", width])])
    model = helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17),
                                                                  helper.make_opsetid(custom_kernels.DOMAIN, 1)])
    session = _session(model.SerializeToString(), hostref_library)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((sum(lengths), width)).astype(dtype) for _ in range(3))
    offsets, cu = np.zeros((3, max(lengths)), np.int32), np.array([0, 3, 4, 10], np.int32)
    (out,) = session.run(None, {"qkv": np.concatenate([q, k, v], axis=1), "token_offset": offsets, "cu": cu})
    np.testing.assert_allclose(out, softmax_attention(q, k, v, lengths, heads),
                               atol=2e-6 if dtype == np.float32 else 2e-3)
    with pytest.raises(Exception, match="do not fit"):
        session.run(None, {"qkv": q, "token_offset": offsets, "cu": cu})  # a third of the width


def _host_packed_kernels_graph(model_dir: Path, tmp_path: Path, mean: bool = False,
                               our_products: bool = True) -> onnx.ModelProto:
    """The model's packed fp16 graph built here as export builds it for CUDA (the outputs, classifier and
    head GELUs export's `_build_graph` traces for the folder), on our operators, made host-packed: what
    export's `_build_host_packed` starts from. Without `our_products` only the attention goes onto ours (it
    has no CPU kernel of ORT's): the last layer is then ORT's MatMul, BiasGelu and SkipLayerNormalization
    (with its bias), as in the host-packed graph export writes without the library."""
    import torch

    from artifact.manifest import POOLED_EMBEDDING
    from export.checkpoint_layout import read_layout
    from export.host_packing import host_packed
    from export.onnx_graph import EmbeddingGraph, trace_to_onnx
    from export.optimize import optimize_graph
    from training.model_folder import load_model_folder

    loaded = load_model_folder(read_layout(model_dir).encoder_dir, sequence_classifier=True)
    graph = EmbeddingGraph(loaded.model, loaded.has_pooler, loaded.has_nsp_head, loaded.classifier).eval()
    head_gelus = int(POOLED_EMBEDDING in graph.outputs and isinstance(loaded.model.bert.pooler.activation, torch.nn.GELU))
    trace_to_onnx(graph, tmp_path / "traced.onnx")
    optimize_graph(tmp_path / "traced.onnx", tmp_path / "packed.onnx", loaded.config, use_gpu=False, float16=True,
                   remove_padding=True, packed_attention="PackedMultiHeadAttention", head_gelus=head_gelus)
    model = onnx.load(str(tmp_path / "packed.onnx"))
    if our_products:
        fuse_matmul_bias_gelu(model)
    fuse_attention_bias(model)
    if our_products:
        remove_padding_on_our_kernel(model)
    attention_on_packed_kernel(model)
    if our_products:
        fuse_qkv_products(model)
    return host_packed(model, mean)


def _cls_rows_answer_the_same(full: onnx.ModelProto, library: Path, vocab: int, longest: int = 64) -> onnx.ModelProto:
    """`full` with its last layer for the [CLS] rows (asserted to be rewritten), after checking that both give
    every output bit for bit on a ragged batch (1 token up to `longest`)."""
    from export.host_packing import HostPackedRunner
    from export.last_layer_rows import last_layer_for_cls_rows

    pruned = onnx.ModelProto()
    pruned.CopyFrom(full)
    assert last_layer_for_cls_rows(pruned)
    assert [o.name for o in pruned.graph.output] == [o.name for o in full.graph.output]
    rng = np.random.default_rng(0)
    lengths = [5, 17, 1, longest, 3, 2]
    ids = np.zeros((len(lengths), max(lengths)), np.int64)
    mask = np.zeros_like(ids)
    for row, n in enumerate(lengths):  # ORT's CPU EmbedLayerNormalization reads only ids below the vocabulary
        ids[row, :n], mask[row, :n] = rng.integers(5, vocab, n), 1
    feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": (rng.random(ids.shape) < 0.5) * mask}
    names = [o.name for o in full.graph.output]
    want = HostPackedRunner(_session(full.SerializeToString(), library), 0).run(names, feed)
    got = HostPackedRunner(_session(pruned.SerializeToString(), library), 0).run(names, feed)
    for name, a, b in zip(names, want, got):
        assert a.shape == b.shape == (len(lengths), *a.shape[1:]) and np.array_equal(a, b), name
    return pruned


def test_the_last_layer_runs_for_the_cls_rows_only_and_answers_the_same(tiny_model_dir, tmp_path, hostref_library):
    """export.last_layer_rows: after the last attention, the products, residual sums and LayerNorms see one
    row per sequence, and every per-sequence output is what the graph gave with all rows, bit for bit."""
    vocab = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).get_vocab_size()
    pruned = _cls_rows_answer_the_same(_host_packed_kernels_graph(tiny_model_dir, tmp_path), hostref_library, vocab)
    ops = [n.op_type for n in pruned.graph.node]
    last = max(i for i, op in enumerate(ops) if op == PACKED_QKV_ATTENTION)
    # the attention's output and the residual gathered at the [CLS] positions, then the layer's row-wise nodes
    assert ops[last + 1:last + 3] == ["Gather", "Gather"]
    assert {n.input[1] for n in pruned.graph.node[last + 1:last + 3]} == {"cls_positions"}
    assert "Gather" not in ops[last + 3:]  # the [CLS] vector is the layer's output itself


def _transformers_folder(root: Path, tokenizer_dir: Path, family: str) -> Path:
    """A tiny random transformers checkpoint of `family`, saved as transformers saves it (tests/hf_checkpoints.py)."""
    import transformers

    from tests.hf_checkpoints import saved_model, vocab_size

    vocab = vocab_size(tokenizer_dir)
    bert = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=64)
    distil = dict(vocab_size=vocab, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64)
    made = {
        "bert-without-pooler": (lambda c: transformers.BertModel(c, add_pooling_layer=False), transformers.BertConfig(**bert)),
        "bert-classifier": (transformers.BertForSequenceClassification,
                            transformers.BertConfig(num_labels=3, initializer_range=0.3, **bert)),
        "distilbert-classifier": (transformers.DistilBertForSequenceClassification,
                                  transformers.DistilBertConfig(num_labels=3, **distil)),
        "electra-cross-encoder": (transformers.ElectraForSequenceClassification,
                                  transformers.ElectraConfig(num_labels=1, embedding_size=32, initializer_range=0.3,
                                                             **bert)),
    }
    model_class, config = made[family]
    return saved_model(root, tokenizer_dir, model_class, config, seed=3)[0]


@pytest.mark.parametrize("family,outputs", [
    ("bert-without-pooler", ["cls_embedding"]),  # the [CLS] Gather the only reader of the last layer
    ("bert-classifier", ["cls_embedding", "pooled_embedding", "classifier_logits"]),
    ("distilbert-classifier", ["cls_embedding", "pooled_embedding", "classifier_logits"]),  # ReLU head, no segments
    ("electra-cross-encoder", ["cls_embedding", "pooled_embedding", "classifier_logits"]),  # GELU head
])
def test_each_family_of_checkpoint_gets_the_cls_rows_last_layer(family, outputs, tiny_tokenizer_dir, tmp_path,
                                                                 hostref_library):
    """transformers' checkpoints as export reads them (the heads after the [CLS] Gather differ by family; the
    layer before it does not): rewritten, with the same per-sequence outputs."""
    folder = _transformers_folder(tmp_path / "hf", tiny_tokenizer_dir, family)
    full = _host_packed_kernels_graph(folder, tmp_path)
    assert [o.name for o in full.graph.output] == outputs
    vocab = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    _cls_rows_answer_the_same(full, hostref_library, vocab)


def test_the_host_packed_graph_without_our_products_gets_the_cls_rows_last_layer(tiny_model_dir, tmp_path,
                                                                                 hostref_library):
    """The last layer as ORT fuses it (MatMul, BiasGelu, SkipLayerNormalization with its bias), which export's
    host-packed graph without the library has: the same rewrite, the same outputs."""
    full = _host_packed_kernels_graph(tiny_model_dir, tmp_path, our_products=False)
    last = max(i for i, n in enumerate(full.graph.node) if n.op_type == PACKED_ATTENTION)
    assert "BiasGelu" in [n.op_type for n in full.graph.node[last:]]
    vocab = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).get_vocab_size()
    _cls_rows_answer_the_same(full, hostref_library, vocab)


def test_a_residual_made_after_the_last_attention_is_gathered_once_it_is_made(tiny_model_dir, tmp_path,
                                                                              hostref_library):
    """The residual's Gather goes after the node that makes it, wherever that node is in the graph."""
    model = _host_packed_kernels_graph(tiny_model_dir, tmp_path)
    nodes = list(model.graph.node)
    last = max(i for i, n in enumerate(nodes) if n.op_type == PACKED_QKV_ATTENTION)
    first_norm = next(n for n in nodes[last:] if n.op_type == "SkipLayerNormalization")
    residual = first_norm.input[1]
    first_norm.input[1] = "residual_made_late"
    model.graph.node.insert(last + 1, helper.make_node("Identity", [residual], ["residual_made_late"]))
    vocab = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).get_vocab_size()
    pruned = _cls_rows_answer_the_same(model, hostref_library, vocab)
    gather = next(n for n in pruned.graph.node if n.input[0] == "residual_made_late")
    order = [n.output[0] for n in pruned.graph.node]
    assert order.index(gather.output[0]) > order.index("residual_made_late")


def test_a_skip_layer_norm_that_also_gives_its_sum_is_rewritten(tiny_model_dir, tmp_path, hostref_library):
    """ORT's SkipLayerNormalization gives its input + skip sum as a fourth output, the two between left unnamed
    (""), when another node reads that sum (a pre-LayerNorm model's residual): the unnamed outputs are
    no tensor anyone reads, and the layer is rewritten all the same."""
    model = _host_packed_kernels_graph(tiny_model_dir, tmp_path)
    nodes = list(model.graph.node)
    last = max(i for i, n in enumerate(nodes) if n.op_type == PACKED_QKV_ATTENTION)
    first_norm, second_norm = [n for n in nodes[last:] if n.op_type == "SkipLayerNormalization"]
    first_norm.output.extend(["", "", "attention_residual_sum"])
    second_norm.input[1] = "attention_residual_sum"  # the sum, not the normalised sum, carried on
    assert any(name == "" for n in nodes[:last] for name in n.input)  # as in every host-packed graph
    vocab = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).get_vocab_size()
    _cls_rows_answer_the_same(model, hostref_library, vocab)


def test_a_cls_vector_read_straight_off_the_last_attention_is_left_alone(hostref_library):
    """With no node between the last attention and the [CLS] Gather there is nothing to run on fewer rows;
    dropping the Gather there would answer every token's row as the [CLS] vectors."""
    from export.last_layer_rows import last_layer_for_cls_rows

    model = packed_attention_model(heads=2, head_size=4, elem=TensorProto.FLOAT)
    model.graph.node.append(helper.make_node("Gather", ["out", "cls_positions"], ["cls"], axis=0))
    model.graph.input.append(helper.make_tensor_value_info("cls_positions", TensorProto.INT32, ["B"]))
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("cls", TensorProto.FLOAT, ["B", 8]))
    before = model.SerializeToString()
    assert not last_layer_for_cls_rows(model) and model.SerializeToString() == before
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((6, 8)).astype(np.float32) for _ in range(3))
    (cls,) = _session(model.SerializeToString(), hostref_library).run(None, {
        "q": q, "k": k, "v": v, "token_offset": np.zeros((2, 5), np.int32), "cu": np.array([0, 1, 6], np.int32),
        "cls_positions": np.array([0, 1], np.int32)})
    assert cls.shape == (2, 8)


def test_a_graph_that_reads_every_row_of_the_last_layer_keeps_it(tiny_model_dir, tmp_path):
    """With the mean pooled in the graph (every token of the last layer), or any other reader of a row the
    rewrite would drop, nothing changes."""
    from export.last_layer_rows import last_layer_for_cls_rows

    with_mean = _host_packed_kernels_graph(tiny_model_dir, tmp_path, mean=True)
    before = with_mean.SerializeToString()
    assert not last_layer_for_cls_rows(with_mean) and with_mean.SerializeToString() == before

    model = _host_packed_kernels_graph(tiny_model_dir, tmp_path)
    inner = next(n for n in reversed(model.graph.node) if n.op_type == "SkipLayerNormalization").input[1]
    model.graph.node.append(helper.make_node("Identity", [inner], ["residual_copy"]))
    model.graph.output.append(helper.make_tensor_value_info("residual_copy", TensorProto.FLOAT16, None))
    before = model.SerializeToString()
    assert not last_layer_for_cls_rows(model) and model.SerializeToString() == before


def test_a_node_that_mixes_rows_after_the_last_attention_keeps_the_layer_whole():
    """Only row-wise nodes may run on the [CLS] rows alone: a Transpose (or anything else) between the last
    attention and the [CLS] Gather leaves the graph as it is."""
    from export.last_layer_rows import last_layer_for_cls_rows

    f16 = TensorProto.FLOAT16
    nodes = [helper.make_node(PACKED_QKV_ATTENTION, ["qkv", "token_offset", "cu"], ["att"], domain=custom_kernels.DOMAIN),
             helper.make_node("Transpose", ["att"], ["mixed"], perm=[1, 0]),
             helper.make_node("Add", ["mixed", "x"], ["out"]),
             helper.make_node("Gather", ["out", "cls_positions"], ["cls"], axis=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, f16, ["T", 8]) for n in ("qkv", "x")]
                              + [helper.make_tensor_value_info(n, TensorProto.INT32, None)
                                 for n in ("token_offset", "cu", "cls_positions")],
                              [helper.make_tensor_value_info("cls", f16, ["B", 8])])
    model = helper.make_model(graph)
    before = model.SerializeToString()
    assert not last_layer_for_cls_rows(model) and model.SerializeToString() == before
    nodes[1].op_type = "Relu"  # a row-wise node in its place: rewritten
    del nodes[1].attribute[:]
    model = helper.make_model(helper.make_graph(nodes, "g", graph.input, graph.output))
    assert last_layer_for_cls_rows(model)
    # the graph's output, the Gather's, is now the last node's output as it is
    assert [n.op_type for n in model.graph.node] == [PACKED_QKV_ATTENTION, "Gather", "Gather", "Relu", "Add",
                                                     "Identity"]
    assert {tuple(n.input) for n in model.graph.node if n.op_type == "Gather"} == {("att", "cls_positions"),
                                                                                    ("x", "cls_positions")}
