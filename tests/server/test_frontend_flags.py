"""vLLM's front-end flags on real servers of the default model.

One server takes its flags from a `--config` YAML file, as a vLLM deployment does: CORS for one origin (preflight
answered, a 401 carries the headers), X-Request-Id on every response, a usage chunk at the end of every stream with
the prompt tokens the prefix cache held, logprobs naming tokens "token_id:N" (a request may say otherwise), no
OpenAPI pages, a --root-path (routes, /health without a key), message content as a list of parts for a template that
loops over them, --override-generation-config's max_new_tokens as the default length, several served names, vLLM's
hub and parallelism flags accepted; a flag on the command line wins over the file's. Another serves HTTPS with
--ssl-keyfile/--ssl-certfile (a self-signed certificate for 127.0.0.1 kept with the tests).
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest

from tests.server.server_utils import RemoteServer, read_sse

DATA = Path(__file__).parent / "data"
KEY = "flags-key"
ORIGIN = "http://ui.example"
TEMPLATE = "{% for m in messages %}{{ m.role }}:{% for p in m.content %}[{{ p.text }}]{% endfor %}\n{% endfor %}"
CONFIG = {
    "served-model-name": ["smol", "smol-alias"],
    "allowed-origins": [ORIGIN],
    "enable-request-id-headers": True,
    "enable-force-include-usage": True,
    "enable-prompt-tokens-details": True,
    "return-tokens-as-token-ids": True,
    "disable-fastapi-docs": True,
    "root-path": "/llm",
    "chat-template-content-format": "openai",
    "trust-request-chat-template": True,
    "log-error-stack": True,
    "enable-chunked-prefill": False,
    "override-generation-config": {"max_new_tokens": 5},
    "download-dir": "/nowhere",
    "revision": "main",
    "pipeline-parallel-size": 1,
    "shutdown-timeout": 2,
    "disable-log-stats": False,  # a switch set false: left off
    "port": 9,  # the command line's --port 0 wins
}
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    folder = tmp_path_factory.mktemp("frontend_flags")
    (folder / "template.jinja").write_text(TEMPLATE)
    config = {**CONFIG, "chat-template": str(folder / "template.jinja")}
    (folder / "config.yaml").write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in config.items()))
    server = RemoteServer("--config", str(folder / "config.yaml"), api_key=KEY)
    yield server
    server.stop(signal.SIGKILL)


def _raw(srv: RemoteServer, method: str, path: str, headers: dict[str, str], body: dict | None = None):
    conn = srv.connect()
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


@pytest.mark.timeout(600)
def test_cors_for_the_allowed_origin_only(srv):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "x"}
    status, headers, _ = _raw(srv, "OPTIONS", "/v1/chat/completions", preflight)
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN, headers
    status, headers, _ = _raw(srv, "OPTIONS", "/v1/chat/completions", {**preflight, "Origin": "http://evil.example"})
    assert status == 400 and "access-control-allow-origin" not in headers
    status, headers, _ = _raw(srv, "GET", "/v1/models", {"Origin": ORIGIN})  # no key: a 401 the browser can read
    assert status == 401 and headers["access-control-allow-origin"] == ORIGIN
    status, headers, _ = _raw(srv, "GET", "/v1/models", {"Origin": ORIGIN, **srv.headers()})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN


@pytest.mark.timeout(600)
def test_request_id_headers_docs_and_root_path(srv):
    status, headers, _ = _raw(srv, "GET", "/health", {"X-Request-Id": "my-id-1"})  # exempt from the key
    assert status == 200 and headers["x-request-id"] == "my-id-1"
    status, headers, _ = _raw(srv, "GET", "/v1/models", srv.headers())
    assert status == 200 and re.fullmatch(r"[0-9a-f]{32}", headers["x-request-id"]), headers
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert srv.request("GET", path)[0] == 404, path
    status, models = srv.request("GET", "/v1/models")
    assert [m["id"] for m in models["data"]] == ["smol", "smol-alias"]
    status, card = srv.request("GET", "/v1/models/smol-alias")
    assert status == 200 and card["id"] == "smol-alias" and card["root"] == models["data"][0]["root"]
    assert srv.port != 9  # the command line's port, not the file's
    log = srv.log_text()
    assert log.count("--download-dir, --revision: accepted for vLLM compatibility") == 1, log[-3000:]
    assert "Default sampling parameters set by --override-generation-config: {'max_tokens': 5}" in log


@pytest.mark.timeout(600)
def test_content_as_parts_and_the_overridden_default_length(srv):
    status, tok = srv.request("POST", "/tokenize", {"messages": MESSAGES, "model": "smol-alias"})
    assert status == 200, tok
    text = srv.request("POST", "/detokenize", {"tokens": tok["tokens"]})[1]["prompt"]
    assert text == "user:[Hi][there]"  # Jinja drops the last newline
    body = {"messages": MESSAGES, "ignore_eos": True}
    status, chat = srv.request("POST", "/v1/chat/completions", body)
    assert status == 200 and chat["usage"]["completion_tokens"] == 5, chat  # max_new_tokens 5: the default
    # a template that joins text to content cannot take a list of parts: a 400 that says why, not a 500
    bad = {"messages": MESSAGES, "chat_template": "{{ messages[0].content + '!' }}"}
    status, err = srv.request("POST", "/tokenize", bad)
    assert status == 400 and "list of parts" in err["error"]["message"], err
    assert "Traceback" in srv.log_text()  # --log-error-stack: a 400's traceback too


@pytest.mark.timeout(600)
def test_every_stream_ends_with_usage_and_cached_tokens(srv):
    prompt = "Once upon a time, in a land far away, there lived a king who had three daughters and a dragon."

    def stream() -> list:
        conn = srv.connect()
        try:
            body = {"prompt": prompt, "max_tokens": 3, "stream": True, "temperature": 0}
            conn.request("POST", "/v1/completions", body=json.dumps(body), headers=srv.headers())
            return read_sse(conn.getresponse())
        finally:
            conn.close()

    first, second = stream(), stream()
    for events in (first, second):
        assert events[-1] == "[DONE]"
        usage = events[-2]["usage"]
        assert events[-2]["choices"] == [] and usage["completion_tokens"] == 3, events[-2]
        assert all(e.get("usage") is None for e in events[:-2])  # null before the last, as OpenAI
    assert first[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16  # a full block, from the first


@pytest.mark.timeout(600)
def test_cache_salt_shares_the_prefix_cache_only_within_a_salt(srv):
    prompt = "In the beginning the universe was created. This has made a lot of people very angry and been widely"

    def cached(**extra) -> int:
        body = {"prompt": prompt, "max_tokens": 1, **extra}
        status, out = srv.request("POST", "/v1/completions", body)
        assert status == 200, out
        return out["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") >= 16
    assert cached(cache_salt="tenant-b") == 0
    assert cached() == 0  # no salt: not the salted blocks either
    messages = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
    chat = {"messages": messages, "max_tokens": 1, "cache_salt": "tenant-c"}
    for want_cached in (False, True):
        status, out = srv.request("POST", "/v1/chat/completions", chat)
        assert status == 200, out
        assert (out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16) == want_cached, out["usage"]
    body = {"input": [{"role": "user", "content": prompt}], "max_output_tokens": 1, "cache_salt": "tenant-d"}
    for want_cached in (False, True):  # the Responses route takes vLLM's cache_salt too
        status, out = srv.request("POST", "/v1/responses", body)
        assert status == 200, out
        assert (out["usage"]["input_tokens_details"]["cached_tokens"] >= 16) == want_cached, out["usage"]
    status, err = srv.request("POST", "/v1/completions", {"prompt": prompt, "cache_salt": ""})
    assert status == 400 and err["error"]["param"] == "cache_salt", err


@pytest.mark.timeout(600)
def test_logprobs_name_tokens_by_id_unless_the_request_says(srv):
    body = {"prompt": "Hello", "max_tokens": 2, "logprobs": 1, "temperature": 0}
    status, out = srv.request("POST", "/v1/completions", body)
    assert status == 200, out
    tokens = out["choices"][0]["logprobs"]["tokens"]
    assert all(re.fullmatch(r"token_id:\d+", t) for t in tokens), tokens
    status, tok = srv.request("POST", "/tokenize", {"prompt": out["choices"][0]["text"], "add_special_tokens": False})
    assert [int(t.split(":")[1]) for t in tokens] == tok["tokens"]
    status, out = srv.request("POST", "/v1/completions", {**body, "return_tokens_as_token_ids": False})
    assert "".join(out["choices"][0]["logprobs"]["tokens"]) == out["choices"][0]["text"]
    chat = {"messages": MESSAGES, "max_tokens": 2, "logprobs": True, "top_logprobs": 2}
    status, out = srv.request("POST", "/v1/chat/completions", chat)
    content = out["choices"][0]["logprobs"]["content"]
    assert all(c["token"].startswith("token_id:") for c in content)
    assert all(t["token"].startswith("token_id:") for c in content for t in c["top_logprobs"])


@pytest.mark.timeout(600)
def test_https_with_the_given_certificate():
    server = RemoteServer(
        *("--ssl-keyfile", str(DATA / "test_key.pem"), "--ssl-certfile", str(DATA / "test_cert.pem")),
        ca_file=str(DATA / "test_cert.pem"),
    )
    try:
        assert server.url.startswith("https://")
        status, out = server.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 200 and out["usage"]["completion_tokens"] == 2, out
    finally:
        server.stop(signal.SIGKILL)


@pytest.mark.timeout(600)
def test_unix_domain_socket(tmp_path):
    path = tmp_path / "pagedllm.sock"
    path.write_bytes(b"")  # a file that is not a socket is not replaced
    server = RemoteServer("--uds", str(path), start=False)
    try:
        assert server.proc.wait(timeout=120) == 2 and "the file exists and is not a socket" in server.log_text()
    finally:
        server.stop(signal.SIGKILL)
    path.unlink()
    server = RemoteServer(uds=str(path))
    try:
        status, out = server.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 200 and out["usage"]["completion_tokens"] == 2, out
        assert server.stop() == 0
        assert not path.exists()  # the socket file goes with the server
    finally:
        server.stop(signal.SIGKILL)
