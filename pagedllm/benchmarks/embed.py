"""Embedding throughput: `pagedllm bench embed`: a corpus of sentences of varied length, embedded in batches.

Contract. The corpus is `--num-sentences` sentences of `--min-words` .. `--max-words` words drawn (seeded) from the
alphabetic whole words of the model's tokenizer vocabulary, so that every engine given the same tokenizer embeds the
same texts. One of three engines runs it:
- `--base-url URL` (any server with OpenAI's /v1/embeddings: pagedllm, vLLM): requests of `--batch-size` inputs,
  `--concurrency` of them in flight; meanwhile one short query is sent again and again, alone, one at most every
  `--probe-interval` seconds (the same rate whatever the engine's latency, so that an engine that answers it
  sooner does not take on more load), and its latency under that load reported (p50, p90);
- `--sentence-transformers`: sentence-transformers' `encode` in this process, `--batch-size` at a time, on
  `--num-threads` torch threads;
- otherwise pagedllm offline (`LLM.embed` of the whole corpus; engine flags are `pagedllm serve`'s).
Reported: sentences/s and input tokens/s (best of `--num-iters` runs, after a warm-up), and with `--reference` the
cosine similarity of every embedding to sentence-transformers' on the same folder (min and mean). `--json-out`
appends the record to a JSON-lines file.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import random
import statistics
import sys
import time
from typing import Any

import numpy as np

DEFAULT_PROG = "pagedllm bench embed"
PROBE = "What is the capital of France?"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from pagedllm.engine.arg_utils import EngineArgs

    EngineArgs.add_cli_args(parser)
    add = parser.add_argument
    add("--num-sentences", type=int, default=2000, help="sentences in the corpus (default 2000)")
    add("--min-words", type=int, default=6, help="shortest sentence in words (default 6)")
    add("--max-words", type=int, default=100, help="longest sentence in words (default 100)")
    add("--corpus-seed", type=int, default=0, help="seed of the corpus (default 0)")
    add("--batch-size", type=int, default=32, help="inputs per request / per encode batch (default 32)")
    add("--concurrency", type=int, default=4, help="requests in flight against a server (default 4)")
    add(
        "--probe-interval",
        type=float,
        default=0.25,
        help="a lone short query is sent at most this often, in seconds, during a server run (default 0.25; "
        "0: again as soon as it is answered)",
    )
    add("--base-url", default=None, help="measure this server's /v1/embeddings instead of pagedllm offline")
    add("--sentence-transformers", action="store_true", help="measure sentence-transformers in this process")
    add("--reference", action="store_true", help="compare every embedding with sentence-transformers' (cosine)")
    add("--num-iters", type=int, default=2, help="timed runs; the best is reported (default 2)")
    add("--json-out", default=None, metavar="PATH", help="append a JSON record to PATH (JSON lines)")
    return parser


def make_corpus(tokenizer_folder: str, n: int, min_words: int, max_words: int, seed: int) -> list[str]:
    """`n` sentences of random alphabetic vocabulary words (longer than two letters), `min_words` to `max_words`
    words each; the same for every engine given the same tokenizer and seed."""
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(tokenizer_folder).get_vocab()
    words = sorted(w.lstrip("Ġ▁") for w in vocab if w.lstrip("Ġ▁").isalpha() and len(w.lstrip("Ġ▁")) > 2)
    words = sorted(set(words))
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(min_words, max_words))) for _ in range(n)]


def _batches(items: list[str], size: int) -> list[list[str]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


# ---- engines ---------------------------------------------------------------------------------------------------


async def _serve_run(args: argparse.Namespace, corpus: list[str], model: str) -> dict[str, Any]:
    import httpx

    url = args.base_url.rstrip("/") + "/v1/embeddings"
    queue = list(enumerate(_batches(corpus, args.batch_size)))
    results: dict[int, list[list[float]]] = {}
    tokens = 0
    probes: list[float] = []
    done = asyncio.Event()

    async def post(client: httpx.AsyncClient, texts: list[str]) -> dict[str, Any]:
        body = {"model": model, "input": texts, "encoding_format": "base64"}
        resp = await client.post(url, json=body, timeout=600)
        resp.raise_for_status()
        return resp.json()

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            index, texts = queue.pop(0)
            data = await post(client, texts)
            tokens += data["usage"]["prompt_tokens"]
            results[index] = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in data["data"]]

    async def probe(client: httpx.AsyncClient) -> None:
        while not done.is_set():
            start = time.perf_counter()
            await post(client, [PROBE])
            probes.append(time.perf_counter() - start)
            rest = args.probe_interval - (time.perf_counter() - start)
            if rest > 0:
                try:  # the next one after the interval, or none once the run is over
                    await asyncio.wait_for(done.wait(), rest)
                except TimeoutError:
                    pass

    limits = httpx.Limits(max_connections=args.concurrency + 2)
    async with httpx.AsyncClient(limits=limits) as client:
        await post(client, corpus[:8])  # warm-up
        start = time.perf_counter()
        prober = asyncio.create_task(probe(client))
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
        wall = time.perf_counter() - start
        done.set()
        await prober
    embeds = [e for i in sorted(results) for e in results[i]]
    return {"wall": wall, "tokens": tokens, "embeddings": embeds, "probe_s": probes}


def run_server(args: argparse.Namespace, corpus: list[str]) -> list[dict[str, Any]]:
    import httpx

    model = args.served_model_name  # else the server's own name for its model (the first of /v1/models)
    if model is None:
        model = httpx.get(args.base_url.rstrip("/") + "/v1/models", timeout=30).json()["data"][0]["id"]
    return [asyncio.run(_serve_run(args, corpus, model)) for _ in range(args.num_iters)]


def _st_model(folder: str) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(folder, device="cpu")


def run_sentence_transformers(args: argparse.Namespace, corpus: list[str], folder: str) -> list[dict[str, Any]]:
    import torch

    torch.set_num_threads(args.num_threads or 2)
    model = _st_model(folder)
    tokens = sum(
        len(ids) for ids in model.tokenizer(corpus, truncation=True, max_length=model.max_seq_length)["input_ids"]
    )
    model.encode(corpus[:64], batch_size=args.batch_size)  # warm-up
    runs = []
    for _ in range(args.num_iters):
        start = time.perf_counter()
        embeds = model.encode(corpus, batch_size=args.batch_size, convert_to_numpy=True)
        runs.append({"wall": time.perf_counter() - start, "tokens": tokens, "embeddings": list(embeds)})
    return runs


def run_offline(args: argparse.Namespace, corpus: list[str]) -> list[dict[str, Any]]:
    import dataclasses

    from pagedllm import LLM
    from pagedllm.engine.arg_utils import EngineArgs

    engine_args = dataclasses.asdict(EngineArgs.from_cli_args(args))
    runs = []
    with LLM(**engine_args) as llm:
        llm.embed(corpus[:64], use_tqdm=False)  # warm-up
        for _ in range(args.num_iters):
            start = time.perf_counter()
            outs = llm.embed(corpus, use_tqdm=False)
            wall = time.perf_counter() - start
            tokens = sum(len(o.prompt_token_ids) for o in outs)
            runs.append({"wall": wall, "tokens": tokens, "embeddings": [np.asarray(o.outputs.embedding) for o in outs]})
    return runs


# ---- report ----------------------------------------------------------------------------------------------------


def cosine_to_reference(embeds: list[Any], corpus: list[str], folder: str, batch_size: int) -> tuple[float, float]:
    """(min, mean) cosine similarity of `embeds` to sentence-transformers' embeddings of `corpus`."""
    ref = _st_model(folder).encode(corpus, batch_size=batch_size, convert_to_numpy=True)
    got = np.stack([np.asarray(e, dtype=np.float64) for e in embeds])
    ref = ref.astype(np.float64)
    cos = (got * ref).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))
    return float(cos.min()), float(cos.mean())


