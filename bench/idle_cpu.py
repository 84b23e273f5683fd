"""Idle CPU of a tensor-parallel engine between requests: `python bench/idle_cpu.py [--backend ray|mp] [--seconds N]`.

Starts an `LLM` with tensor_parallel_size 2 on the default model (for "ray", on a two-node Ray cluster started
here on loopback, one CPU a node, as the tests do), runs one request, then measures the whole machine's busy CPU
time from /proc/stat over N idle seconds, as a percentage of all cores, next to the same measure taken before
anything started (the machine's own background). Prints both and the difference; stops everything it started.
"""

from __future__ import annotations

import argparse
import os
import platform
import time


def busy_fraction(seconds: float) -> float:
    """Busy share of all CPUs over `seconds` (from /proc/stat: everything but idle and iowait)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + fields[4]
        return sum(fields), idle

    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("ray", "mp"), default="ray")
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    baseline = busy_fraction(args.seconds)
    cluster = None
    if args.backend == "ray":
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        os.environ["RAY_ADDRESS"] = cluster.address
    from pagedllm import LLM, SamplingParams

    llm = LLM(
        tensor_parallel_size=2,
        distributed_executor_backend=args.backend,
        max_model_len=1024,
        kv_cache_memory_bytes=256 << 20,
    )
    try:
        llm.generate("Hello", SamplingParams(max_tokens=8), use_tqdm=False)
        time.sleep(3)  # let the request's aftermath settle
        idle = busy_fraction(args.seconds)
    finally:
        llm.engine_core.shutdown()
        if cluster is not None:
            cluster.shutdown()
    print(f"CPU: {cpu_name()}, {os.cpu_count()} CPUs; backend {args.backend}, tensor_parallel_size 2")
    print(f"machine busy before start : {100 * baseline:5.2f}% of all CPUs over {args.seconds:g} s")
    print(f"machine busy, engine idle : {100 * idle:5.2f}% of all CPUs over {args.seconds:g} s")
    print(f"the idle engine's share   : {100 * (idle - baseline):5.2f}%")


if __name__ == "__main__":
    main()
