"""What the sampler costs a decode step: output tokens per second of one in-process engine, greedy against sampled.

    python bench/sampling.py [--model M] [--batch 1,16] [--rounds 2] [--max-tokens 128]
    python bench/sampling.py --sampler-only [--batch 1,16,64] [--calls 30]

For each batch size, `--batch` copies of one prompt generate `--max-tokens` tokens each (ignore_eos) under five
sampling settings: greedy; temperature 0.8; temperature 0.8 with top_p 0.9; with top_k 50; and with a seed per
request (a seeded row's uniform comes from its seed and output position, not the default RNG). The settings take
turns within each round; each line shows every round's tokens per second and the best, and the time spent in the
model runner's sampling (`_sample`, wrapped with a timer) per step that samples, the median over the rounds: unlike the
rates, which this VM moves by 20% between runs, it is the sampler's own. Before/after comparisons: run it once per tree,
the trees alternating, with `PYTHONPATH=<tree>` (this script imports nothing that a tree without it lacks).

`--sampler-only` times the sampler alone, in process: one call of `Sampler` with the native CPU kernels on rows of
49152 logits `randn * 3` (a nucleus of ~1800 tokens at top_p 0.9, far more than a model's rows: the filter's worst
case) under the same settings, the median of `--calls` calls, in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagedllm import LLM, SamplingParams

SETTINGS = {
    "greedy": {"temperature": 0.0},
    "temperature 0.8": {"temperature": 0.8},
    "temperature 0.8, top_p 0.9": {"temperature": 0.8, "top_p": 0.9},
    "temperature 0.8, top_k 50": {"temperature": 0.8, "top_k": 50},
    "temperature 0.8, seeded": {"temperature": 0.8},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--sampler-only", action="store_true", help="time the sampler alone (see above)")
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    if args.sampler_only:
        sampler_only([int(b) for b in args.batch.split(",")], args.calls)
        return
    kwargs = {"model": args.model} if args.model else {}
    llm = LLM(engine_client="inproc", max_model_len=2048, num_threads=2, **kwargs)
    runner = llm.engine_core.engine_core.executor.worker.model_runner
    spent = [0.0, 0]  # seconds in the runner's sampling, calls
    sample = runner._sample

    def timed_sample(*a: object) -> object:
        start = time.perf_counter()
        out = sample(*a)
        spent[0] += time.perf_counter() - start
        spent[1] += 1
        return out

    runner._sample = timed_sample
    prompt = "The history of the city begins"
    for batch in (int(b) for b in args.batch.split(",")):
        seen: dict[str, list[float]] = {name: [] for name in SETTINGS}
        per_step: dict[str, list[float]] = {name: [] for name in SETTINGS}
        for _ in range(args.rounds):
            for name, setting in SETTINGS.items():
                params = [
                    SamplingParams(
                        max_tokens=args.max_tokens, ignore_eos=True, seed=i if "seeded" in name else None, **setting
                    )
                    for i in range(batch)
                ]
                spent[:] = [0.0, 0]
                start = time.perf_counter()
                llm.generate([prompt] * batch, params, use_tqdm=False)
                seen[name].append(batch * args.max_tokens / (time.perf_counter() - start))
                per_step[name].append(spent[0] / max(1, spent[1]))
        for name, figures in seen.items():
            rounds = ", ".join(f"{x:.1f}" for x in figures)
            ms = statistics.median(per_step[name]) * 1e3
            print(
                f"batch {batch:3d}  {name:28s} {rounds}  best {max(figures):.1f} tok/s  sampler {ms:.2f} ms/step",
                flush=True,
            )
    llm.shutdown()


def sampler_only(batches: list[int], calls: int) -> None:
    import torch

    from pagedllm.model.kernels import load_cpu_ops
    from pagedllm.sample.metadata import SamplingMetadata
    from pagedllm.sample.sampler import Sampler

    torch.set_num_threads(2)
    sampler, vocab = Sampler(load_cpu_ops()), 49152
    for batch in batches:
        logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch)) * 3
        cells = []
        for name, setting in SETTINGS.items():
            params = [SamplingParams(seed=i if "seeded" in name else None, **setting) for i in range(batch)]
            metadata = SamplingMetadata.from_requests(
                params, [[0]] * batch, [[] for _ in range(batch)], [None] * batch, vocab, torch.device("cpu")
            )
            sampler(logits, metadata)
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                sampler(logits, metadata)
                times.append(time.perf_counter() - start)
            cells.append(f"{name} {statistics.median(times) * 1e3:.3f}")
        print(f"batch {batch:3d}: " + ", ".join(cells) + " ms", flush=True)


if __name__ == "__main__":
    main()
