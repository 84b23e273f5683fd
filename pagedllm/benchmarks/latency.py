"""Batch latency benchmark: `pagedllm bench latency` (modelled on `vllm bench latency`), through `LLM`.

Contract. One batch of ``--batch-size`` (8) requests, each ``--input-len`` (32) random token ids (uniform in
``[100, vocab_size)``, seeded) and ``--output-len`` (128) output tokens with ``ignore_eos`` and greedy
sampling, is submitted at once to `LLM.generate`, with the prefix cache reset first so no iteration reuses
cached prompt KV. Each iteration is one call, and all three figures come from that same call:

* batch latency: wall time from submitting the batch until `generate` returns;
* prefill: wall time from submitting the batch until its last request's first token (the latest
  ``RequestOutput.metrics.first_token_time``), that is until the whole batch is past its prompt;
* decode per token: ``(batch latency - prefill) / (output_len - 1)``.

The first token of every request is stamped before `generate` returns, so prefill <= batch latency and decode
per token >= 0 by construction (both are taken on the one wall clock, `time.time()`, that stamps the metrics).

``--num-iters-warmup`` (2) untimed iterations run first, then ``--num-iters`` (5) timed ones; the report gives the
mean and the 50th/90th/99th percentiles of each over the timed iterations. ``--output-json PATH`` writes them,
every iteration's numbers and all arguments. Engine flags are `pagedllm serve`'s, from `EngineArgs.add_cli_args`
(``[MODEL]``, ``--model``, ``--max-model-len``, ``--kv-cache-memory-bytes``, ...). Bad input exits with status 2
and names the value.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from typing import Any

import numpy as np

DEFAULT_PROG = "pagedllm bench latency"
PERCENTILES = (50, 90, 99)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from pagedllm.engine.arg_utils import EngineArgs

    EngineArgs.add_cli_args(parser, positional_model=True)
    add = parser.add_argument
    add("--batch-size", type=int, default=8, help="requests in the batch (default 8)")
    add("--input-len", type=int, default=32, help="prompt tokens per request (default 32)")
    add("--output-len", type=int, default=128, help="output tokens per request (default 128)")
    add("--num-iters-warmup", type=int, default=2, help="untimed iterations first (default 2)")
    add("--num-iters", type=int, default=5, help="timed iterations (default 5)")
    add("--output-json", default=None, metavar="PATH", help="write the results as JSON to PATH")
    add("--disable-tqdm", action="store_true", help="no progress bar")
    return parser


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name, low in (("batch_size", 1), ("input_len", 1), ("output_len", 2), ("num_iters", 1)):
        if getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')} must be at least {low}, got {getattr(args, name)}")
    if args.num_iters_warmup < 0:
        parser.error(f"--num-iters-warmup must be >= 0, got {args.num_iters_warmup}")


def stats(values: list[float]) -> dict[str, float]:
    """{"avg": mean, "p50": ..., "p90": ..., "p99": ...} of `values` (numpy's linear interpolation)."""
    arr = np.asarray(values, dtype=np.float64)
    return {"avg": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


class BatchTimer:
    """Times one batch on an `LLM`: batch latency and prefill from the same `generate` call."""

    def __init__(self, llm: Any, args: argparse.Namespace) -> None:
        from pagedllm import SamplingParams
        from pagedllm.benchmarks.throughput import make_workload

        self.llm = llm
        vocab = int(llm.config.model_config.vocab_size)
        work = make_workload(args.batch_size, (args.input_len,) * 2, (args.output_len,) * 2, vocab, args.seed)
        self.prompts = [{"prompt_token_ids": p} for p in work.prompts]
        self.params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        self.output_len = args.output_len

    def iteration(self) -> tuple[float, float]:
        """(prefill s, batch latency s) of one call; 0 <= prefill <= batch latency."""
        self.llm.reset_prefix_cache()
        # time.time(): the clock that stamps RequestOutput.metrics, so both figures are on one clock.
        start = time.time()
        outs = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        end = time.time()
        lens = {len(o.outputs[0].token_ids) for o in outs}
        assert lens == {self.output_len}, f"expected {self.output_len} output tokens per request, got {sorted(lens)}"
        first_tokens = [o.metrics.first_token_time for o in outs if o.metrics is not None]
        assert len(first_tokens) == len(outs) and None not in first_tokens, "a request has no first-token time"
        full = max(end - start, 0.0)
        # Clamped: a wall-clock step back during the call must not produce a negative or inverted figure.
        prefill = min(max(max(first_tokens) - start, 0.0), full)
        return prefill, full


def run(args: argparse.Namespace, command: str) -> int:
    from tqdm import tqdm

    from pagedllm import LLM
    from pagedllm.engine.arg_utils import EngineArgs

    print(f"command: {command}", flush=True)
    llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args)))
    try:
        max_len = llm.config.model_config.max_model_len
        if args.input_len + args.output_len > max_len:
            raise ValueError(
                f"--input-len {args.input_len} + --output-len {args.output_len} exceeds max_model_len {max_len}"
            )
        if args.batch_size > llm.config.scheduler_config.max_num_seqs:
            print(f"WARNING: --batch-size {args.batch_size} exceeds --max-num-seqs: the batch runs in parts")
        timer = BatchTimer(llm, args)
        total = args.num_iters_warmup + args.num_iters
        prefills, fulls = [], []
        for i in tqdm(range(total), desc="iterations", file=sys.stderr, disable=args.disable_tqdm):
            prefill, full = timer.iteration()
            if i >= args.num_iters_warmup:
                prefills.append(prefill)
                fulls.append(full)
        model = llm.config.model_config.model
    finally:
        llm.shutdown()
    decodes = [(f - p) / (args.output_len - 1) for p, f in zip(prefills, fulls)]
    record = {
        "command": command,
        "model": model,
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_iters": args.num_iters,
        "latency_s": stats(fulls),
        "prefill_s": stats(prefills),
        "decode_per_token_s": stats(decodes),
        "avg_latency": float(np.mean(fulls)),
        "latencies": fulls,
        "prefill_latencies": prefills,
        "decode_per_token_latencies": decodes,
        "args": vars(args),
    }
    print_report(record)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {args.output_json}")
    return 0


def print_report(record: dict[str, Any]) -> None:
    print(
        f"\nbatch {record['batch_size']} x ({record['input_len']} prompt + {record['output_len']} output tokens), "
        f"{record['num_iters']} timed iterations"
    )
    print(f"{'':<28}{'avg':>10}" + "".join(f"{f'p{p}':>10}" for p in PERCENTILES))
    for label, key, scale in (
        ("batch latency (s)", "latency_s", 1.0),
        ("prefill, first token (ms)", "prefill_s", 1e3),
        ("decode per token (ms)", "decode_per_token_s", 1e3),
    ):
        row = record[key]
        print(f"{label:<28}" + "".join(f"{row[k] * scale:>10.2f}" for k in ("avg", *(f"p{p}" for p in PERCENTILES))))


def main(argv: list[str] | None = None, prog: str = DEFAULT_PROG) -> int:
    """Parse `argv` (default: sys.argv[1:]) and run; `prog` names the command in help and in the output."""
    parser = add_arguments(argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0]))
    args = parser.parse_args(argv)
    _validate(parser, args)
    command = shlex.join([*shlex.split(prog), *(sys.argv[1:] if argv is None else argv)])
    try:
        return run(args, command)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
