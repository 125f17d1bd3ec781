"""Training without padding (training.packed): the packed layout, and a packed forward and backward that
give what the padded model gives. On CPU the packed attention pads again internally; on a CUDA device
(tests marked torch_cuda) it is FlashAttention's variable-length kernel, checked against padded SDPA."""
from __future__ import annotations

import pytest
import torch

from tests.test_model import padded_batch
from training.batch_stream import StreamBatch
from training.model import BertForPreTraining, preset_config
from training.packed import QueryRows, filler_lengths, pack, varlen_attention
from training.model_inputs import model_inputs


def without_dropout(model: BertForPreTraining) -> BertForPreTraining:
    """Training mode (the fused QKV path) with every dropout at 0, so padded and packed runs are comparable."""
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    for layer in model.bert.encoder.layer:
        layer.attention.self.dropout_p = 0.0
    return model


def test_pack_lays_rows_end_to_end():
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    token_index, packed = pack(mask)
    assert token_index.tolist() == [0, 1, 2, 5, 10, 11, 12, 13]
    assert packed.cu_seqlens.tolist() == [0, 3, 4, 8] and packed.cu_seqlens.dtype == torch.int32
    assert packed.position_ids.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert packed.max_len == 5  # the padded width: a bound that stays the same from batch to batch
    assert packed.first_tokens.tolist() == [0, 3, 4]


def test_query_rows_for_heads_are_cls_then_masked_rows_sequence_by_sequence():
    _, packed = pack(torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]))
    masked = torch.tensor([[1, 2], [3, 3], [5, 7]])  # packed rows; sequence 1 has nothing masked: its [CLS]
    rows = QueryRows.for_heads(packed, masked)
    assert rows.index.tolist() == [0, 1, 2, 3, 3, 3, 4, 5, 7] and rows.per_sequence == 3
    assert rows.cu_seqlens.tolist() == [0, 3, 6, 9] and rows.cu_seqlens.dtype == torch.int32


def test_encoder_output_rows_are_those_rows_of_the_full_output():
    """The last layer on some rows only (repeated ones included) gives exactly those rows of the full run."""
    torch.manual_seed(0)
    model = BertForPreTraining(preset_config("mini", vocab_size=300)).eval()
    lengths = [37, 5, 64, 20]
    _, packed = pack((torch.arange(64)[None, :] < torch.tensor(lengths)[:, None]).long())
    hidden = torch.randn(sum(lengths), 256)
    starts = packed.first_tokens
    masked = torch.stack([starts + 3, starts + 1, starts + 4, starts])  # sequence 1 (5 tokens) in bounds
    rows = QueryRows.for_heads(packed, masked.T)
    encoder = model.bert.encoder
    full = encoder.forward_packed(hidden, packed)
    subset = encoder.forward_packed(hidden, packed, rows)
    assert subset.shape == (4 * 5, 256)
    assert torch.allclose(subset, full[rows.index], atol=1e-5)


def test_filler_sequences_take_the_tokens_to_the_multiple_in_a_fixed_number_of_sequences():
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    token_index, packed = pack(mask, token_multiple=16)
    assert token_index.tolist() == [0, 1, 2, 5, 10, 11, 12, 13]  # the real tokens, as without fillers
    # 4 fillers of 1-5 tokens can take any count to a multiple of 16; here 8 tokens are missing
    assert packed.cu_seqlens.tolist() == [0, 3, 4, 8, 10, 12, 14, 16] and packed.sequences == 3
    assert packed.fillers == 4 and packed.position_ids.tolist() == [0, 1, 2, 0, 0, 1, 2, 3] + [0, 1] * 4
    assert packed.first_tokens.tolist() == [0, 3, 4]
    for tokens in range(1, 400):
        for multiple, width in ((16, 5), (256, 128), (128, 128), (256, 32), (7, 2)):
            lengths = filler_lengths(tokens, multiple, width)
            assert (tokens + int(lengths.sum())) % multiple == 0, (tokens, multiple, width)
            assert int(lengths.min()) >= 1 and int(lengths.max()) <= width, (tokens, multiple, width, lengths)
            assert len(lengths) == len(filler_lengths(1, multiple, width))  # one count for every batch


