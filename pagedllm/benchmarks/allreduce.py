"""All-reduce microbenchmark: `pagedllm bench allreduce`, the shared-memory all-reduce against gloo's.

Contract. ``--world-size`` (2) rank processes are spawned on this machine, each with one torch thread, joined in a
gloo process group on tcp://127.0.0.1:<free port> and in a `ShmAllReduce` over it (distributed/shm_allreduce.py,
``--max-floats`` floats a slot). For each of ``--sizes`` (576, the default model's hidden size, 4096 and 65536
floats), each rank times the same float32 tensor through both: `ShmAllReduce.all_reduce` and
`torch.distributed.all_reduce` on the gloo group. ``--warmup`` (200) untimed calls of each first, then ``--iters``
(2000) timed calls of each, one at a time (`time.perf_counter_ns` around every call), in ``--rounds`` (4) blocks
that alternate shm and gloo, every block starting after a gloo barrier so the ranks enter it together. The figure of
a size is rank 0's median microseconds per call (the ranks move in lockstep; every rank's medians are in the JSON).
Before timing, one random tensor per rank is summed both ways and compared (``agree``: equal to float32 rounding).

The report: the command, the CPU's model name, and per size the shm and gloo medians and gloo/shm.
``--output-json PATH`` writes it with every rank's figures. Nothing here asserts on timings. Exit status: 0; 1 when
the shared-memory all-reduce is unavailable here or a rank failed; 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

DEFAULT_PROG = "pagedllm bench allreduce"
DEFAULT_SIZES = "576,4096,65536"
RANK_TIMEOUT_S = 600.0  # a whole run of the default sizes takes seconds; this only bounds a stuck rank


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from pagedllm.distributed.shm_allreduce import DEFAULT_MAX_FLOATS

    add = parser.add_argument
    add("--world-size", type=int, default=2, help="rank processes (default 2)")
    add("--sizes", default=DEFAULT_SIZES, help=f"float32 elements per all-reduce, comma-separated ({DEFAULT_SIZES})")
    add("--iters", type=int, default=2000, help="timed calls per size and method (default 2000)")
    add("--warmup", type=int, default=200, help="untimed calls per size and method first (default 200)")
    add("--rounds", type=int, default=4, help="alternating shm/gloo blocks the timed calls are split into (4)")
    add("--max-floats", type=int, default=DEFAULT_MAX_FLOATS, help=f"floats per shm slot ({DEFAULT_MAX_FLOATS})")
    add("--output-json", default=None, metavar="PATH", help="write the results as JSON to PATH")
    return parser


def parse_sizes(text: str) -> list[int]:
    """[576, 4096] from "576,4096"; ValueError naming a size that is not a positive integer."""
    sizes = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"sizes must be positive integers, got {item!r}")
        sizes.append(int(item))
    return sizes


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[int]:
    for name, low in (("world_size", 1), ("iters", 1), ("warmup", 0), ("rounds", 1), ("max_floats", 1)):
        if getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')} must be at least {low}, got {getattr(args, name)}")
    try:
        return parse_sizes(args.sizes)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # parser.error exits; this keeps type checkers content


# ---- one rank ------------------------------------------------------------------------------------------------------


def _time_calls(fn: Any, t: Any, count: int) -> list[int]:
    """Nanoseconds of each of `count` calls fn(t)."""
    clock = time.perf_counter_ns
    out = []
    for _ in range(count):
        start = clock()
        fn(t)
        out.append(clock() - start)
    return out


def _rank_target(rank: int, world: int, results: Any, port: int, config: dict[str, Any]) -> list[dict[str, Any]]:
    return _run_rank(rank, world, port, config)


def _run_rank(rank: int, world: int, port: int, config: dict[str, Any]) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    from pagedllm.distributed.shm_allreduce import ShmAllReduce

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=RANK_TIMEOUT_S),
    )
    try:
        shm = ShmAllReduce.create("bench", rank, world, config["max_floats"], group=dist.group.WORLD)
        rows = []
        with shm:
            for n in config["sizes"]:
                x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
                by_shm, by_gloo = shm.all_reduce(x.clone()), x.clone()
                dist.all_reduce(by_gloo)
                # Zeros while timing: the sums stay finite however many calls.
                t = torch.zeros(n)
                for _ in range(config["warmup"]):
                    shm.all_reduce(t)
                    dist.all_reduce(t)
                shm_ns: list[int] = []
                gloo_ns: list[int] = []
                per_round = -(-config["iters"] // config["rounds"])
                for _ in range(config["rounds"]):
                    dist.barrier()
                    shm_ns += _time_calls(shm.all_reduce, t, per_round)
                    dist.barrier()
                    gloo_ns += _time_calls(dist.all_reduce, t, per_round)
                rows.append(
                    {
                        "floats": n,
                        "shm_us": statistics.median(shm_ns) / 1e3,
                        "gloo_us": statistics.median(gloo_ns) / 1e3,
                        "shm_mean_us": statistics.fmean(shm_ns) / 1e3,
                        "gloo_mean_us": statistics.fmean(gloo_ns) / 1e3,
                        "calls": len(shm_ns),
                        "agree": bool(torch.allclose(by_shm, by_gloo, rtol=1e-5, atol=1e-6)),
                    }
                )
        return rows
    finally:
        dist.destroy_process_group()


# ---- the benchmark -------------------------------------------------------------------------------------------------


def run_ranks(world: int, config: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Every rank's rows, in rank order; RuntimeError with a failed rank's traceback. All ranks are stopped."""
    from pagedllm.distributed.net import free_port
    from pagedllm.distributed.spawn import run_in_processes

    try:
        answers = run_in_processes(_rank_target, world, free_port(), config, timeout=RANK_TIMEOUT_S)
    except TimeoutError as e:
        raise RuntimeError(str(e)) from None
    for rank, (ok, value) in enumerate(answers):
        if not ok:
            raise RuntimeError(f"rank {rank} failed:\n{value}")
    return [value for _, value in answers]


