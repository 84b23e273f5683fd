"""Sleep mode on real servers of the default model (vLLM's routes): POST /sleep?level=1|2 lets the requests in flight
finish, then frees the engine's memory (its process's resident memory drops); while asleep generation routes answer
503 naming the sleep (OpenAI's error shape), /health stays 200 and /is_sleeping says so; POST /wake_up restores the
same greedy output. With --sleep-auto-wake a request wakes the model instead. A bad level is a 400 naming it."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.server.server_utils import RemoteServer

COMPLETION = {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "The capital of France is", "max_tokens": 16}


@pytest.fixture(scope="module")
def servers():
    plain = RemoteServer("--enable-sleep-mode", "--enable-debug-routes", start=False)
    auto = RemoteServer("--sleep-auto-wake", start=False)
    try:
        plain.wait_ready()
        auto.wait_ready()
        yield {"plain": plain, "auto": auto}
    finally:
        plain.stop()
        auto.stop()


def _complete(server: RemoteServer, **extra: Any) -> tuple[int, Any]:
    return server.request("POST", "/v1/completions", {**COMPLETION, "temperature": 0, **extra})


def _anon_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("RssAnon:"))


def test_sleep_wake_round_trip(servers: dict[str, RemoteServer]) -> None:
    server = servers["plain"]
    status, body = _complete(server)
    assert status == 200, body
    text = body["choices"][0]["text"]
    pid = server.kv()["core_pid"]
    # A long request in flight when /sleep arrives finishes whole before the model sleeps.
    long: dict[str, Any] = {}

    def run() -> None:
        long["status"], long["body"] = _complete(server, max_tokens=96, ignore_eos=True)

    runner = threading.Thread(target=run)
    runner.start()
    while server.kv()["unfinished"] == 0 and runner.is_alive():
        time.sleep(0.01)
    assert runner.is_alive(), "the long request ended before /sleep was sent"
    awake = _anon_mib(pid)
    assert server.request("POST", "/sleep?level=1")[0] == 200
    runner.join(60)
    assert long["status"] == 200 and long["body"]["usage"]["completion_tokens"] == 96, long
    assert server.request("GET", "/is_sleeping")[1] == {"is_sleeping": True}
    assert _anon_mib(pid) < awake - 50, "sleep gave back less than the weights' memory"
    status, body = _complete(server)
    assert status == 503 and "asleep" in body["error"]["message"], body
    assert body["error"]["type"] == "ServiceUnavailableError"
    status, body = server.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
    assert status == 503, body
    assert server.request("GET", "/health")[0] == 200
    assert server.request("POST", "/wake_up")[0] == 200
    assert server.request("GET", "/is_sleeping")[1] == {"is_sleeping": False}
    status, body = _complete(server)
    assert status == 200 and body["choices"][0]["text"] == text
    assert server.request("POST", "/sleep?level=2")[0] == 200
    assert server.request("POST", "/wake_up")[0] == 200
    status, body = _complete(server)
    assert status == 200 and body["choices"][0]["text"] == text
    server.wait_idle()


@pytest.mark.parametrize("level", ["0", "3", "deep"])
def test_bad_level_is_a_400_naming_it(servers: dict[str, RemoteServer], level: str) -> None:
    status, body = servers["plain"].request("POST", f"/sleep?level={level}")
    assert status == 400 and body["error"]["param"] == "level" and repr(level) in body["error"]["message"], body
    assert servers["plain"].request("GET", "/is_sleeping")[1] == {"is_sleeping": False}


def test_auto_wake(servers: dict[str, RemoteServer]) -> None:
    server = servers["auto"]
    status, body = _complete(server)
    assert status == 200, body
    assert server.request("POST", "/sleep")[0] == 200  # level 1 by default
    assert server.request("GET", "/is_sleeping")[1] == {"is_sleeping": True}
    status, again = _complete(server)
    assert status == 200 and again["choices"][0]["text"] == body["choices"][0]["text"]
    assert server.request("GET", "/is_sleeping")[1] == {"is_sleeping": False}
    assert "engine awake" in server.log_text()