def test_query_rows_give_fillers_no_query_rows():
    _, packed = pack(torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]]), token_multiple=8)
    rows = QueryRows.for_heads(packed, torch.tensor([[1, 2], [3, 3]]))
    assert rows.index.tolist() == [0, 1, 2, 3, 3, 3] and rows.sequences == 2
    assert rows.cu_seqlens.tolist() == [0, 3, 6] + [6] * packed.fillers
    assert len(rows.cu_seqlens) == len(packed.cu_seqlens)  # one entry per sequence of the keys' layout


@pytest.mark.parametrize("mask, problem", [
    ([[0, 1, 1], [1, 1, 0]], "right-padded"),
    ([[1, 0, 1], [1, 1, 0]], "right-padded"),
    ([[1, 1, 0], [0, 0, 0]], "at least one token"),
])
def test_pack_refuses_layouts_it_cannot_express(mask, problem):
    with pytest.raises(ValueError, match=problem):
        pack(torch.tensor(mask))


def test_packed_inputs_point_at_the_same_tokens():
    b = padded_batch(300, lengths=[9, 3, 12], seed=5)
    padded = model_inputs(b, max_predictions=4, device=torch.device("cpu"))
    packed = model_inputs(b, max_predictions=4, device=torch.device("cpu"), unpad=True)
    assert packed["input_ids"].shape == (24,) and packed["attention_mask"] is None
    rows = torch.arange(3)[:, None]
    # every masked slot names the same token id in both layouts
    assert torch.equal(b["input_ids"][rows, padded["masked_positions"]],
                       packed["input_ids"][packed["masked_positions"]])
    assert torch.equal(padded["mlm_labels"], packed["mlm_labels"])


def test_a_label_on_padding_is_refused():
    b = padded_batch(300, lengths=[9, 3], seed=5)
    b["mlm_labels"][1, 5] = 7
    with pytest.raises(ValueError, match="padding"):
        model_inputs(b, max_predictions=6, device=torch.device("cpu"), unpad=True)


