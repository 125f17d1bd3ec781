"""The engine link (app/multiprocess/engine_link.py) in one process: the real tokenizer, OrtEngine and DynamicBatcher of
the tiny artifact behind a real Unix socket, EngineClient on the other end. What crosses must equal what
the batcher answers directly, for every output, small frames and frames larger than the read buffer."""
from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

from app import errors
from app.batcher import Sequences
from app.build import build_engine, load_tokenizer
from app.backend import EngineInfo
from app.multiprocess import engine_link
from app.multiprocess.engine_link import EngineClient, serve_workers
from app.metrics import Metrics
from app.pooling import POOLING_OUTPUT, TOKEN_POOLED
from app.settings import Settings
from artifact.manifest import CLS_EMBEDDING, MEAN_EMBEDDING, NSP_LOGITS, POOLED_EMBEDDING, POOLINGS, TOKEN_EMBEDDINGS

ALL = frozenset({TOKEN_EMBEDDINGS, CLS_EMBEDDING, POOLED_EMBEDDING, NSP_LOGITS})


@contextlib.asynccontextmanager
async def linked(artifact, folder, metrics: Metrics | None = None, **overrides):
    settings = Settings(model_dir=artifact, **overrides)
    manifest, tokenizer = load_tokenizer(settings)
    engine, batcher = build_engine(settings, manifest, tokenizer, metrics or Metrics())
    batcher.start()
    info = EngineInfo.of(engine, batcher)
    path = str(folder / "engine.sock")
    server = await asyncio.get_running_loop().create_unix_server(serve_workers(batcher, info), path=path)
    client = EngineClient(path)
    try:
        assert await client.connect() == info
        yield tokenizer, batcher, client
    finally:
        await client.stop()
        server.close()
        await batcher.stop()


def _sequences(tokenizer, texts) -> Sequences:
    encoded = tokenizer.encode(texts, truncate=True)
    return Sequences.concat([e.ids for e in encoded], [e.type_ids for e in encoded])


def test_the_link_answers_what_the_batcher_answers(tiny_artifact_dir, tmp_path):
    small = ["a short text", ("a question?", "an answer.")]
    large = [f"text number {i} " + "with many more words " * (i % 9) for i in range(120)]

    async def go():
        async with linked(tiny_artifact_dir, tmp_path) as (tokenizer, batcher, client):
            answers = []
            for texts in (small, large):
                for outputs in (ALL, frozenset({NSP_LOGITS})):  # 4 arrays, or 1 (its bytes start unaligned)
                    sequences = _sequences(tokenizer, texts)
                    direct, linked_ = await asyncio.gather(batcher.submit_group(sequences, outputs),
                                                           client.submit_group(sequences, outputs))
                    answers.append((sequences, outputs, direct, linked_))
            return answers

    for sequences, outputs, direct, linked_ in asyncio.run(go()):
        assert linked_.outputs.keys() == direct.outputs.keys() == outputs
        for name in outputs - {TOKEN_EMBEDDINGS}:
            assert linked_.outputs[name].shape == (len(sequences), direct.outputs[name].shape[1])
            np.testing.assert_allclose(linked_.outputs[name], direct.outputs[name], atol=1e-5)
        if TOKEN_EMBEDDINGS in outputs:
            tokens = linked_.outputs[TOKEN_EMBEDDINGS]
            assert [len(t) for t in tokens] == sequences.lengths.tolist()
            for a, b in zip(tokens, direct.outputs[TOKEN_EMBEDDINGS]):
                np.testing.assert_allclose(a, b, atol=1e-5)
        assert linked_.inference_s > 0 and linked_.batch_size >= 1
    large_frame = sequences.lengths.sum() * 128 * 4  # the token vectors of the large request, in bytes
    assert large_frame > 4 * (1 << 16)  # several times the link's read buffer: read into a buffer of its own


