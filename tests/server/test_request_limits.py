"""No request can stall the others: bodies over --max-request-bytes are a 413 before they are read (declared
length) or as soon as they pass it (chunked), in the error shape of the route's API; a prompt longer than the
context can hold in characters is a 400 before it is tokenized; and while such requests are refused, /health and a
short completion keep answering."""

from __future__ import annotations

import json
import threading

import pytest

from tests.server.server_utils import RemoteServer

MiB = 1 << 20


def _post(server: RemoteServer, path: str, body: bytes, chunked: bool = False) -> tuple[int, dict]:
    conn = server.connect(timeout=120)
    try:
        headers = server.headers()
        if chunked:
            pieces = (body[i : i + MiB] for i in range(0, len(body), MiB))
            conn.request("POST", path, body=pieces, headers=headers, encode_chunked=True)
        else:
            conn.request("POST", path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    except (BrokenPipeError, ConnectionResetError):  # the server answered and closed while we were still sending
        raise AssertionError("the connection closed before the 413 could be read") from None
    finally:
        conn.close()


def _big_completion(model_name: str, chars: int) -> bytes:
    return json.dumps({"model": model_name, "prompt": "word " * (chars // 5), "max_tokens": 1}).encode()


def test_body_over_the_limit_is_a_413(server, model_name):
    body = _big_completion(model_name, 20 * MiB)
    status, out = _post(server, "/v1/completions", body)
    assert status == 413 and out["error"]["type"] == "RequestTooLargeError", out
    assert "--max-request-bytes" in out["error"]["message"]
    status, out = _post(server, "/v1/messages", body)
    assert status == 413 and out == {
        "type": "error",
        "error": {"type": "request_too_large", "message": out["error"]["message"]},
    }


def test_chunked_body_over_the_limit_is_a_413(server, model_name):
    status, out = _post(server, "/v1/chat/completions", _big_completion(model_name, 20 * MiB), chunked=True)
    assert status == 413 and "--max-request-bytes" in out["error"]["message"], out


def test_prompt_longer_than_the_context_can_hold_is_refused_before_tokenizing(server, model_name):
    prompt = "word " * (2 * MiB // 5)
    for path, body in [
        ("/v1/completions", {"model": model_name, "prompt": prompt, "max_tokens": 1}),
        ("/v1/chat/completions", {"model": model_name, "messages": [{"role": "user", "content": prompt}]}),
        ("/tokenize", {"model": model_name, "prompt": prompt}),
    ]:
        status, out = server.request("POST", path, body)
        assert status == 400 and "characters" in out["error"]["message"], (path, out)


def test_others_are_served_while_big_requests_are_refused(server, client, model_name):
    body = _big_completion(model_name, 12 * MiB)  # under the limit: read, parsed, refused by its length
    results: list[int] = []

    def send() -> None:
        for _ in range(3):
            results.append(_post(server, "/v1/completions", body)[0])

    sender = threading.Thread(target=send)
    sender.start()
    answered = 0
    while sender.is_alive():
        status, _ = server.request("GET", "/health")
        assert status == 200
        out = client.completions.create(model=model_name, prompt="Hello", max_tokens=2)
        assert out.choices[0].text is not None
        answered += 1
    sender.join()
    assert results == [400, 400, 400] and answered >= 1


@pytest.mark.timeout(300)
def test_a_smaller_limit_applies(model_name):
    srv = RemoteServer("--max-request-bytes", "1KiB")
    try:
        status, out = _post(srv, "/v1/completions", _big_completion(model_name, 2000))
        assert status == 413 and "1,024" in out["error"]["message"], out
        status, out = srv.request("POST", "/v1/completions", {"model": model_name, "prompt": "Hi", "max_tokens": 1})
        assert status == 200, out
    finally:
        srv.stop()


def test_a_client_waiting_for_100_continue_gets_the_413_at_once(server, model_name):
    """With `Expect: 100-continue` (curl's large uploads) the body is not asked for: the 413 comes first."""
    conn = server.connect(timeout=30)
    try:
        conn.putrequest("POST", "/v1/completions")
        for k, v in {**server.headers(), "Content-Length": str(20 * MiB), "Expect": "100-continue"}.items():
            conn.putheader(k, v)
        conn.endheaders()  # no body sent
        resp = conn.getresponse()
        assert resp.status == 413 and "--max-request-bytes" in json.loads(resp.read())["error"]["message"]
    finally:
        conn.close()
