"""Data-parallel against single-engine online throughput at saturation: `python bench/dp_online.py [--rounds N]
[--sizes 1,2] [-- bench serve flags]`.

For each round and each data-parallel size (the order alternates between rounds: 1, 2, 2, 1, ...), starts
`pagedllm serve` on the default model with `-dp SIZE` (same total `--num-threads`, so the engines share the
machine's cores), waits for /health, runs `pagedllm bench serve` (default: 64 random prompts of 256 tokens, 128
output tokens, all sent at once, ignore_eos), and stops the server. Prints each run's output-token and total-token
throughput, then the medians per size and their ratio to the first size. Everything stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from idle_cpu import cpu_name  # noqa: E402

DEFAULT_BENCH = [
    "--dataset-name",
    "random",
    "--random-input-len",
    "256",
    "--random-output-len",
    "128",
    "--num-prompts",
    "64",
    "--ignore-eos",
    "--disable-tqdm",
]
READY = re.compile(r"pagedllm server ready at http://([\d.]+):(\d+)")


def start_server(dp: int, threads: int, log: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", "0"]
    cmd += ["-dp", str(dp), "--num-threads", str(threads), "--max-model-len", "1024"]
    cmd += ["--kv-cache-memory-bytes", "1GiB", "--disable-uvicorn-access-log"]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {log.read_text()[-3000:]}")
        m = READY.search(log.read_text(errors="replace"))
        if m:
            url = f"http://{m.group(1)}:{m.group(2)}"
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return proc, url
            except OSError:
                pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server not ready after 600 s")


def run_once(dp: int, threads: int, bench_args: list[str], workdir: Path) -> dict:
    log = workdir / f"server-dp{dp}-{time.time_ns()}.log"
    proc, url = start_server(dp, threads, log)
    try:
        result_file = f"dp{dp}-{time.time_ns()}.json"
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "serve", "--base-url", url]
        cmd += [*bench_args, "--save-result", "--result-dir", str(workdir), "--result-filename", result_file]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads((workdir / result_file).read_text())
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sizes", default="1,2", help="data-parallel sizes to compare (the first is the baseline)")
    parser.add_argument("--num-threads", type=int, default=os.cpu_count() or 2, help="total threads of the server")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: flags for pagedllm bench serve")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    bench_args = [a for a in args.bench_args if a != "--"] or DEFAULT_BENCH
    runs: dict[int, list[dict]] = {s: [] for s in sizes}
    with tempfile.TemporaryDirectory(prefix="pagedllm-dp-bench-") as tmp:
        for r in range(args.rounds):
            for dp in sizes if r % 2 == 0 else list(reversed(sizes)):
                result = run_once(dp, args.num_threads, bench_args, Path(tmp))
                runs[dp].append(result)
                print(
                    f"round {r + 1} dp={dp}: {result['output_throughput']:.1f} output tok/s, "
                    f"{result['total_token_throughput']:.1f} total tok/s, "
                    f"{result['completed']} completed, median TTFT {result['median_ttft_ms']:.0f} ms",
                    flush=True,
                )
    print(f"CPU: {cpu_name()}, {os.cpu_count()} CPUs; server --num-threads {args.num_threads}")
    print(f"pagedllm bench serve {' '.join(bench_args)}")
    base = statistics.median(r["output_throughput"] for r in runs[sizes[0]])
    for dp in sizes:
        out = statistics.median(r["output_throughput"] for r in runs[dp])
        total = statistics.median(r["total_token_throughput"] for r in runs[dp])
        print(f"dp={dp}: median {out:.1f} output tok/s, {total:.1f} total tok/s, {out / base:.2f}x dp={sizes[0]}")


if __name__ == "__main__":
    main()
