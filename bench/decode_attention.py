"""Decode attention alone: one decode step's paged attention over every layer of a batch, native kernels only.

    python bench/decode_attention.py [--requests 64] [--context 320] [--layers 30] [--rounds 3]
                                     [--kv-dtype bfloat16,float32] [--lib A.so --lib B.so ...]

The shape is SmolLM2-135M's (9 query heads, 3 KV heads of 64, blocks of 16 tokens) at a batched decode step: each
request's context drawn in [context / 2, context], its blocks scattered over the cache, one cache per layer so that
a step streams them all from memory (30 layers of 64 x 320 tokens: ~350 MB in bfloat16, far beyond L3), as the
engine does. It prints, per KV dtype, the time of one step (the best of 4 passes a round, the median over rounds)
and the KV bytes it read per second. `--lib` takes kernel builds to compare in the same run, alternating round by
round (`pagedllm._C.CpuOps(path)`, e.g. the `.so` of another commit); without it, the installed kernels.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.model.kernels import load_cpu_ops

HQ, HKV, HEAD, BLOCK = 9, 3, 64, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--context", type=int, default=320)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-dtype", default="bfloat16,float32")
    parser.add_argument("--lib", action="append", default=[], help="a kernel build to time (repeatable)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from pagedllm import _C as C  # after torch, whose libraries it links

    libs = {path: C.CpuOps(path) for path in args.lib} or {"installed": load_cpu_ops()}
    g = torch.Generator().manual_seed(0)
    n, width = args.requests, -(-args.context // BLOCK)
    blocks = n * width + 8
    for name in args.kv_dtype.split(","):
        dtype = getattr(torch, name)
        caches = [
            tuple(torch.randn(blocks, BLOCK, HKV, HEAD, generator=g).to(dtype) for _ in range(2))
            for _ in range(args.layers)
        ]
        table = torch.randperm(blocks, generator=g)[: n * width].view(n, width).contiguous()
        lens = torch.randint(args.context // 2, args.context + 1, (n,), generator=g)
        q = torch.randn(n, HQ, HEAD, generator=g)
        kv_bytes = int(lens.sum()) * HKV * HEAD * 2 * caches[0][0].element_size() * args.layers
        times: dict[str, list[float]] = {lib: [] for lib in libs}
        outs = {}
        for r in range(args.rounds):
            for lib in list(libs) if r % 2 == 0 else list(libs)[::-1]:
                ops, out = libs[lib], torch.empty_like(q)
                best = float("inf")
                for _ in range(4):
                    start = time.perf_counter()
                    for k_cache, v_cache in caches:
                        ops.paged_decode_attention(out, q, k_cache, v_cache, table, lens, HEAD**-0.5)
                    best = min(best, time.perf_counter() - start)
                times[lib].append(best)
                outs[lib] = out
        first = next(iter(outs.values()))
        diff = max(float((o - first).abs().max()) for o in outs.values())
        print(f"{name} KV, {n} requests, context {args.context // 2}-{args.context}, {args.layers} layers:")
        for lib, ts in times.items():
            t = statistics.median(ts)
            rounds = ", ".join(f"{x * 1e3:.1f}" for x in ts)
            print(f"  {lib}: {t * 1e3:.2f} ms a step ({kv_bytes / t / 1e9:.1f} GB/s of KV; rounds {rounds} ms)")
        if len(outs) > 1:
            print(f"  largest difference between the builds' outputs: {diff:.2e}")


if __name__ == "__main__":
    main()
