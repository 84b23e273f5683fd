"""Decode speed at a long context with a float32 or a bfloat16 KV cache (--kv-cache-dtype), on the default model.

    python bench/kv_cache_dtype_decode.py --kv-cache-dtype bfloat16 [--requests 1] [--prompt-len 3500]

A warm-up request prefills the first prompt, so with one request the timed run finds it in the prefix cache and
measures decoding alone. Each request's decode rate is its 127 tokens after the first over the time between its
first and last token. Engine in process, 2 threads, greedy, 128 tokens, ignore_eos. Run it once per dtype, on an
idle machine, alternating; figures in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import random
import time

from pagedllm import LLM, SamplingParams

OUTPUT_LEN = 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    parser.add_argument("--requests", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=3500)
    args = parser.parse_args()
    llm = LLM(engine_client="inproc", kv_cache_dtype=args.kv_cache_dtype, num_threads=2, max_model_len=4096)
    rng = random.Random(1)
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(args.prompt_len)]} for _ in range(args.requests)
    ]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    rates = [(OUTPUT_LEN - 1) / (o.metrics.finished_time - o.metrics.first_token_time) for o in outs]
    print(
        f"kv_cache_dtype={args.kv_cache_dtype} requests={args.requests} prompt={args.prompt_len}: wall {wall:.2f} s, "
        f"output {args.requests * OUTPUT_LEN / wall:.1f} tok/s, decode {sum(rates) / len(rates):.1f} tok/s a request"
    )
    llm.shutdown()


if __name__ == "__main__":
    main()
