"""Issue 44's "no request can stall the others" goal: while huge prompts are refused, how long do /health and a short
completion take, and how much does the server's resident memory grow?

Starts `pagedllm serve` (the default model unless --model), measures its RSS (the API-server process: /proc VmRSS),
then sends --rounds requests with a prompt of --prompt-mb megabytes (default 20: over the default --max-request-bytes
of 16MiB, a 413; with --prompt-mb 12 the body is read and parsed and the prompt refused by its length in characters,
a 400) from a thread, and meanwhile times GET /health and a 1-token completion back to back. Prints the statuses, the
latencies (max and median; and the completion's alone, before), and the RSS before and after (after a settle of one
second).

    python bench/request_limits.py [--prompt-mb 20] [--rounds 3] [--model PATH]
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import threading
import time
from pathlib import Path

from serve_proc import start_server, stop_server


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def request(port: int, method: str, path: str, body: bytes | None = None) -> tuple[int, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    start = time.perf_counter()
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.status, time.perf_counter() - start
    finally:
        conn.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-mb", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    proc, port = start_server([args.model] if args.model else [])
    try:
        models = http.client.HTTPConnection("127.0.0.1", port)
        models.request("GET", "/v1/models")
        model = json.loads(models.getresponse().read())["data"][0]["id"]
        short = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1}).encode()
        for _ in range(3):  # warm up
            request(port, "POST", "/v1/completions", short)
        alone = [request(port, "POST", "/v1/completions", short)[1] for _ in range(10)]
        time.sleep(1.0)
        before = rss_mb(proc.pid)
        prompt = "word " * int(args.prompt_mb * (1 << 20) / 5)
        big = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1}).encode()
        del prompt
        statuses: list[int] = []

        def send() -> None:
            for _ in range(args.rounds):
                statuses.append(request(port, "POST", "/v1/completions", big)[0])

        sender = threading.Thread(target=send)
        health: list[float] = []
        completion: list[float] = []
        sender.start()
        while sender.is_alive():
            health.append(request(port, "GET", "/health")[1])
            completion.append(request(port, "POST", "/v1/completions", short)[1])
        sender.join()
        time.sleep(1.0)
        after = rss_mb(proc.pid)
        print(f"big requests: {args.rounds} x {len(big) / 1e6:.1f} MB body -> statuses {statuses}")
        for name, times in (("/health", health), ("1-token completion", completion)):
            print(
                f"{name}: {len(times)} answered meanwhile, max {max(times) * 1e3:.1f} ms, "
                f"median {statistics.median(times) * 1e3:.1f} ms"
            )
        print(f"1-token completion alone (before): median {statistics.median(alone) * 1e3:.1f} ms")
        print(f"server RSS: {before:.0f} MB before, {after:.0f} MB after ({after - before:+.0f} MB)")
    finally:
        stop_server(proc)


if __name__ == "__main__":
    main()