def test_requests_of_one_loop_turn_cross_as_one_group_each_with_its_own_rows(tiny_artifact_dir, tmp_path):
    """Requests submitted in one event-loop turn that want the same outputs cross in one SUBMIT frame (the
    engine process's work per request, paid once); each gets exactly its own rows, as the batcher answers
    it alone. One cancelled among them leaves the others answered; 64 rows or more go on their own."""
    texts = [["one"], ["two words", ("a question?", "an answer.")], ["three short texts", "b", "c"],
             [f"sentence {i} of a longer request" for i in range(9)], ["five"]]
    cls_only = [["six"], ["seven", "eight"]]
    large = [f"text {i}" for i in range(70)]

    async def go():
        async with linked(tiny_artifact_dir, tmp_path) as (tokenizer, batcher, client):
            submits = []
            send = client._link.send
            client._link.send = lambda *parts: (submits.append(bytes(parts[0])[0] == engine_link.SUBMIT),
                                                send(*parts))[1]
            seqs = [_sequences(tokenizer, t) for t in texts]
            cls_seqs = [_sequences(tokenizer, t) for t in cls_only]
            futures = [client.submit_group(q, ALL) for q in seqs]  # one turn: no await in between
            cls_futures = [client.submit_group(q, frozenset({CLS_EMBEDDING})) for q in cls_seqs]
            large_future = client.submit_group(_sequences(tokenizer, large), frozenset({CLS_EMBEDDING}))
            futures[2].cancel()
            linked_ = await asyncio.gather(*[f for i, f in enumerate(futures) if i != 2], *cls_futures, large_future)
            direct = [await batcher.submit_group(q, ALL) for i, q in enumerate(seqs) if i != 2]
            direct += [await batcher.submit_group(q, frozenset({CLS_EMBEDDING})) for q in cls_seqs]
            return sum(submits), linked_, direct, [q for i, q in enumerate(seqs) if i != 2] + cls_seqs

    frames, linked_, direct, sequences = asyncio.run(go())
    assert frames == 3  # five requests for every output, two for [CLS] vectors, the large one alone
    assert linked_[-1].outputs[CLS_EMBEDDING].shape == (70, 128)
    for got, want, seq in zip(linked_, direct, sequences):
        assert got.outputs.keys() == want.outputs.keys()
        for name in got.outputs.keys() - {TOKEN_EMBEDDINGS}:
            assert got.outputs[name].shape == want.outputs[name].shape == (len(seq), want.outputs[name].shape[1])
            np.testing.assert_allclose(got.outputs[name], want.outputs[name], atol=1e-5)
        if TOKEN_EMBEDDINGS in got.outputs:
            assert [len(t) for t in got.outputs[TOKEN_EMBEDDINGS]] == seq.lengths.tolist()
            for a, b in zip(got.outputs[TOKEN_EMBEDDINGS], want.outputs[TOKEN_EMBEDDINGS]):
                np.testing.assert_allclose(a, b, atol=1e-5)


def test_the_link_carries_errors_and_cancellations(tiny_artifact_dir, tmp_path):
    async def go():
        async with linked(tiny_artifact_dir, tmp_path, max_queued_sequences=3, inference_workers=1) as (
                tokenizer, batcher, client):
            # More than the queue holds: never queued, so 413 and not a 429 to retry (Overloaded crosses the
            # link in test_an_engine_error_crosses_the_link_with_its_retry_after and test_server).
            with pytest.raises(errors.TooManyInputs, match="4 sequences; the server queues at most 3"):
                await client.submit_group(_sequences(tokenizer, ["one", "two", "three", "four"]), ALL)
            # Cancelled in the worker: the engine drops it before inference, and keeps answering.
            future = client.submit_group(_sequences(tokenizer, ["dropped"]), ALL)
            future.cancel()
            await asyncio.sleep(0.2)
            after = await client.submit_group(_sequences(tokenizer, ["still served"]), frozenset({CLS_EMBEDDING}))
            return after, batcher.queued
    after, queued = asyncio.run(go())
    assert after.outputs[CLS_EMBEDDING].shape == (1, 128) and queued == 0


def test_a_lost_engine_fails_waiting_requests_with_not_ready(tiny_artifact_dir, tmp_path):
    lost = []

    async def go():
        async with linked(tiny_artifact_dir, tmp_path) as (tokenizer, batcher, client):
            client.on_lost = lambda: lost.append(True)
            future = client.submit_group(_sequences(tokenizer, ["in flight when the engine goes"]), ALL)
            client._link.transport.abort()  # the socket closes as it does when the engine process dies
            with pytest.raises(errors.NotReady):
                await future
            with pytest.raises(errors.NotReady):
                client.submit_group(_sequences(tokenizer, ["after"]), ALL)
    asyncio.run(go())
    assert lost == [True]


def test_an_answer_the_worker_cannot_read_fails_its_requests_instead_of_leaving_them_waiting(
        tiny_artifact_dir, tmp_path, monkeypatch):
    """A worker and an engine process of different versions (a frame layout changed): the requests whose
    answer cannot be read get an internal error, the others on the link NotReady; none waits forever."""
    def unreadable(frame, lengths):
        raise IndexError("tuple index out of range")

    monkeypatch.setattr(engine_link, "_read_result", unreadable)

    async def go():
        async with linked(tiny_artifact_dir, tmp_path) as (tokenizer, batcher, client):
            future = client.submit_group(_sequences(tokenizer, ["its answer is unreadable"]), ALL)
            with pytest.raises(errors.InternalError, match="could not be read"):
                await asyncio.wait_for(future, 30)
            with pytest.raises(errors.NotReady):  # the link closed behind it
                client.submit_group(_sequences(tokenizer, ["after"]), ALL)
    asyncio.run(go())


