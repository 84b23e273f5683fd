"""The server-test harness: a real `pagedllm serve` subprocess and small HTTP helpers.

`RemoteServer` starts `python -m pagedllm.entrypoints.cli serve --port 0 ...` (the OS picks a free loopback
port; the server names it in its "ready at" log line), waits until /health answers, and stops the server
with SIGTERM. The session-wide `server` (conftest.py) has an API key and the debug routes, and is shared by every test
file that does not need a server of its own; tests talk to it with the official `openai` client or, for
what that client hides (status codes, raw SSE, dropped connections), with `http.client` from the stdlib.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key-123"
START_TIMEOUT_S = 300.0
COMMON_ARGS = ["--max-model-len", "1024", "--kv-cache-memory", "128MiB", "--disable-uvicorn-access-log"]
_READY = re.compile(r"pagedllm server ready at (https?)://([\d.]+):(\d+)")
_READY_UDS = re.compile(r"pagedllm server ready at unix:\S+ \((https?)\)")


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over a Unix domain socket (a server started with --uds)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


# The tool schemas the tool-calling tests share (tight: bounded strings, no extra keys, so a small model's
# constrained calls end).
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 20}},
    "required": ["timezone"],
    "additionalProperties": False,
}


class RemoteServer:
    def __init__(
        self,
        *args: str,
        api_key: str | None = None,
        env: dict[str, str] | None = None,
        start: bool = True,
        new_session: bool = False,
        ca_file: str | None = None,
        uds: str | None = None,
    ) -> None:
        """`api_key`: the key clients send; passed as --api-key unless `env` sets $PAGEDLLM_API_KEY. `new_session`:
        the server leads a process group of its own (with its engine core), as a terminal's foreground job does, so
        that a test can send a signal to the whole group as Ctrl-C does. `ca_file`: the certificate an HTTPS server
        (--ssl-certfile) is verified against. `uds`: the server listens on this Unix socket (--uds)."""
        self.api_key = api_key
        self.uds = uds
        self.ca_file = ca_file
        self.scheme = "http"
        self.log = tempfile.NamedTemporaryFile(prefix="pagedllm-server-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", "0", *COMMON_ARGS, *args]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        full_env.pop("PAGEDLLM_API_KEY", None)
        full_env.update(env or {})
        if api_key and "PAGEDLLM_API_KEY" not in full_env:
            cmd += ["--api-key", api_key]
        if uds:
            cmd += ["--uds", uds]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=full_env, start_new_session=new_session
        )
        self.host = "127.0.0.1"
        self.port: int | None = None
        if start:
            self.wait_ready()

    # ---- life cycle ---------------------------------------------------------------------------------

    def log_text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}")
            if self.port is None:
                m = _READY.search(self.log_text())
                if m:
                    self.scheme, self.host, self.port = m.group(1), m.group(2), int(m.group(3))
                m = _READY_UDS.search(self.log_text()) if self.uds else None
                if m:
                    self.scheme, self.port = m.group(1), 0
            if self.port is not None:
                try:
                    if self.request("GET", "/health", timeout=5)[0] == 200:
                        return
                except OSError:
                    pass
            time.sleep(0.25)
        self.stop(signal.SIGKILL)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log_text()[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    # ---- HTTP -----------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def headers(self, auth: bool = True) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if auth and self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def connect(self, timeout: float = 60) -> http.client.HTTPConnection:
        assert self.port is not None
        if self.uds:
            return UnixHTTPConnection(self.uds, timeout)
        if self.scheme == "https":
            context = ssl.create_default_context(cafile=self.ca_file)
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout, context=context)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        timeout: float = 60,
    ) -> tuple[int, Any]:
        """(status, parsed JSON body or text); `body` may be a dict (sent as JSON) or raw str/bytes."""
        conn = self.connect(timeout)
        try:
            data = json.dumps(body) if isinstance(body, dict | list) else body
            conn.request(method, path, body=data, headers=self.headers() if headers is None else headers)
            resp = conn.getresponse()
            raw = resp.read().decode()
            try:
                return resp.status, json.loads(raw)
            except ValueError:
                return resp.status, raw
        finally:
            conn.close()

    def kv(self) -> dict[str, Any]:
        status, body = self.request("GET", "/debug/kv_cache")
        assert status == 200, body
        return body

    def wait_idle(self, timeout: float = 10.0) -> dict[str, Any]:
        """Poll until no request is in flight and no KV block is in use; returns the last counts."""
        deadline = time.monotonic() + timeout
        kv: dict[str, Any] = {}
        while time.monotonic() < deadline:
            kv = self.kv()
            if kv["server_load"] == 0 and kv["unfinished"] == 0 and kv["in_use"] == 0:
                return kv
            time.sleep(0.1)
        raise AssertionError(f"server not idle after {timeout} s: {kv}")

    def client(self, **kw: Any) -> Any:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kw)

    def async_client(self, **kw: Any) -> Any:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kw)


def read_sse(resp: http.client.HTTPResponse) -> list[Any]:
    """Parse a whole SSE body: the JSON of each `data:` event, and the string "[DONE]"."""
    events = []
    for line in resp.read().decode().splitlines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
