"""The one BERT definition against `transformers`: a model folder we write loads there with the same
MLM and NSP logits and loss (fp32, padded batches); and the fixed-shape MLM gather the trainer uses
gives what the boolean-mask path gives; the attention form export traces gives what SDPA gives."""
from __future__ import annotations

import pytest
import torch
import transformers

from training.model import BertForPreTraining, preset_config
from training.model_folder import load_model_folder, save_model_folder
from training.model_inputs import gather_masked


def padded_batch(vocab_size: int, lengths: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows of different real lengths, padded with [PAD] = 0; about 15% of real tokens labelled."""
    g = torch.Generator().manual_seed(seed)
    batch, seq = len(lengths), max(lengths)
    ids = torch.randint(5, vocab_size, (batch, seq), generator=g)
    mask = (torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = ids * mask
    token_types = ((torch.arange(seq)[None, :] >= torch.tensor(lengths)[:, None] // 2) * mask).long()
    labels = torch.where((torch.rand(batch, seq, generator=g) < 0.15) & mask.bool(), ids, torch.full_like(ids, -100))
    labels[:, 1] = ids[:, 1]  # at least one label per row
    return {"input_ids": ids, "token_type_ids": token_types, "attention_mask": mask, "mlm_labels": labels,
            "nsp_labels": torch.randint(0, 2, (batch,), generator=g)}


@pytest.fixture(scope="module")
def trained_like_folder(tmp_path_factory, tiny_tokenizer_dir):
    """A tiny model with non-trivial weights (random, LayerNorms and biases perturbed too), saved."""
    from tokenizers import Tokenizer
    vocab = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json")).get_vocab_size()
    torch.manual_seed(1)
    model = BertForPreTraining(preset_config("tiny", vocab_size=vocab, max_position_embeddings=128))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return save_model_folder(model, tiny_tokenizer_dir, tmp_path_factory.mktemp("models") / "perturbed")


@pytest.mark.parametrize("attn, lengths", [("eager", [37, 12, 64, 5, 50]), ("sdpa", [20, 64, 33])])
def test_transformers_gives_the_same_logits(trained_like_folder, attn, lengths):
    ours = load_model_folder(trained_like_folder).model.eval()
    theirs = transformers.BertForPreTraining.from_pretrained(trained_like_folder, attn_implementation=attn).eval()
    b = padded_batch(ours.config.vocab_size, lengths=lengths)
    real = b["attention_mask"].bool()
    with torch.no_grad():
        full = ours(b["input_ids"], b["token_type_ids"], b["attention_mask"])
        hf = theirs(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"], attention_mask=b["attention_mask"])
    # Padded positions are never read by anyone; compare every real one.
    assert (full.mlm_logits[real] - hf.prediction_logits[real]).abs().max() <= 1e-4
    assert (full.nsp_logits - hf.seq_relationship_logits).abs().max() <= 1e-4


def test_transformers_gives_the_same_loss(trained_like_folder):
    ours = load_model_folder(trained_like_folder).model.eval()
    theirs = transformers.BertForPreTraining.from_pretrained(trained_like_folder, attn_implementation="eager").eval()
    b = padded_batch(ours.config.vocab_size, lengths=[37, 12, 64, 5, 50])
    with torch.no_grad():
        full = ours(b["input_ids"], b["token_type_ids"], b["attention_mask"])
        with_labels = ours(**b)
        hf_loss = theirs(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"],
                         attention_mask=b["attention_mask"], labels=b["mlm_labels"],
                         next_sentence_label=b["nsp_labels"]).loss
    assert with_labels.loss.item() == pytest.approx(hf_loss.item(), abs=1e-4)
    assert torch.allclose(with_labels.mlm_logits, full.mlm_logits[b["mlm_labels"] != -100], atol=1e-5)


def test_fixed_shape_gather_matches_boolean_masking():
    torch.manual_seed(0)
    model = BertForPreTraining(preset_config("tiny", vocab_size=300)).eval()
    b = padded_batch(300, lengths=[30, 8, 17, 30], seed=3)
    positions, labels = gather_masked(b["mlm_labels"], max_predictions=12)
    with torch.no_grad():
        boolean = model(**b)
        fixed = model(b["input_ids"], b["token_type_ids"], b["attention_mask"], labels, b["nsp_labels"],
                      masked_positions=positions)
    assert fixed.mlm_logits.shape == (4 * 12, 300)
    assert fixed.loss.item() == pytest.approx(boolean.loss.item(), abs=1e-6)
    assert torch.allclose(fixed.mlm_logits[labels.flatten() != -100], boolean.mlm_logits, atol=1e-6)

    # Gradients agree as well (the trainer trains through the gather).
    model.train(False)
    grads = []
    for kwargs in ({**b}, {**b, "mlm_labels": labels, "masked_positions": positions}):
        model.zero_grad()
        model(**kwargs).loss.backward()
        grads.append(model.bert.embeddings.word_embeddings.weight.grad.clone())
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_matmul_softmax_attention_is_the_same_attention_and_only_inside_its_block():
    """Export traces attention written out (the form ONNX Runtime fuses); it must compute what SDPA does,
    and the model must be back on SDPA after the block."""
    torch.manual_seed(0)
    model = BertForPreTraining(preset_config("tiny", vocab_size=300)).eval()
    b = padded_batch(300, lengths=[30, 8, 17])
    with torch.no_grad():
        sdpa = model.bert(b["input_ids"], b["token_type_ids"], b["attention_mask"])
        with model.bert.matmul_softmax_attention():
            assert all(layer.attention.self.matmul_softmax for layer in model.bert.encoder.layer)
            written_out = model.bert(b["input_ids"], b["token_type_ids"], b["attention_mask"])
    assert not any(layer.attention.self.matmul_softmax for layer in model.bert.encoder.layer)
    for ours, theirs in zip(written_out, sdpa):
        assert torch.allclose(ours, theirs, atol=1e-5)
