"""Before and after for the fused decoder: two or more builds of the native CPU kernels, each driving the fused
decoder over the same model and KV cache in one process, taking turns.

    python bench/fused_decoder_ab.py BUILD.so [BUILD.so ...] [--rows 1,5,16] [--context 150,300] [--rounds 15]

A build is a `pagedllm/_cpu_<isa>*.so` (of this tree, or of another one compiled for this CPU). The script starts an
in-process engine on the model (default: the default GGUF), fills one request's KV cache with a long prompt, and
makes one decoder per build over the engine's own weights and cache (`worker/cpu_decode_runner.py`, each with
`pagedllm._C.CpuOps(build)`); the installed build is the first, "installed". For each row count R and context c: R
consecutive tokens of that request at positions c .. c + R - 1 (a decode token and its drafts, as a verify step
runs them). Per round, each decoder in turn makes `--calls` calls and keeps their median; the line shows each
build's median over the rounds (ms per call) and whether all builds gave the same hidden states, bit for bit.

Why in one process: on a shared VM the same build measured in two processes a minute apart differs by 20% and more
(memory bandwidth moves), while builds taking turns a few milliseconds apart see the same machine. Stop other work
first: two cores are all there is. Nothing here is part of CI.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.worker.cpu_decode_runner import CpuDecodeRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("builds", nargs="+", help="paths of kernel builds (.so) to compare with the installed one")
    parser.add_argument("--rows", default="1,5,16")
    parser.add_argument("--context", default="150,300", help="positions of each call's first token")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20, help="calls per build and round")
    parser.add_argument("--model", default=None, help="model (default: the default GGUF)")
    args = parser.parse_args()
    import pagedllm._C as C

    rows_list = [int(r) for r in args.rows.split(",")]
    contexts = [int(c) for c in args.context.split(",")]
    longest = max(contexts) + max(rows_list)
    kwargs = {"engine_client": "inproc", "max_model_len": longest + 64}
    if args.model:
        kwargs["model"] = args.model
    llm = LLM(**kwargs)
    # One request's cache up to the longest context: its blocks are 0, 1, ... (the first request of a fresh engine).
    llm.generate([{"prompt_token_ids": list(range(100, 100 + longest))}], SamplingParams(max_tokens=1), use_tqdm=False)
    runner = llm.engine_core.engine_core.executor.worker.model_runner
    assert runner.decode_runner is not None, "this model does not run in the fused decoder"
    decoders = {"installed": runner.decode_runner}
    for i, so in enumerate(args.builds):
        decoders[f"{i + 1}:{so.rsplit('/', 1)[-1]}"] = CpuDecodeRunner(runner.model, C.CpuOps(so))
    block = runner.block_size
    table = torch.arange(0, -(-(longest + 1) // block), dtype=torch.int64).reshape(1, -1).contiguous()
    print(f"model {llm.config.model_config.model}; builds: {', '.join(decoders)}")
    with torch.inference_mode():
        for rows in rows_list:
            for ctx in contexts:
                pos = torch.arange(ctx, ctx + rows, dtype=torch.int64)
                ids = torch.full((rows,), 500, dtype=torch.int64)
                which = torch.zeros(rows, dtype=torch.int64)
                outs = [dec(ids, pos, pos.clone(), table, which) for dec in decoders.values()]
                same = all(torch.equal(outs[0], o) for o in outs[1:])
                times: dict[str, list[float]] = {name: [] for name in decoders}
                for _ in range(args.rounds):
                    for name, dec in decoders.items():
                        calls = []
                        for _ in range(args.calls):
                            start = time.perf_counter()
                            dec(ids, pos, pos.clone(), table, which)
                            calls.append(time.perf_counter() - start)
                        times[name].append(statistics.median(calls))
                cells = "  ".join(f"{name} {1e3 * statistics.median(t):.3f}" for name, t in times.items())
                print(f"rows {rows:3d} context {ctx:5d}: {cells} ms  (identical: {same})", flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
