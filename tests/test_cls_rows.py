"""CPU graphs whose last layer runs at the [CLS] position only (export.last_layer_rows.padded_for_cls_rows):
export writes them beside the fp32 and int8 graphs, gated on parity, and the engine runs on them the batches
that need no token vectors or mean."""
from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from app.engine import Batch, OrtEngine
from artifact.manifest import (CLS_EMBEDDING, CLS_ROWS_GRAPH_FILES, MEAN_EMBEDDING, POOLED_EMBEDDING,
                               TOKEN_EMBEDDINGS, read_manifest)
from export.parity import limits
from export.pipeline import export_artifact
from tests.feeds import padded_feed

TEXTS = ["a short one", "a much longer sentence with more words in it", "x", "the cat sat on the mat " * 6]


def feed_of(artifact) -> dict[str, np.ndarray]:
    tok = Tokenizer.from_file(str(artifact / "tokenizer.json"))
    tok.enable_truncation(read_manifest(artifact).max_length)
    return padded_feed([tok.encode(t) for t in TEXTS])


def test_export_writes_a_cls_rows_graph_beside_each_cpu_graph_gated_on_parity(tiny_artifact_dir):
    m = read_manifest(tiny_artifact_dir)  # a 2-layer model: auto writes them
    assert m.num_layers == 2 and set(m.graphs) == {"fp32", "int8"}
    for precision, graph in m.graphs.items():
        rows = graph.cls_rows
        assert rows is not None and rows.file == CLS_ROWS_GRAPH_FILES[precision]
        assert (tiny_artifact_dir / rows.file).is_file() and rows.file in m.files_sha256
        assert CLS_EMBEDDING in rows.outputs and POOLED_EMBEDDING in rows.outputs
        assert not {TOKEN_EMBEDDINGS, MEAN_EMBEDDING} & set(rows.outputs)
        assert set(rows.outputs) <= set(graph.outputs)
        checks = limits(precision, rows.parity)
        assert checks and all(rows.parity[name] <= limit if op == "<=" else rows.parity[name] >= limit
                              for name, op, limit in checks)


def test_off_writes_none_and_the_manifest_then_reads_as_before(tiny_model_dir, tmp_path):
    manifest = export_artifact(tiny_model_dir, tmp_path / "art", cls_rows="off")
    assert manifest.graphs["fp32"].cls_rows is None
    graphs = json.loads((tmp_path / "art" / "manifest.json").read_text())["graphs"]
    assert "cls_rows" not in graphs["fp32"]  # as written before the variant existed: older servers read it
    assert not any("cls_rows" in p.name for p in (tmp_path / "art").iterdir())
    engine = OrtEngine(tmp_path / "art", manifest, "cpu", "fp32")
    assert engine.cls_rows_session is None
    with pytest.raises(Exception, match="cls_rows must be auto, on or off"):
        export_artifact(tiny_model_dir, tmp_path / "other", cls_rows="sometimes")


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_the_engine_runs_batches_without_token_vectors_on_the_cls_rows_graph(tiny_artifact_dir, precision):
    """[CLS] and pooled batches run on the variant and answer as the full graph does (fp32 to the bit; int8
    within its own batch-to-batch spread, its activations' scale taken over the rows it quantises); a batch
    that wants token vectors or the mean runs on the full graph; cls_rows=False keeps every batch there."""
    m = read_manifest(tiny_artifact_dir)
    engine = OrtEngine(tiny_artifact_dir, m, "cpu", precision)
    full = OrtEngine(tiny_artifact_dir, m, "cpu", precision, cls_rows=False)
    assert engine.cls_rows_session is not None and full.cls_rows_session is None
    ran = []
    for name, session in (("variant", engine.cls_rows_session), ("full", engine.session)):
        run = session.run
        session.run = lambda names, feeds, *a, _run=run, _name=name: ran.append(_name) or _run(names, feeds, *a)
    feed = feed_of(tiny_artifact_dir)
    inputs = [feed[k] for k in ("input_ids", "attention_mask", "token_type_ids")]

    got = engine.run(Batch(*inputs, (CLS_EMBEDDING, POOLED_EMBEDDING)))
    want = full.run(Batch(*inputs, (CLS_EMBEDDING, POOLED_EMBEDDING)))
    assert ran == ["variant"]
    for name in (CLS_EMBEDDING, POOLED_EMBEDDING):
        if precision == "fp32":
            np.testing.assert_array_equal(got[name], want[name])
        else:
            cos = (got[name] * want[name]).sum(-1) / np.linalg.norm(got[name], axis=-1) / np.linalg.norm(want[name], axis=-1)
            assert cos.min() >= 0.9999
    for outputs in [(TOKEN_EMBEDDINGS,), (MEAN_EMBEDDING, CLS_EMBEDDING)]:
        ran.clear()
        got = engine.run(Batch(*inputs, outputs))
        assert ran == ["full"] and set(got) == set(outputs)


def test_a_variant_that_fails_the_gate_is_left_out_and_the_export_goes_on(tiny_model_dir, tmp_path, monkeypatch,
                                                                           caplog):
    """The variant is an optimisation of a graph that passed: one past the gate (here its [CLS] vector doubled)
    is not written, a warning says why, and the artifact serves every batch on the full graph."""
    import onnx
    from onnx import helper, numpy_helper

    import export.last_layer_rows as rows

    real = rows.padded_for_cls_rows

    def doubled(model):
        variant = real(model)
        graph = variant.graph
        maker = next(n for n in graph.node if CLS_EMBEDDING in n.output)
        maker.output[list(maker.output).index(CLS_EMBEDDING)] = "cls_before_doubling"
        graph.initializer.append(numpy_helper.from_array(np.array(2.0, np.float32), "two"))
        graph.node.append(helper.make_node("Mul", ["cls_before_doubling", "two"], [CLS_EMBEDDING]))
        onnx.checker.check_model(variant)
        return variant

    monkeypatch.setattr(rows, "padded_for_cls_rows", doubled)
    with caplog.at_level("WARNING", logger="export"):
        manifest = export_artifact(tiny_model_dir, tmp_path / "art")
    assert manifest.graphs["fp32"].cls_rows is None
    assert not (tmp_path / "art" / CLS_ROWS_GRAPH_FILES["fp32"]).exists()
    assert "model.onnx: its variant with the last layer at [CLS] only is not written" in caplog.text
    assert "cls_embedding_max_abs" in caplog.text
    assert OrtEngine(tmp_path / "art", read_manifest(tmp_path / "art"), "cpu", "fp32").cls_rows_session is None