def summarize(per_rank: list[list[dict[str, Any]]], args: argparse.Namespace, command: str) -> dict[str, Any]:
    """The report: rank 0's figures per size, every rank's beside them."""
    from pagedllm.benchmarks.startup import cpu_name

    rows = []
    for i, row in enumerate(per_rank[0]):
        ratio = row["gloo_us"] / row["shm_us"] if row["shm_us"] > 0 else None
        rows.append({**row, "gloo_over_shm": ratio, "per_rank": [ranks[i] for ranks in per_rank]})
    return {
        "command": command,
        "cpu": cpu_name(),
        "world_size": args.world_size,
        "iters": args.iters,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "max_floats": args.max_floats,
        "rows": rows,
    }


def print_report(record: dict[str, Any]) -> None:
    print(f"CPU: {record['cpu']}")
    calls = record["rows"][0]["calls"] if record["rows"] else 0
    print(
        f"world size {record['world_size']}, one torch thread per rank; median us per call over {calls} calls "
        f"after {record['warmup']} warm-up calls (rank 0)"
    )
    print(f"{'floats':>10} {'shm us':>10} {'gloo us':>10} {'gloo/shm':>10} {'agree':>6}")
    for row in record["rows"]:
        ratio = "-" if row["gloo_over_shm"] is None else f"{row['gloo_over_shm']:.1f}x"
        agree = "yes" if row["agree"] else "NO"
        print(f"{row['floats']:>10} {row['shm_us']:>10.2f} {row['gloo_us']:>10.2f} {ratio:>10} {agree:>6}")


def main(argv: list[str] | None = None, prog: str = DEFAULT_PROG) -> int:
    parser = add_arguments(
        argparse.ArgumentParser(prog=prog, description="the shared-memory all-reduce against gloo's, on this machine")
    )
    args = parser.parse_args(argv)
    sizes = _validate(parser, args)
    command = shlex.join([*shlex.split(prog), *(sys.argv[1:] if argv is None else argv)])
    from pagedllm.distributed import shm_allreduce

    reason = shm_allreduce.unavailable_reason()
    if reason is not None:
        print(f"the shared-memory all-reduce is unavailable here: {reason}", file=sys.stderr)
        return 1
    print(f"command: {command}", flush=True)
    config = {
        "sizes": sizes,
        "iters": args.iters,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "max_floats": args.max_floats,
    }
    try:
        per_rank = run_ranks(args.world_size, config)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    record = summarize(per_rank, args, command)
    print_report(record)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
