"""What the sampler costs a decode step: output tokens per second of one in-process engine, greedy against sampled.

    python bench/sampling.py [--model M] [--batch 1,16] [--rounds 2] [--max-tokens 128]

For each batch size, `--batch` copies of one prompt generate `--max-tokens` tokens each (ignore_eos) under five
sampling settings: greedy; temperature 0.8; temperature 0.8 with top_p 0.9; with top_k 50; and with a seed per
request (a seeded row's uniform comes from its seed and output position, not the default RNG). The settings take
turns within each round; each line shows every round and the best. Before/after comparisons: run it once per tree,
the trees alternating, with `PYTHONPATH=<tree>` (this script imports nothing that a tree without it lacks).
"""

from __future__ import annotations

import argparse
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
    args = parser.parse_args()
    kwargs = {"model": args.model} if args.model else {}
    llm = LLM(engine_client="inproc", max_model_len=2048, num_threads=2, **kwargs)
    prompt = "The history of the city begins"
    for batch in (int(b) for b in args.batch.split(",")):
        seen: dict[str, list[float]] = {name: [] for name in SETTINGS}
        for _ in range(args.rounds):
            for name, setting in SETTINGS.items():
                params = [
                    SamplingParams(
                        max_tokens=args.max_tokens, ignore_eos=True, seed=i if "seeded" in name else None, **setting
                    )
                    for i in range(batch)
                ]
                start = time.perf_counter()
                llm.generate([prompt] * batch, params, use_tqdm=False)
                seen[name].append(batch * args.max_tokens / (time.perf_counter() - start))
        for name, figures in seen.items():
            rounds = ", ".join(f"{x:.1f}" for x in figures)
            print(f"batch {batch:3d}  {name:28s} {rounds}  best {max(figures):.1f} tok/s", flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
