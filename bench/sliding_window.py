"""Sliding-window attention on a long request: the KV blocks it holds and its decode step, at 1k and 8k tokens.

    python bench/sliding_window.py [--model gemma-3-270m-q4_k_m] [--contexts 1024 8192] [--output-len 33]

One request of `context` random prompt tokens and `output-len` greedy tokens (ignore_eos), in process
(engine_client="inproc"), once with the hybrid KV cache manager (window layers keep only their window's blocks) and
once with `--disable-hybrid-kv-cache-manager` (every block of every layer, as full attention). Measured inside the
engine while the request decodes:
* the KV cache bytes the request holds at its last step: blocks held (the null block not counted) x bytes a block;
* the decode step: the executor's execute_model for a step of one token (forward, logits and sampling), median.
The goal of the architectures issue: at 8k, the hybrid request holds <= 30% of the full-attention bytes, and its
decode step is <= 1.5x its step at 1k. Prints a markdown table; nothing here is part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def child(args: argparse.Namespace) -> dict:
    import torch

    from pagedllm import LLM, SamplingParams

    torch.manual_seed(0)
    llm = LLM(
        args.model,
        engine_client="inproc",
        max_model_len=args.context + args.output_len + 16,
        enable_prefix_caching=False,
        disable_hybrid_kv_cache_manager=not args.hybrid,
        num_threads=args.num_threads,
        kv_cache_memory_bytes=args.kv_cache_memory,
    )
    core = llm.engine_core.engine_core
    scheduler, executor = core.scheduler, core.executor
    manager = scheduler.kv_cache_manager
    runner = executor.worker.model_runner
    bytes_per_block = runner.kv_cache_bytes_per_block()
    steps: list[float] = []
    held: list[int] = []
    original = executor.execute_model

    def timed(sched):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        out = original(sched)
        if sched.total_num_scheduled_tokens == 1 and len(sched.num_scheduled_tokens) == 1:
            steps.append(time.perf_counter() - start)
            (req_id,) = sched.num_scheduled_tokens
            held.append(manager.num_held_blocks(req_id))
        return out

    executor.execute_model = timed
    vocab = runner.vocab_size
    prompt = torch.randint(100, vocab - 100, (args.context,)).tolist()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    decode = steps[len(steps) // 4 :]  # past the first steps (caches warming)
    layers = len(runner.model.attention_layers())
    full_blocks = -(-(args.context + args.output_len - 1) // runner.block_size)
    full_bytes = full_blocks * bytes_per_block * layers // runner.kv_layout.slots
    result = {
        "context": args.context,
        "hybrid": args.hybrid,
        "groups": list(runner.kv_layout.windows),
        "step_ms": statistics.median(decode) * 1e3,
        "held_bytes": held[-1] * bytes_per_block,
        "full_bytes": full_bytes,
    }
    llm.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m-q4_k_m")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--output-len", type=int, default=33)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--context", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--hybrid", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)))
        return
    rows = []
    for context in args.contexts:
        for hybrid in (1, 0):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", args.model]
            cmd += ["--context", str(context), "--hybrid", str(hybrid), "--output-len", str(args.output_len)]
            cmd += ["--num-threads", str(args.num_threads), "--kv-cache-memory", args.kv_cache_memory]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            line = next(x for x in out.splitlines() if x.startswith("RESULT "))
            rows.append(json.loads(line.removeprefix("RESULT ")))
            print(rows[-1], file=sys.stderr)
    print(
        "| context | KV cache manager | groups (windows) | bytes held at the last step | of full attention's | "
        "decode step (ms) |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['context']} | {'hybrid' if r['hybrid'] else 'all blocks'} | {r['groups']} | "
            f"{r['held_bytes'] / 2**20:.1f} MiB | {r['held_bytes'] / r['full_bytes']:.0%} | {r['step_ms']:.2f} |"
        )
    by = {(r["context"], r["hybrid"]): r for r in rows}
    lo, hi = min(args.contexts), max(args.contexts)
    for hybrid in (1, 0):
        if (lo, hybrid) in by and (hi, hybrid) in by:
            ratio = by[(hi, hybrid)]["step_ms"] / by[(lo, hybrid)]["step_ms"]
            print(f"\n{'hybrid' if hybrid else 'all blocks'}: step at {hi} / step at {lo} = {ratio:.2f}x")


if __name__ == "__main__":
    main()
