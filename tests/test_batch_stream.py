"""The trainer's batch stream on a real (small) corpus: worker processes serve exactly the batches of
the synchronous stream, in its order, from any position; errors reach the consumer; no worker outlives it."""
from __future__ import annotations

import functools
import multiprocessing

import pytest
import torch

from data_corpora import prepare, write_txt_corpus
from training.batch_stream import BatchStream
from training.model_inputs import cpu_inputs


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stream")
    corpus = write_txt_corpus(tmp / "c.txt", n_docs=150, sentences=(2, 8), words=(3, 9))
    return prepare(tmp, corpus, max_seq_len=32).train


def _take(stream: BatchStream, n: int) -> list[tuple[int, int, int, dict]]:
    """n batches, each with the stream's position after it."""
    out = []
    for _ in range(n):
        item = stream.next()
        out.append((stream.epoch, stream.batch_in_epoch, item.tokens, item.inputs))
    return out


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if not torch.equal(x, y):
                return False
        elif isinstance(x, tuple):  # PackedSequences
            if not all(torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v for u, v in zip(x, y)):
                return False
        elif x != y:
            return False
    return True


def test_the_synchronous_stream_is_the_epochs_batches_end_to_end(data):
    per_epoch = data.num_batches(0, 8)
    with BatchStream(data, 8, seed=3, epoch=0, batch_in_epoch=per_epoch - 2) as stream:
        got = _take(stream, 4)
    expected = list(data.batches(0, 8, seed=3, skip_batches=per_epoch - 2)) + \
        list(data.batches(1, 8, seed=3))[:2]
    assert all(_same(g[3], e) for g, e in zip(got, expected))
    assert [g[:2] for g in got] == [(0, per_epoch - 1), (0, per_epoch), (1, 1), (1, 2)]
    assert [g[2] for g in got] == [int(e["attention_mask"].sum()) for e in expected]


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("rank", [0, 1])
def test_workers_serve_the_synchronous_batches_in_order_from_a_resume_position(data, workers, rank):
    """Two ranks of two, starting mid-epoch, across two epoch boundaries, with the trainer's packed inputs."""
    per_epoch = data.num_batches(0, 4, world_size=2)
    start = per_epoch - 5
    n = per_epoch + data.num_batches(1, 4, world_size=2) // 2  # into epoch 2
    prepare_inputs = functools.partial(cpu_inputs, max_predictions=8, unpad=True)

    def stream(w: int) -> BatchStream:
        return BatchStream(data, 4, seed=1, rank=rank, world_size=2, epoch=0, batch_in_epoch=start,
                           prepare=prepare_inputs, workers=w)

    with stream(0) as sync, stream(workers) as prefetched:
        expected, got = _take(sync, n), _take(prefetched, n)
    assert expected[-1][0] == 2, "the batches should reach epoch 2"
    for i, (e, g) in enumerate(zip(expected, got)):
        assert g[:3] == e[:3], f"batch {i}"
        assert _same(g[3], e[3]), f"batch {i}"
    assert not multiprocessing.active_children()


def test_a_resumed_stream_continues_with_the_next_batch_not_the_prefetched_ones(data):
    """Workers build ahead; the position a checkpoint records is that of the batches consumed."""
    with BatchStream(data, 8, seed=0, workers=2) as stream:
        assert [b[:2] for b in _take(stream, 3)] == [(0, 1), (0, 2), (0, 3)]
        epoch, index = stream.epoch, stream.batch_in_epoch
    with BatchStream(data, 8, seed=0, epoch=epoch, batch_in_epoch=index, workers=2) as resumed, \
            BatchStream(data, 8, seed=0) as straight:
        expected, got = _take(straight, 6)[3:], _take(resumed, 3)
    assert all(g[:3] == e[:3] and _same(g[3], e[3]) for g, e in zip(got, expected))


@pytest.mark.parametrize("workers", [0, 2])
def test_an_error_building_a_batch_reaches_the_consumer(data, workers):
    """The MLM gather fails on batches with more masked tokens than max_predictions: the same
    ValueError in the training process, and no worker left running."""
    failing = functools.partial(cpu_inputs, max_predictions=1)
    stream = BatchStream(data, 8, seed=0, prepare=failing, workers=workers)
    with pytest.raises(ValueError, match="masked positions, more than max_predictions 1"), stream:
        stream.next()
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("workers", [0, 2])
def test_data_too_small_for_one_batch_is_an_error_not_a_hang(data, workers):
    stream = BatchStream(data, 10 * data.num_examples(0), seed=0, workers=workers)
    with pytest.raises(ValueError, match="yields no batch of"), stream:
        stream.next()
    assert not multiprocessing.active_children()


def test_workers_stop_when_the_consumer_is_interrupted(data):
    with pytest.raises(KeyboardInterrupt), BatchStream(data, 8, seed=0, workers=2) as stream:
        stream.next()
        assert len(multiprocessing.active_children()) == 2
        raise KeyboardInterrupt
    assert not multiprocessing.active_children()


def test_training_with_and_without_workers_is_the_same(tmp_path):
    """The whole trainer: the same losses and tokens whether the batches come from workers or not."""
    from test_trainer import read_metrics, small_args, write_corpus

    from training.pretrain import main
    corpus = write_corpus(tmp_path / "c.txt", n_docs=60, seed=5)
    runs = {}
    for workers in ("0", "2"):
        run_dir = tmp_path / f"run{workers}"
        assert main(small_args(corpus, tmp_path / "cache", tmp_path / f"m{workers}", run_dir, "--max-steps", "6",
                               "--log-every", "1", "--eval-every", "0", "--heldout-fraction", "0.2",
                               "--data-workers", workers)) == 0
        runs[workers] = [(r["loss"], r["tokens_seen"], r["epoch"]) for r in read_metrics(run_dir)]
    assert runs["0"] == runs["2"]
    assert not multiprocessing.active_children()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs a CUDA device")
def test_pinned_batches_are_the_workers_batches_in_page_locked_memory(data):
    """With pin_memory, the DataLoader's thread receives and pins; next() hands over the same batches."""
    prepare_inputs = functools.partial(cpu_inputs, max_predictions=8, unpad=True)
    with BatchStream(data, 4, seed=1, prepare=prepare_inputs, workers=2, pin_memory=True) as pinned, \
            BatchStream(data, 4, seed=1, prepare=prepare_inputs) as sync:
        expected, got = _take(sync, 5), _take(pinned, 5)
    for i, (e, g) in enumerate(zip(expected, got)):
        assert g[:3] == e[:3] and _same(g[3], e[3]), f"batch {i}"
        tensors = [g[3]["input_ids"], g[3]["masked_positions"], g[3]["packed"].cu_seqlens]
        assert all(t.is_pinned() for t in tensors), f"batch {i}"


@pytest.mark.parametrize("cores, local_processes, device, expected", [
    (16, 1, "cuda", 8), (32, 2, "cuda", 8), (16, 2, "cuda", 4), (4, 1, "cuda", 2), (64, 1, "cuda", 8),
    (16, 1, "cpu", 2)])
def test_the_trainers_default_data_workers_follow_the_cores_of_its_share(monkeypatch, cores, local_processes,
                                                                        device, expected):
    from training.trainer import DistInfo, default_data_workers
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_processes))
    assert default_data_workers(DistInfo(device=torch.device(device))) == expected