def test_an_answer_over_the_frame_limit_is_a_413_and_the_link_stays_up(tiny_artifact_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(engine_link, "_FRAME_LIMIT", 1 << 18)  # 256 KiB stands in for 2 GiB
    texts = [f"text number {i} " + "with many more words " * 8 for i in range(60)]

    async def go():
        async with linked(tiny_artifact_dir, tmp_path) as (tokenizer, batcher, client):
            with pytest.raises(errors.TooManyInputs, match="send fewer inputs"):
                await client.submit_group(_sequences(tokenizer, texts), ALL)
            return await client.submit_group(_sequences(tokenizer, texts), frozenset({CLS_EMBEDDING}))
    assert asyncio.run(go()).outputs[CLS_EMBEDDING].shape == (60, 128)


def test_token_poolings_cross_the_link_as_one_vector_a_text(tiny_artifact_dir, tmp_path, monkeypatch):
    """A mean-pooled request (every sentence-transformers model's default) sent every token vector over the
    link for the worker to pool: 2,048 texts of 512 tokens were refused 413 past the 2 GiB frame, and each
    worker held the vectors. Now the engine process pools where the batch ran and sends [n, H]: here the
    same texts whose token vectors pass the (lowered) frame limit, with each pooling as pooled from them."""
    monkeypatch.setattr(engine_link, "_FRAME_LIMIT", 1 << 18)  # 256 KiB stands in for 2 GiB
    texts = [f"text number {i} " + "with many more words " * 8 for i in range(60)]
    token_poolings = [p for p in POOLINGS if POOLING_OUTPUT[p] in TOKEN_POOLED]

    async def go():
        async with linked(tiny_artifact_dir, tmp_path) as (tokenizer, batcher, client):
            sequences = _sequences(tokenizer, texts)
            with pytest.raises(errors.TooManyInputs, match="send fewer inputs"):
                await client.submit_group(sequences, frozenset({TOKEN_EMBEDDINGS}))
            pooled = await client.submit_group(sequences, frozenset(POOLING_OUTPUT[p] for p in token_poolings))
            tokens = await batcher.submit_group(sequences, frozenset({TOKEN_EMBEDDINGS}))
            return pooled.outputs, tokens.outputs[TOKEN_EMBEDDINGS]
    pooled, tokens = asyncio.run(go())
    assert len(token_poolings) == 5 and pooled.keys() == {POOLING_OUTPUT[p] for p in token_poolings}
    for name, value in pooled.items():
        assert value.shape == (60, 128)
        want = np.stack([TOKEN_POOLED[name](t) for t in tokens])
        if name == MEAN_EMBEDDING:  # the graph pools the mean itself (export.mean_output): fp32, its own order
            np.testing.assert_allclose(value, want, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(value, want, err_msg=name)


def test_a_worker_that_stops_reading_stops_getting_work_done(tiny_artifact_dir, tmp_path, monkeypatch):
    """Backpressure: once a worker leaves _HOLD_AT of answers unread, the engine stops reading its work
    (so the engine's memory stays bounded); when the worker reads again, every request is answered."""
    monkeypatch.setattr(engine_link, "_HOLD_AT", 1 << 20)  # 1 MiB stands in for 64
    requests = 200
    metrics = Metrics()

    async def go():
        # All 200 requests are queued at once, however long they take: no admission by time here.
        async with linked(tiny_artifact_dir, tmp_path, metrics, max_queue_ms=None) as (tokenizer, batcher, client):
            # A second worker connection, one that does not read for now.
            reader, writer = await asyncio.open_unix_connection(client.socket_path)
            s = _sequences(tokenizer, ["many more words " * 30] * 8)  # each answer: ~8 x 100 token vectors
            parts = [s.lengths.astype(np.int32).tobytes(), s.ids.astype(np.int32).tobytes(),
                     s.type_ids.astype(np.uint8).tobytes()]
            mask = 1 << engine_link._OUTPUTS.index(TOKEN_EMBEDDINGS)
            for rid in range(requests):  # spread out, as a worker's requests come
                body = engine_link._SUBMIT.pack(engine_link.SUBMIT, mask, len(s), rid) + b"".join(parts)
                writer.write(engine_link._LENGTH.pack(len(body)) + body)
                await asyncio.sleep(0.01)
            await asyncio.sleep(1.0)
            done_while_unread = metrics.sequences._value.get()
            answers = 0
            try:
                (length,) = engine_link._LENGTH.unpack(await reader.readexactly(4))
                frame = await reader.readexactly(length)
                assert frame[0] == engine_link.HELLO
                while answers < requests:
                    (length,) = engine_link._LENGTH.unpack(await asyncio.wait_for(reader.readexactly(4), 30))
                    frame = await reader.readexactly(length)
                    assert frame[0] == engine_link.RESULT
                    answers += 1
            finally:
                writer.close()
            return done_while_unread, answers, len(s)
    done_while_unread, answers, per_request = asyncio.run(go())
    # About 1 MiB of answers stops it: a handful of requests (those read before, 7-10 here), never all.
    assert done_while_unread < requests * per_request / 2
    assert answers == requests


def test_an_engine_error_crosses_the_link_with_its_retry_after():
    from app import errors

    sent = errors.Overloaded("the queue holds about 3.2 s of work", retry_after_s=4)
    got = engine_link._error_from(engine_link._error_payload(sent))
    assert type(got) is errors.Overloaded and got.message == sent.message and got.headers["Retry-After"] == "4"
    got = engine_link._error_from(engine_link._error_payload(errors.InvalidInput("line one\nline two")))
    assert type(got) is errors.InvalidInput and got.message == "line one\nline two" and "Retry-After" not in got.headers
    assert type(engine_link._error_from(engine_link._error_payload(KeyError("x")))) is errors.InternalError
