"""Issue 45's sleep-mode goals on a real server: wake from level-1 sleep to the first token (<= 0.5 s on the default
model), and the resident memory of a sleeping model against an awake one's (<= 10%).

Starts `pagedllm serve` (the default model unless --model; with --enable-debug-routes to learn the engine-core pid),
sends --warm 1-token completions, then --rounds times: POST /sleep?level=L, reads the engine-core process's memory
(/proc VmRSS and RssAnon), then times POST /wake_up followed by a streamed completion up to its first token (the
"wake to first token"), and the same request again awake (its time to first token, for comparison). Memory is
reported three ways: the whole process; above the floor of a process that imported what the engine core imports
(python, torch, pagedllm's engine and worker modules, measured in its own process here); and the level-2 figure
(the workers and the model gone, the process kept).

    python bench/sleep.py [--model PATH] [--rounds 5] [--level 1]
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from serve_proc import ROOT, start_server, stop_server

FLOOR = "import torch, pagedllm.engine.core, pagedllm.worker.model_runner, time; time.sleep(30)"


def memory(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmRSS", "RssAnon"):
            out[key] = int(line.split()[1]) / 1024
    return out


def call(port: int, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def first_token(port: int, prompt: str) -> float:
    """Seconds from sending a streamed completion to its first token."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    while True:
        line = resp.readline()
        if line.startswith(b"data: {"):
            elapsed = time.perf_counter() - start
            break
    resp.read()
    conn.close()
    return elapsed


def floor_memory() -> dict[str, float]:
    code = FLOOR.replace("time.sleep(30)", "print(1, flush=True); time.sleep(30)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        proc.stdout.readline()
        return memory(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--prompt", default="The capital of France is")
    args = ap.parse_args()
    floor = floor_memory()
    flags = ["--enable-debug-routes", "--uvicorn-log-level", "warning"] + ([args.model] if args.model else [])
    proc, port = start_server(flags)
    try:
        pid = json.loads(call(port, "GET", "/debug/kv_cache")[1])["core_pid"]
        for _ in range(args.warm):
            first_token(port, args.prompt)
        awake = memory(pid)
        rows = []
        for level in (1, 2):
            for _ in range(args.rounds):
                assert call(port, "POST", f"/sleep?level={level}")[0] == 200
                asleep = memory(pid)
                start = time.perf_counter()
                assert call(port, "POST", "/wake_up")[0] == 200
                woke = time.perf_counter() - start
                ttft_wake = woke + first_token(port, args.prompt)
                ttft_awake = first_token(port, args.prompt)
                rows.append((level, asleep, woke, ttft_wake, ttft_awake))
        print(f"floor (imports only): {floor}")
        print(f"awake after {args.warm} requests: {awake}")
        for level in (1, 2):
            mine = [r for r in rows if r[0] == level]
            anon = statistics.median(r[1]["RssAnon"] for r in mine)
            rss = statistics.median(r[1]["VmRSS"] for r in mine)
            model_awake = awake["RssAnon"] - floor["RssAnon"]
            above = anon - floor["RssAnon"]
            wake, to_first = statistics.median(r[2] for r in mine), statistics.median(r[3] for r in mine)
            print(
                f"level {level}: asleep VmRSS {rss:.0f} MiB ({rss / awake['VmRSS']:.0%} of awake), RssAnon {anon:.0f} "
                f"MiB; above the floor {above:.0f} of {model_awake:.0f} MiB awake ({above / model_awake:.0%}); "
                f"wake_up {wake:.3f} s, wake to first token median {to_first:.3f} s "
                f"(max {max(r[3] for r in mine):.3f}), "
                f"awake first token {statistics.median(r[4] for r in mine):.3f} s"
            )
    finally:
        stop_server(proc)


if __name__ == "__main__":
    main()
