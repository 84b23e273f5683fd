"""Batch-1 decoding of the default GGUF, as stored against de-quantized to float32: speed, memory, and where the
time goes against the memory-bandwidth limit.

    python bench/quantized_decode.py [--model FILE.gguf] [--output-len 128] [--rounds 3] [--num-threads 2]

Each configuration (quantization gguf, the default; quantization none, the float32 path) runs in a fresh process
with the engine in-process (engine_client="inproc"), and the two alternate round by round (A B, B A, ...). Per
process:
* memory: the process's resident set before and after building the engine (the KV cache is mapped but untouched,
  so not resident), and the bytes the model's weights hold (`pagedllm.model.loader.weight_bytes`);
* decode tok/s as the peer harness measures it: (output_len - 1) / (median time of a full request - median time
  of a 1-token request), one request of 128 random prompt tokens, greedy, ignore_eos;
* the fused decoder's time per token (30 layers) and the LM head's, timed inside the engine during the requests
  (each decode step's forward and the head call after it, medians), and the rest of a step (scheduling, sampling,
  detokenizing, the Python between them): step time minus those two. In brackets the same two called alone in a
  loop on the bound KV cache: faster, since part of the weights then stays in the L3 between calls;
* the memory bandwidth two threads read at (a torch sum over 1 GiB, best of 5), measured before each timed
  request and once after them, the median of those samples (this VM's read rate drifts by 20% within minutes), and
  so the bound on tok/s that reading the weights once a token sets: weight bytes read per token / bandwidth.
`--quantizations gguf` runs the GGUF alone (the float32 copy of a 3B model does not fit beside the page cache).
Prints a markdown table; nothing here is part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def read_bandwidth(num_threads: int, x=None) -> float:
    """GB/s two threads read a 1 GiB float32 tensor at (best of 5 sums); `x` that tensor, made here when None."""
    import torch

    torch.set_num_threads(num_threads)
    x = torch.ones(1 << 28) if x is None else x
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def child(args: argparse.Namespace) -> dict:
    import torch

    import pagedllm
    from pagedllm import LLM, SamplingParams
    from pagedllm.model.kernels import load_cpu_ops
    from pagedllm.model.layers.linear import GENERATED_ROWS

    load_cpu_ops()  # the kernel library is mapped in both configurations before the baseline
    base = rss_bytes()
    llm = LLM(
        model=args.model,
        quantization=args.quantization,
        engine_client="inproc",
        num_threads=args.num_threads,
        kv_cache_memory_bytes="256MiB",
        max_model_len=1024,
    )
    grown = rss_bytes() - base
    runner = llm.engine_core.engine_core.executor.worker.model_runner
    model = runner.model
    from pagedllm.model.loader import weight_bytes, weight_bytes_per_token

    prompt = [int(t) for t in torch.randint(1000, 40000, (128,), generator=torch.Generator().manual_seed(0))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, args.output_len)]
    llm.generate([{"prompt_token_ids": prompt}], params[1], use_tqdm=False)  # warm-up
    # Inside the engine, during the full requests: each fused forward (a decode step's 30 layers) and the head call
    # right after it. Called alone in a loop (below), part of the weights stays in the L3 between calls, so those
    # figures are faster than what a step pays.
    inside: dict[str, list[float]] = {"forward": [], "head": []}
    fused_runner, head_fn, after_fused = runner.decode_runner, model.compute_logits, [False]

    class TimedRunner:
        def __getattr__(self, name: str):
            return getattr(fused_runner, name)

        def __call__(self, *a):
            start = time.perf_counter()
            out = fused_runner(*a)
            inside["forward"].append(time.perf_counter() - start)
            after_fused[0] = True
            return out

    def timed_head(hidden, rows):
        start = time.perf_counter()
        out = head_fn(hidden, rows)
        if after_fused[0]:
            inside["head"].append(time.perf_counter() - start)
        after_fused[0] = False
        return out

    ttft, total, bandwidth = [], [], []
    ones = torch.ones(1 << 28)
    for _ in range(args.iters):
        bandwidth.append(read_bandwidth(args.num_threads, ones))
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params[0], use_tqdm=False)
        ttft.append(time.perf_counter() - start)
        llm.reset_prefix_cache()
        runner.decode_runner, model.compute_logits = TimedRunner(), timed_head
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params[1], use_tqdm=False)
        total.append(time.perf_counter() - start)
        runner.decode_runner = fused_runner
        del model.compute_logits  # the method again
    step = (statistics.median(total) - statistics.median(ttft)) / (args.output_len - 1)
    bandwidth.append(read_bandwidth(args.num_threads, ones))
    del ones

    # The fused decoder alone, at position 128 of a request holding blocks 0-8 (the cache is free now).
    with torch.inference_mode():
        bs = runner.block_size
        ids, pos = torch.tensor([500]), torch.tensor([128])
        slot, table, table_rows = torch.tensor([128]), torch.arange(9).view(1, 9), torch.tensor([0])

        def fused() -> torch.Tensor:
            return runner.decode_runner(ids, pos, slot, table, table_rows)

        assert bs * 9 > 129 and runner.decode_runner is not None
        hidden = fused()

        def per_call(fn, n: int = 50) -> float:
            fn()
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(n):
                    fn()
                best = min(best, (time.perf_counter() - start) / n)
            return best

        forward = per_call(fused)
        # a generated token's row, as the model runner marks it (GGUF: int8 products)
        head = per_call(lambda: model.compute_logits(hidden, GENERATED_ROWS))
    llm.reset_prefix_cache()
    result = {
        "quantization": args.quantization or "gguf",
        "rss_growth": grown,
        "weight_bytes": weight_bytes(model),
        "bytes_per_token": weight_bytes_per_token(model),
        "decode_tok_per_s": 1.0 / step,
        "step_ms": step * 1e3,
        "forward_ms": forward * 1e3,
        "lm_head_ms": head * 1e3,
        "forward_inside_ms": statistics.median(inside["forward"]) * 1e3,
        "lm_head_inside_ms": statistics.median(inside["head"]) * 1e3,
        "bandwidth_gbs": statistics.median(bandwidth),
        "bandwidth_samples": [round(b, 2) for b in bandwidth],
        "pagedllm": pagedllm.__version__,
    }
    llm.shutdown()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: the default model)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--quantizations", default="gguf,none", help="which to run: gguf, none or both")
    parser.add_argument("--quantization", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    if args.model is None:
        from pagedllm.config import default_model_path

        args.model = default_model_path()
    kinds = [q for q in ("gguf", "none") if q in args.quantizations.split(",")]
    if not kinds:
        parser.error(f"--quantizations names neither gguf nor none: {args.quantizations!r}")
    runs: dict[str, list[dict]] = {q: [] for q in kinds}
    for r in range(args.rounds):
        for q in kinds if r % 2 == 0 else kinds[::-1]:
            cmd = [sys.executable, __file__, "--child", "--model", args.model, "--quantization", q]
            cmd += ["--output-len", str(args.output_len), "--iters", str(args.iters)]
            cmd += ["--num-threads", str(args.num_threads)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            runs[q].append(row)
            bound = row["bandwidth_gbs"] * 1e9 / row["bytes_per_token"]
            print(
                f"round {r + 1} {q}: {row['decode_tok_per_s']:.2f} tok/s, {row['decode_tok_per_s'] / bound:.0%} of "
                f"the bound at {row['bandwidth_gbs']:.1f} GB/s (samples {row['bandwidth_samples']})",
                flush=True,
            )
    med = {q: sorted(rows, key=lambda x: x["decode_tok_per_s"])[(len(rows) - 1) // 2] for q, rows in runs.items()}
    print()
    print(
        "| weights | decode tok/s | step ms | fused forward ms, in the engine (alone) | LM head ms, in the engine "
        "(alone) | rest ms | weight MB | read per token MB | read GB/s | bandwidth bound tok/s | RSS growth MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for q, label in (("gguf", "GGUF as stored"), ("none", "float32 (de-quantized)")):
        if q not in med:
            continue
        r = med[q]
        rest = r["step_ms"] - r["forward_inside_ms"] - r["lm_head_inside_ms"]
        bound = r["bandwidth_gbs"] * 1e9 / r["bytes_per_token"]
        print(
            f"| {label} | {r['decode_tok_per_s']:.1f} | {r['step_ms']:.2f} "
            f"| {r['forward_inside_ms']:.2f} ({r['forward_ms']:.2f}) | {r['lm_head_inside_ms']:.2f} "
            f"({r['lm_head_ms']:.2f}) | {rest:.2f} | {r['weight_bytes'] / 1e6:.0f} | {r['bytes_per_token'] / 1e6:.0f} "
            f"| {r['bandwidth_gbs']:.1f} | {bound:.0f} | {r['rss_growth'] / 1e6:.0f} |"
        )
    if len(med) < 2:
        return 0
    g, f = med["gguf"], med["none"]
    speed = g["decode_tok_per_s"] / f["decode_tok_per_s"]
    rounds = {q: ", ".join(f"{x['decode_tok_per_s']:.1f}" for x in runs[q]) for q in runs}
    print(
        f"\nGGUF against float32: {speed:.2f}x decode tok/s, weights {g['weight_bytes'] / f['weight_bytes']:.1%} "
        f"of float32's bytes, RSS growth {g['rss_growth'] / f['rss_growth']:.1%}."
        f"\nrounds (decode tok/s): gguf {rounds['gguf']}; none {rounds['none']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