@pytest.mark.parametrize("lengths", [[37, 12, 64, 5, 50], [16, 16], [2, 30]])
@pytest.mark.parametrize("token_multiple", [None, 64])
def test_packed_model_matches_padded_model(lengths, token_multiple):
    """Packed, and packed with filler sequences up to a token multiple: the same outputs and gradients."""
    torch.manual_seed(0)
    model = without_dropout(BertForPreTraining(preset_config("mini", vocab_size=300)))
    b = padded_batch(300, lengths, seed=2)
    runs = []
    for unpad in (False, True):
        model.zero_grad()
        inputs = model_inputs(b, max_predictions=20, device=torch.device("cpu"), unpad=unpad,
                              token_multiple=token_multiple if unpad else None)
        if unpad and token_multiple:
            assert inputs["input_ids"].shape[0] % token_multiple == 0 and inputs["packed"].fillers > 0
        out = model(**inputs)
        out.loss.backward()
        runs.append((out, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (padded, padded_grads), (packed, packed_grads) = runs
    assert torch.allclose(packed.mlm_logits, padded.mlm_logits, atol=1e-5)
    assert torch.allclose(packed.nsp_logits, padded.nsp_logits, atol=1e-5)
    assert packed.loss.item() == pytest.approx(padded.loss.item(), abs=1e-6)
    for name, grad in padded_grads.items():
        assert torch.allclose(packed_grads[name], grad, atol=1e-6), name


def test_training_loss_falls_packed_as_padded():
    """A few optimiser steps on one batch from the same start: the two layouts follow the same path."""
    b = padded_batch(300, [40, 7, 25, 33], seed=4)
    losses = []
    for unpad in (False, True):
        torch.manual_seed(0)
        model = without_dropout(BertForPreTraining(preset_config("tiny", vocab_size=300)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        inputs = model_inputs(b, max_predictions=10, device=torch.device("cpu"), unpad=unpad)
        run = []
        for _ in range(5):
            loss = model(**inputs).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        losses.append(run)
    assert losses[0][-1] < losses[0][0] - 0.1
    assert losses[1] == pytest.approx(losses[0], abs=1e-4)


# ---- CUDA: FlashAttention's variable-length kernel ----

def _cuda_qkv(lengths: list[int], heads: int = 4, size: int = 64, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mask = (torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]).long()
    _, packed = pack(mask)
    packed = packed._replace(cu_seqlens=packed.cu_seqlens.cuda(), position_ids=packed.position_ids.cuda())
    t = sum(lengths)
    q, k, v = (torch.randn(t, heads, size, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    return q, k, v, packed


@pytest.mark.torch_cuda
@pytest.mark.parametrize("query_subset", [False, True])
def test_flash_varlen_matches_padded_attention_with_gradients(query_subset):
    q, k, v, packed = _cuda_qkv([128, 3, 77, 128, 1, 64])
    queries = None
    if query_subset:  # 4 query rows per sequence, repeats included, as QueryRows.for_heads makes them
        starts = packed.first_tokens
        lengths = packed.cu_seqlens.diff().long()
        offsets = torch.stack([torch.zeros_like(lengths), lengths - 1, (lengths - 1) // 2, lengths // 3], 1)
        queries = QueryRows((starts[:, None] + offsets).flatten(), 4)
        q = q.detach()[queries.index].requires_grad_()
    g = torch.randn_like(q)
    results = []
    for attention in (varlen_attention, _padded_reference):
        out = attention(q, k, v, packed, 0.0, queries)
        dq, dk, dv = torch.autograd.grad((out * g).sum(), (q, k, v))
        results.append([x.float() for x in (out, dq, dk, dv)])
    for flash, reference in zip(*results):
        assert torch.allclose(flash, reference, atol=2e-2, rtol=2e-2)
        assert torch.nn.functional.cosine_similarity(flash.flatten(), reference.flatten(), dim=0) > 0.9999


def _padded_reference(q, k, v, packed, dropout_p, queries):
    from training.packed import _padded_attention
    return _padded_attention(q, k, v, packed, dropout_p, queries)


@pytest.mark.torch_cuda
def test_flash_varlen_backward_drops_what_forward_dropped():
    """out = D·V for a fixed dropped-out probability matrix D, so <out, g> = <D^T g, V> = <dV, V> holds
    exactly when backward replays forward's dropout mask, and fails by far when it draws another."""
    q, k, v, packed = _cuda_qkv([128, 50, 128, 9], seed=1)
    g = torch.randn_like(q).float()
    out = varlen_attention(q, k, v, packed, 0.5)
    dv, = torch.autograd.grad((out.float() * g).sum(), (v,))
    forward_side = (out.float() * g).sum().item()
    backward_side = (dv.float() * v.float()).sum().item()
    assert backward_side == pytest.approx(forward_side, rel=2e-2, abs=2.0)
    no_dropout = varlen_attention(q, k, v, packed, 0.0)
    assert not torch.allclose(out, no_dropout)  # dropout really dropped something


@pytest.mark.torch_cuda
def test_compiled_packed_training_step_on_cuda_matches_padded():
    torch.manual_seed(0)
    model = without_dropout(BertForPreTraining(preset_config("mini", vocab_size=300))).cuda()
    b = padded_batch(300, [128, 40, 77, 128, 3, 100], seed=6)
    losses = []
    for unpad in (False, True):
        step = torch.compile(model)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = step(**model_inputs(b, 40, torch.device("cuda"), unpad=unpad))
        losses.append(out.loss.item())
        out.loss.backward()
    assert losses[1] == pytest.approx(losses[0], rel=1e-2)


def compiled_training_steps(cuda_graphs: bool, filled: bool, steps: int = 8, decay_steps: int = 10):
    """`steps` optimiser steps of a dropout-free mini model over four batches of different token counts
    (each shape recorded, then replayed, under CUDA graphs); the learning rate falls to 0 over
    `decay_steps`, so a replay that kept its recorded rate would drift. Returns (losses, weights)."""
    from bench.ddp_scaling import PreparedBatches  # what optimizer_step reads of the trainer's stream
    from training.model_inputs import cpu_inputs
    from training.optim import WarmupLinearDecay, make_optimizer
    from training.trainer import (CUDA_GRAPH_TOKEN_MULTIPLE, DistInfo, LogWindow, TrainConfig, build_learner,
                                  optimizer_step)

    dist = DistInfo(device=torch.device("cuda"))
    shapes = ([128, 40, 77, 3], [3, 100, 128, 64], [128, 128, 128, 128], [50, 60, 9, 2])
    torch.manual_seed(0)
    model = without_dropout(BertForPreTraining(preset_config("mini", vocab_size=300))).to(dist.device)
    cfg = TrainConfig(batch_size=4, lr=1e-3, warmup_steps=0, compile=True, cuda_graphs=cuda_graphs)
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay, dist.device)
    learner = build_learner(model, optimizer, WarmupLinearDecay(optimizer, cfg.lr, 0, decay_steps), cfg, dist)
    multiple = CUDA_GRAPH_TOKEN_MULTIPLE if filled else None
    stream = PreparedBatches([StreamBatch(0, i, 0, cpu_inputs(padded_batch(300, lengths, seed=i), 40, pad_to=128,
                                                              unpad=True, token_multiple=multiple))
                              for i, lengths in enumerate(shapes)])
    window, losses = LogWindow(dist.device), []
    for _ in range(steps):
        optimizer_step(learner, stream, window, cfg, dist)
        losses.append(window.close(dist).loss)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.torch_cuda
def test_cuda_graph_training_steps_follow_the_plain_compiled_steps():
    """The CUDA-graph steps give the plain compiled steps' losses, fillers or not, and their weights on the
    same filled batches. Weights are compared by the mean difference over all elements: bf16 products and
    the embeddings' atomic gradient sums differ from run to run, and Adam turns that noise in near-zero
    gradients into lr-sized steps of single elements, whereas a replay with a stale batch, rate or
    optimiser state moves every element. On an H100: two plain runs 4.0e-6 apart, plain and graphs 4.0e-6,
    a rate that stays at its first value 8.6e-4."""
    plain, _ = compiled_training_steps(cuda_graphs=False, filled=False)
    _, filled_weights = compiled_training_steps(cuda_graphs=False, filled=True)
    graphed, graphed_weights = compiled_training_steps(cuda_graphs=True, filled=True)
    assert graphed == pytest.approx(plain, rel=1e-3)
    total = sum((graphed_weights[n] - w).abs().sum().item() for n, w in filled_weights.items())
    elements = sum(w.numel() for w in filled_weights.values())
    assert total / elements < 1e-5


@pytest.mark.torch_cuda
def test_cuda_graph_replays_draw_new_dropout_masks():
    """A replayed step must not repeat its dropout: the same batch and weights twice give two losses."""
    from training.model_inputs import cpu_inputs, inputs_to_device
    from training.trainer import CUDA_GRAPH_TOKEN_MULTIPLE

    torch.manual_seed(0)
    model = BertForPreTraining(preset_config("mini", vocab_size=300)).cuda().train()  # dropout 0.1
    step = torch.compile(model, mode="reduce-overhead")
    inputs = cpu_inputs(padded_batch(300, [128, 40, 77, 3], seed=1), 40, pad_to=128, unpad=True,
                        token_multiple=CUDA_GRAPH_TOKEN_MULTIPLE)
    losses = []
    for _ in range(5):  # warm-up, recording, then replays
        torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            losses.append(step(**inputs_to_device(inputs, torch.device("cuda"))).loss.item())
    assert len(set(losses[2:])) == 3, losses
