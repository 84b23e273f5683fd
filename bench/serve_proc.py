"""`pagedllm serve` as a child of a benchmark script: `start_server(flags)` launches it on a free loopback port,
waits for its "ready" line and returns (process, port); its output is read on (and dropped) by a thread, so that a
full pipe never blocks the server. `stop_server(proc)` stops it (SIGTERM, then SIGKILL after 60 s)."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"pagedllm server ready at http://([\d.]+):(\d+)")


def start_server(flags: Sequence[str]) -> tuple[subprocess.Popen, int]:
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", "0", "--disable-uvicorn-access-log"]
    proc = subprocess.Popen([*cmd, *flags], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        m = READY.search(line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
            return proc, int(m.group(2))
    stop_server(proc)
    raise RuntimeError(f"the server did not start: {' '.join(flags)}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
