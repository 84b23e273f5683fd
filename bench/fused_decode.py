"""Decode steps of several requests: the fused decoder against the layer-by-layer path, in the same run.

    python bench/fused_decode.py [--model M] [--batch 4,16] [--rounds 4] [--num-prompts N]

Two engines of one model (in-process engine cores): one as it runs by default, where a decode step of any number of
requests runs in the fused decoder (worker/cpu_decode_runner.py), and one whose fused decoder takes single-request
steps only (its runner's `_fused_requests` replaced), so that several requests' decode steps run the model layer by
layer, as before the fused decoder took batches. For each batch size B: `repeat` prompts (a passage
and a request to write it again; pagedllm/benchmarks/datasets.py), B at a time, greedy, each up to its passage's
length; output tokens per second, median of alternating rounds, and how many outputs are identical between the two
(the paths sum in different orders, so greedy tokens may part where two candidates are nearly tied). Prints a
markdown table; nothing here is part of CI.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.datasets import load_tokenizer, sample_repeat


def run(llm: LLM, prompts: list[list[int]], lens: list[int], batch: int) -> tuple[float, list[list[int]]]:
    """Output tokens per second over the prompts, `batch` at a time, and the output token ids."""
    outs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        params = [SamplingParams(temperature=0, max_tokens=n) for n in lens[i : i + batch]]
        got = llm.generate([{"prompt_token_ids": p} for p in prompts[i : i + batch]], params, use_tqdm=False)
        outs += [list(o.outputs[0].token_ids) for o in got]
    return sum(len(o) for o in outs) / (time.perf_counter() - start), outs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model (default: the default GGUF)")
    parser.add_argument("--batch", default="4,16", help="batch sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=0, help="prompts per batch size (default: 2 batches)")
    args = parser.parse_args()
    common: dict[str, Any] = {"engine_client": "inproc", "max_model_len": 2048}
    if args.model:
        common["model"] = args.model
    engines = {"layer by layer": LLM(**common), "fused": LLM(**common)}
    runner = engines["layer by layer"].engine_core.engine_core.executor.worker.model_runner
    if runner.decode_runner is None:
        raise SystemExit("this model has no fused decoder here (not a Llama-family model, or no native kernels)")
    fused_requests = runner._fused_requests

    def lone_only(order: list[str], counts: dict[str, int], spec: dict[str, list[int]]) -> list[str]:
        chosen = fused_requests(order, counts, spec)
        return chosen if len(chosen) == 1 else []

    runner._fused_requests = lone_only  # several decoding requests: layer by layer
    tokenizer = load_tokenizer(engines["fused"].config.model_config.model)
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        repeat = sample_repeat(tokenizer, args.num_prompts or 2 * batch, seed=batch)
        prompts = [r.prompt_token_ids for r in repeat]
        lens = [r.expected_output_len for r in repeat]
        for llm in engines.values():  # warm-up, and the prompts into the prefix cache of both
            run(llm, prompts, lens, batch)
        rates: dict[str, list[float]] = {name: [] for name in engines}
        outs: dict[str, list[list[int]]] = {}
        for r in range(args.rounds):
            for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
                rate, outs[name] = run(engines[name], prompts, lens, batch)
                rates[name].append(rate)
            print(f"batch {batch} round {r + 1}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in rates.items()))
        med = {name: statistics.median(v) for name, v in rates.items()}
        same = sum(a == b for a, b in zip(outs["layer by layer"], outs["fused"]))
        rows.append((batch, med, rates, same, len(prompts)))
    print("\n| batch | layer by layer tok/s | fused tok/s | fused / layer by layer | identical outputs |")
    print("|---|---|---|---|---|")
    for batch, med, _, same, n in rows:
        ratio = med["fused"] / med["layer by layer"]
        print(f"| {batch} | {med['layer by layer']:.1f} | {med['fused']:.1f} | {ratio:.2f}x | {same}/{n} |")
    for batch, _, rates, _, _ in rows:
        listed = "; ".join(f"{n} " + ", ".join(f"{x:.1f}" for x in v) for n, v in rates.items())
        print(f"batch {batch} rounds: {listed}")
    for llm in engines.values():
        llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
