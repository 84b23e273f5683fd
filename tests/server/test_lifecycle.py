"""Server life cycle, each on a server of its own: SIGTERM stops the server and its engine-core process, and so
does Ctrl-C (SIGINT to the whole process group), logged as a clean stop;
a dead engine core makes /health answer 503, fails in-flight requests (no hang) and makes the server exit
with a non-zero status within 10 s; --max-queued-requests answers 429 beyond the limit."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import openai
import pytest

from tests.server.server_utils import RemoteServer

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def servers():
    """Both servers of this file, started together so that their start-ups overlap."""
    term = RemoteServer(
        "--enable-debug-routes",
        "--served-model-name",
        "test-model",
        "other-name",  # vLLM's further names
        "--timeout-graceful-shutdown",
        "1",
        "--trust-request-chat-template",
        api_key="env-key",
        env={"PAGEDLLM_API_KEY": "env-key"},
        start=False,
    )
    dying = RemoteServer("--enable-debug-routes", "--max-queued-requests", "2", start=False)
    ctrl_c = RemoteServer("--enable-debug-routes", start=False, new_session=True)
    try:
        term.wait_ready()
        dying.wait_ready()
        ctrl_c.wait_ready()
        yield {"term": term, "dying": dying, "ctrl_c": ctrl_c}
    finally:
        term.stop(signal.SIGKILL)
        dying.stop(signal.SIGKILL)
        ctrl_c.stop(signal.SIGKILL)


def _pid_gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):
                    return True  # a zombie: exited, only not reaped yet
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _long_body(model: str | None, stream: bool) -> str:
    body = {"prompt": PROMPT, "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": stream}
    if model:
        body["model"] = model
    return json.dumps(body)


class _Background(threading.Thread):
    """One HTTP request in a thread: for streams the list of SSE payloads, else (status, body)."""

    def __init__(self, srv: RemoteServer, body: str, stream: bool) -> None:
        super().__init__(daemon=True)
        self.srv, self.body, self.stream = srv, body, stream
        self.events: list[str] = []
        self.result: tuple[int, dict] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            conn = self.srv.connect(timeout=30)
            conn.request("POST", "/v1/completions", body=self.body, headers=self.srv.headers())
            resp = conn.getresponse()
            if not self.stream:
                self.result = (resp.status, json.loads(resp.read()))
                return
            while line := resp.readline():
                if line.startswith(b"data: "):
                    self.events.append(line[6:].decode().strip())
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def test_served_model_name_env_key_and_sigterm(servers):
    srv = servers["term"]
    client = srv.client()
    assert [m.id for m in client.models.list().data] == ["test-model", "other-name"]
    resp = client.completions.create(model="test-model", prompt=PROMPT, max_tokens=3, temperature=0)
    assert resp.model == "test-model" and resp.choices[0].text
    other = client.completions.create(model="other-name", prompt=PROMPT, max_tokens=3, temperature=0)
    assert other.model == "other-name" and other.choices[0].text == resp.choices[0].text
    root = client.models.list().data[0].root  # with a chosen name, the model's path is no name of it
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=root, prompt=PROMPT, max_tokens=1)
    # OpenAI's retrieval: the card of a listed name; the path (no name here) is a 404 in OpenAI's shape
    assert client.models.retrieve("other-name").id == "other-name"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve(root)
    assert missing.value.body["param"] == "model" and "does not exist" in missing.value.body["message"]
    assert srv.request("GET", "/v1/models", headers={})[0] == 401  # the key came from $PAGEDLLM_API_KEY
    # --trust-request-chat-template: a request's own template is used; one that raises is the client's fault
    messages = [{"role": "user", "content": "Say yes."}]
    template = "{% for m in messages %}{{ m.content }}\n{% endfor %}Answer:"
    _, tok = srv.request("POST", "/tokenize", {"messages": messages, "chat_template": template})
    assert tok["count"] == srv.request("POST", "/tokenize", {"prompt": "Say yes.\nAnswer:"})[1]["count"]
    chat = client.chat.completions.create(
        model="test-model", messages=messages, max_tokens=2, extra_body={"chat_template": template}
    )
    assert chat.usage.prompt_tokens == tok["count"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model="test-model", messages=messages, extra_body={"chat_template": "{{ raise_exception('no') }}"}
        )
    assert exc.value.body["param"] == "messages"
    core_pid = srv.kv()["core_pid"]
    assert core_pid and not _pid_gone(core_pid, timeout=0)
    # a stream still running when SIGTERM arrives must not keep the server alive
    stream = _Background(srv, _long_body("test-model", True), stream=True)
    stream.start()
    _wait(lambda: len(stream.events) >= 2)
    start = time.monotonic()
    assert srv.stop(signal.SIGTERM, timeout=30) == 0
    assert time.monotonic() - start < 15
    assert _pid_gone(core_pid), "the engine-core process outlived the server"
    stream.join(timeout=5)
    assert not stream.is_alive()


def test_ctrl_c_to_the_process_group_is_a_clean_stop(servers):
    """A terminal's Ctrl-C (`make serve`) sends SIGINT to the server and its engine core at once, here right after a
    completed request: the core leaves stopping to the server, which exits 0 and logs a clean stop of the core, not an
    engine that died under it (before the core ignored SIGINT it exited 0 on it before the server stopped it, and the
    server's watcher logged 'engine core process died (exit status 0)' and exited 1: make's "Error 1")."""
    srv = servers["ctrl_c"]
    assert srv.client().completions.create(model=srv.client().models.list().data[0].id, prompt=PROMPT, max_tokens=2)
    core_pid = srv.kv()["core_pid"]
    os.killpg(srv.proc.pid, signal.SIGINT)
    assert srv.proc.wait(30) == 0
    assert _pid_gone(core_pid), "the engine-core process outlived the server"
    log = srv.log_text()
    assert "engine core process died" not in log and "pagedllm server stopped" in log, log[-2000:]
    # the stop of the core is logged as one, with its status
    assert log.index("engine core process stopped (exit status 0)") > log.index("pagedllm server ready"), log[-2000:]


def test_queue_limit_then_engine_death(servers):
    srv = servers["dying"]
    model = srv.client().models.list().data[0].id
    stream = _Background(srv, _long_body(model, True), stream=True)
    blocking = _Background(srv, _long_body(model, False), stream=False)
    stream.start()
    blocking.start()
    _wait(lambda: srv.request("GET", "/load")[1]["server_load"] == 2 and len(stream.events) >= 2)
    # over --max-queued-requests 2
    status, body = srv.request("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert status == 429 and body["error"]["type"] == "RateLimitError" and body["error"]["code"] == 429
    with pytest.raises(openai.RateLimitError):
        srv.client().completions.create(model=model, prompt=PROMPT, max_tokens=2)

    core_pid = srv.kv()["core_pid"]
    killed_at = time.monotonic()
    os.kill(core_pid, signal.SIGKILL)
    _wait(lambda: srv.request("GET", "/health")[0] == 503, timeout=3)
    # in-flight requests are answered with an error, not left hanging
    stream.join(timeout=5)
    blocking.join(timeout=5)
    assert not stream.is_alive() and not blocking.is_alive()
    assert stream.error is None and blocking.error is None, (stream.error, blocking.error)
    assert stream.events[-1] == "[DONE]"
    error_events = [json.loads(e) for e in stream.events[:-1] if '"error"' in e]
    assert error_events and error_events[-1]["error"]["code"] == 503
    status, body = blocking.result
    assert status == 503 and body["error"]["type"] == "ServiceUnavailableError"
    # ... and the server exits with a non-zero status within 10 s of the death
    returncode = srv.proc.wait(timeout=max(0.1, 10 - (time.monotonic() - killed_at)))
    assert returncode != 0
    assert time.monotonic() - killed_at < 10


def _wait(pred, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")
