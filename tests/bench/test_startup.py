"""`pagedllm bench startup`: the breakdown parsed from stamped log lines, and one real cold + warm round of
`pagedllm serve` on the default model whose report is checked for its structure (never its timings)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

from pagedllm.benchmarks import startup

# The lines a server logs, stamped in seconds since launch; the totals are chosen so every row is exact.
LINES = [
    (1.0, "INFO 11-23 14:54:05 [api_server.py:371] starting the engine for the API server on 127.0.0.1:5"),
    (3.5, "INFO [tokenizer.py:35] startup: tokenizer 0.50 s (GGUF conversion from the cache)"),
    (5.0, "INFO [core_proc.py:66] startup: engine core imports 0.25 s"),
    (5.5, "INFO [core_proc.py:71] startup: engine config 0.50 s"),
    (6.0, "INFO [weight_cache.py:99] weight cache: hit /tmp/x.safetensors"),
    (8.0, "INFO [loader.py:112] startup: weights 1.50 s (weight cache), packing 0.75 s"),
    (8.0, "INFO [worker.py:30] startup: model runner 2.50 s (kernels, model, weights)"),
    (8.5, "INFO [worker.py:60] startup: KV cache allocation 0.25 s"),
    (9.0, "INFO [api_server.py:374] startup: engine 8.00 s (model config, tokenizer, engine core)"),
]


def test_parse_items_reads_every_item_of_a_line() -> None:
    assert startup.parse_items(LINES[5][1]) == {"weights": 1.5, "packing": 0.75}
    assert startup.parse_items(LINES[1][1]) == {"tokenizer": 0.5}
    assert startup.parse_items("INFO Engine core ready in 4.0 s") == {}


def test_breakdown_rows_add_up_to_the_total() -> None:
    rows, notes = startup.breakdown(LINES, total=10.0)
    assert list(rows) == [key for key, _ in startup.PHASES + startup.FRONT_PHASES]
    assert sum(rows[key] for key, _ in startup.PHASES) == pytest.approx(10.0)
    assert rows == pytest.approx(
        {
            "core_launch": 4.75,  # 5.0 - 0.25 (imports)
            "core_imports": 0.25,
            "core_config": 0.5,
            "kernels": 0.25,  # 2.5 - 1.5 - 0.75
            "weights": 1.5,
            "packing": 0.75,
            "kv_cache": 0.25,
            "core_rest": 0.75,  # (9.0 - 5.0) - 0.5 - 2.5 - 0.25
            "server": 1.0,
            "other": 0.0,
            "front_imports": 1.0,  # the front end's track, in parallel: not in the sum
            "front_config": 2.0,  # 3.5 - 0.5 (tokenizer) - 1.0
            "tokenizer": 0.5,
        }
    )
    assert notes == {"tokenizer": "GGUF conversion from the cache", "weights": "weight cache", "weight_cache": "hit"}


def test_breakdown_without_the_lines_leaves_rows_unknown() -> None:
    rows, _ = startup.breakdown([], total=3.0)
    assert rows["other"] == 3.0
    assert all(v is None for k, v in rows.items() if k != "other")
    assert list(rows) == [key for key, _ in startup.PHASES + startup.FRONT_PHASES]


# A stand-in server: says hello, waits, then answers 200 on /health (and 404 elsewhere) until it is stopped.
FAKE_SERVER = """
import http.server, os, sys, time
open(sys.argv[2], "w").write(str(os.getpid()))
print("hello from the fake server", flush=True)
time.sleep(0.3)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.mark.timeout(60, method="signal")
def test_time_to_health_stamps_the_output_and_stops_the_server(tmp_path: Path) -> None:
    port, pid_file = startup.free_port(), tmp_path / "pid"
    cmd = [sys.executable, "-c", FAKE_SERVER, str(port), str(pid_file)]
    total, lines = startup.time_to_health(cmd, port, dict(os.environ), timeout=30, log_path=str(tmp_path / "log"))
    assert total >= 0.3
    assert [text for _, text in lines] == ["hello from the fake server"]
    assert 0 <= lines[0][0] <= total
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)  # stopped and reaped
    assert "hello from the fake server" in (tmp_path / "log").read_text()


@pytest.mark.timeout(60, method="signal")
def test_time_to_health_reports_a_server_that_exits() -> None:
    cmd = [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match="(?s)status 3.*no model here"):
        startup.time_to_health(cmd, startup.free_port(), dict(os.environ), timeout=30)


def test_peer_commands() -> None:
    ns = argparse.Namespace(peer_cmd="serve-it --port {port} --x", vllm_venv=None, peer_model=None)
    assert startup.peer_cmd(ns, 1234) == ["serve-it", "--port", "1234", "--x"]
    ns = argparse.Namespace(peer_cmd=None, vllm_venv="/v", peer_model="/m")
    cmd = startup.peer_cmd(ns, 1234)
    assert cmd[:4] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model"]
    assert cmd[cmd.index("--port") + 1] == "1234" and cmd[cmd.index("--host") + 1] == "127.0.0.1"


@pytest.mark.timeout(1800, method="signal")  # the signal interrupts the poll; the run's `finally` stops the server
def test_startup_cold_and_warm_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pagedllm.entrypoints.cli import main as cli_main

    out = tmp_path / "startup.json"
    argv = ["bench", "startup", "--runs", "1", "--timeout", "900", "--output-json", str(out)]
    # Engine flags go to `pagedllm serve`: a small KV cache keeps the test light on a shared machine.
    argv += ["--kv-cache-memory", "256MiB", "--max-model-len", "1024"]
    assert cli_main(argv) == 0
    text = capsys.readouterr().out
    record = json.loads(out.read_text())

    assert record["modes"] == ["cold", "warm"]
    assert [(r["engine"], r["mode"], r["round"]) for r in record["runs"]] == [
        ("pagedllm", "cold", 0),
        ("pagedllm", "warm", 0),
    ]
    for run in record["runs"]:
        assert run["total_s"] > 0
        assert set(run["phases"]) == {key for key, _ in startup.PHASES + startup.FRONT_PHASES}
        # Every phase line was logged (no row unknown) and the engine core's path adds up to the total (the front
        # end's rows run beside it).
        assert all(v is not None for v in run["phases"].values()), run["phases"]
        assert sum(run["phases"][key] for key, _ in startup.PHASES) == pytest.approx(run["total_s"])
    cold, warm = (record["median"]["pagedllm"][m] for m in ("cold", "warm"))
    assert cold["notes"]["tokenizer"] == "converted from the GGUF"
    assert warm["notes"]["tokenizer"] == "GGUF conversion from the cache"
    # The default GGUF runs as stored: the cache of de-quantized weights is not used (test_weight_cache.py tests it).
    assert (cold["notes"]["weight_cache"], warm["notes"]["weight_cache"]) == ("off", "off")
    assert "peer" not in record["median"]
    for label in ("time to first 200", *(label for _, label in startup.PHASES + startup.FRONT_PHASES)):
        assert label in text
    assert "AMD" in text or "Intel" in text or "CPU:" in text