def main(argv: list[str] | None = None, prog: str = DEFAULT_PROG) -> int:
    from pagedllm.benchmarks.structured import _cpu
    from pagedllm.config import default_model_path, model_from_env

    parser = add_arguments(argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0]))
    args = parser.parse_args(argv)
    folder = args.tokenizer or args.model or model_from_env() or default_model_path()
    corpus = make_corpus(folder, args.num_sentences, args.min_words, args.max_words, args.corpus_seed)
    engine = (
        "server " + args.base_url
        if args.base_url
        else "sentence-transformers"
        if args.sentence_transformers
        else "pagedllm offline"
    )
    print(f"CPU: {_cpu()}; {engine}; {len(corpus)} sentences, batch {args.batch_size}", flush=True)
    if args.base_url:
        runs = run_server(args, corpus)
    elif args.sentence_transformers:
        runs = run_sentence_transformers(args, corpus, folder)
    else:
        runs = run_offline(args, corpus)
    best = min(runs, key=lambda r: r["wall"])
    record: dict[str, Any] = {
        "bench": "embed",
        "engine": engine,
        "sentences": len(corpus),
        "tokens": best["tokens"],
        "walls_s": [round(r["wall"], 3) for r in runs],
        "sentences_per_s": len(corpus) / best["wall"],
        "tokens_per_s": best["tokens"] / best["wall"],
    }
    probes = [p for r in runs for p in r.get("probe_s", [])]
    if probes:
        record["probe_p50_ms"] = 1000 * statistics.median(probes)
        record["probe_p90_ms"] = 1000 * float(np.percentile(probes, 90))
        record["probe_count"] = len(probes)
    if args.reference:
        record["cosine_min"], record["cosine_mean"] = cosine_to_reference(
            best["embeddings"], corpus, folder, args.batch_size
        )
    print(
        f"{record['sentences_per_s']:.1f} sentences/s, {record['tokens_per_s']:.0f} input tokens/s "
        f"({record['tokens']} tokens; runs {record['walls_s']} s)"
    )
    if probes:
        p50, p90 = record["probe_p50_ms"], record["probe_p90_ms"]
        print(f"a lone short query under that load: p50 {p50:.1f} ms, p90 {p90:.1f} ms ({len(probes)} sent)")
    if args.reference:
        print(f"cosine to sentence-transformers: min {record['cosine_min']:.7f}, mean {record['cosine_mean']:.7f}")
    print(f"command: {prog} {' '.join(argv if argv is not None else sys.argv[1:])}")
    if args.json_out:
        with open(args.json_out, "a", encoding="utf-8") as f:
            f.write(json.dumps({**record, "argv": argv}) + "\n")
    return 0
