"""Speculative decoding side by side: one model without and with --speculative-config, in the same run.

    python bench/spec_decode.py [--model M] [--dtype D] [--rounds 3] [--num-prompts 10] [--speculative-config JSON]

Workloads (greedy; each engine in its own in-process engine core; in each round the two take turns prompt by prompt,
a batch at a time at batch 16, the first alternating, and each one's rate is its tokens over its time):
* repeat, batch 1: `--num-prompts` prompts of the `repeat` dataset (pagedllm/benchmarks/datasets.py: a passage and a
  request to write it again; the default 10 holds each of its 5 passages twice), one request at a time, each up to
  its passage's length. The tokens of the two engines must be identical (checked: the run fails otherwise).
* random, batch 1: as many random-token prompts (128 tokens in, 128 out, ignore_eos), one at a time, greedy (a
  small model's greedy continuation of noise soon loops, which the n-gram proposer catches), and the same sampled
  at temperature 1 with a seed per request: text that does not repeat, where speculation can only cost. Seeded
  output does not change with speculation: those tokens must be identical too.
* repeat, batch 16: 16 repeat prompts submitted together.
It prints each workload's output tokens per second (median over the rounds) for both engines and their ratio (and
the range of the rounds' own ratios: this VM's memory bandwidth moves between runs, and the plain engine with it), the
draft acceptance of the speculative engine, and the CPU; `--out` writes it all as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import numpy as np

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.datasets import load_tokenizer, sample_repeat

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
    isa = "avx512_bf16" if "avx512_bf16" in flags else "avx512f" if "avx512f" in flags else "avx2"
    return f"{name} ({isa})"


def run(
    llm: LLM, prompts: list[list[int]], lens: list[int], first: int, ignore_eos: bool, temperature: float = 0.0
) -> tuple[int, float, list[list[int]]]:
    """One chunk of a workload's prompts (numbered from `first`, the seed of a sampled one being its number) together:
    its output tokens, the seconds it took, and their token ids."""
    params = [
        SamplingParams(temperature=temperature, seed=first + j, max_tokens=n, ignore_eos=ignore_eos)
        for j, n in enumerate(lens)
    ]
    start = time.perf_counter()
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    outs = [list(o.outputs[0].token_ids) for o in got]
    return sum(map(len, outs)), seconds, outs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model (default: the default GGUF)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--speculative-config", default=DEFAULT_SPEC)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--only", default=None, help="run only the workloads whose name contains this")
    args = parser.parse_args()

    common: dict[str, Any] = {"engine_client": "inproc", "dtype": args.dtype, "max_model_len": 2048}
    if args.model:
        common["model"] = args.model
    engines = {"plain": LLM(**common), "spec": LLM(speculative_config=args.speculative_config, **common)}
    tokenizer = load_tokenizer(engines["plain"].config.model_config.model)
    repeat = sample_repeat(tokenizer, args.num_prompts, seed=args.seed)
    repeat16 = sample_repeat(tokenizer, 16, seed=args.seed + 1)
    rng = np.random.default_rng(args.seed)
    random_prompts = [rng.integers(100, 40000, size=128).tolist() for _ in range(args.num_prompts)]
    workloads = {
        "repeat, batch 1": (
            [r.prompt_token_ids for r in repeat],
            [r.expected_output_len for r in repeat],
            1,
            False,
            0.0,
        ),
        "random, batch 1": (random_prompts, [128] * len(random_prompts), 1, True, 0.0),
        "random T=1, batch 1": (random_prompts, [128] * len(random_prompts), 1, True, 1.0),
        "repeat, batch 16": (
            [r.prompt_token_ids for r in repeat16],
            [r.expected_output_len for r in repeat16],
            16,
            False,
            0.0,
        ),
    }
    if args.only:
        workloads = {w: v for w, v in workloads.items() if args.only in w}
    for llm in engines.values():  # warm-up: the kernels, the first steps' allocations
        run(llm, [random_prompts[0]], [8], 0, True)
    rates: dict[str, dict[str, list[float]]] = {w: {e: [] for e in engines} for w in workloads}
    tokens: dict[str, dict[str, list]] = {w: {} for w in workloads}
    spec_core = engines["spec"].engine_core.engine_core
    stats = spec_core.scheduler.total_spec_stats
    accept: dict[str, list[int]] = {w: [0, 0, 0] for w in workloads}
    for r in range(args.rounds):
        for w, (prompts, lens, batch, ignore_eos, temperature) in workloads.items():
            done = {e: [0, 0.0] for e in engines}  # output tokens, seconds
            outs: dict[str, list[list[int]]] = {e: [] for e in engines}
            for c, i in enumerate(range(0, len(prompts), batch)):
                # Chunk by chunk (a prompt at batch 1), the engines taking turns, the first one alternating: both
                # see the VM in the same state, where a whole workload on one engine then on the other may not.
                order = list(engines) if (r + c) % 2 == 0 else list(engines)[::-1]
                for name in order:
                    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
                    n, seconds, got = run(
                        engines[name], prompts[i : i + batch], lens[i : i + batch], i, ignore_eos, temperature
                    )
                    done[name][0] += n
                    done[name][1] += seconds
                    outs[name].extend(got)
                    if name == "spec":
                        now = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
                        accept[w] = [a + x - b for a, x, b in zip(accept[w], now, before)]
            for name in engines:
                rates[w][name].append(done[name][0] / done[name][1])
                tokens[w].setdefault(name, outs[name])
            ratio = rates[w]["spec"][-1] / rates[w]["plain"][-1]
            print(
                f"round {r + 1} {w}: " + ", ".join(f"{e} {rates[w][e][-1]:.1f} tok/s" for e in engines),
                f"(ratio {ratio:.2f}x)",
                flush=True,
            )
    same = all(
        tokens[w]["plain"] == tokens[w]["spec"] for w in ("repeat, batch 1", "random T=1, batch 1") if w in tokens
    )
    result: dict[str, Any] = {
        "cpu": cpu_name(),
        "model": engines["plain"].config.model_config.model,
        "dtype": args.dtype,
        "speculative_config": json.loads(args.speculative_config),
        "rounds": args.rounds,
        "identical_tokens_batch1": same,
        "workloads": {},
    }
    print(f"\nCPU: {result['cpu']}\nmodel: {result['model']} ({args.dtype})\n")
    print(f"{'workload':<20} {'plain tok/s':>12} {'spec tok/s':>11} {'ratio':>7} {'rounds':>12} {'accepted':>16}")
    for w in workloads:
        plain, spec = statistics.median(rates[w]["plain"]), statistics.median(rates[w]["spec"])
        drafts, drafted, accepted = accept[w]
        result["workloads"][w] = {
            "plain_tok_s": plain,
            "spec_tok_s": spec,
            "ratio": spec / plain,
            "round_ratios": [s / p for s, p in zip(rates[w]["spec"], rates[w]["plain"])],
            "drafts": drafts,
            "draft_tokens": drafted,
            "accepted_tokens": accepted,
        }
        share = f"{accepted}/{drafted}" if drafted else "no drafts"
        each = result["workloads"][w]["round_ratios"]
        span = f"{min(each):.2f}-{max(each):.2f}x"
        print(f"{w:<20} {plain:>12.1f} {spec:>11.1f} {spec / plain:>6.2f}x {span:>12} {share:>16}")
    print(f"\ntokens identical (repeat greedy and random seeded, batch 1): {same}")
    for llm in engines.values():
        llm.shutdown()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
