"""The server around the generation routes: utility endpoints, API key, concurrency against the offline
engine, and client disconnects (which must abort the request and free its KV blocks)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time

import openai
import pytest

import pagedllm

PROMPT = "The capital of France is"
TOPICS = [
    "the moon", "volcanoes", "honey bees", "the Eiffel Tower", "penguins", "chess", "the Amazon river",
    "coffee", "electricity", "the piano", "glaciers", "octopuses", "the printing press", "rainbows",
    "the Sahara", "tea", "lighthouses", "the violin", "dolphins", "bread", "the Great Wall", "comets",
    "owls", "the bicycle", "coral reefs", "maple syrup", "thunderstorms", "the telescope", "elephants",
    "origami", "the Nile", "snowflakes",
]  # fmt: skip
PROMPTS = [f"Here is one interesting fact about {t}:" for t in TOPICS]


def test_models_version_ping_health_load_metrics(server, client, model_name):
    models = client.models.list().data
    assert [m.id for m in models] == [model_name] == ["SmolLM2-135M-Instruct.Q4_1"]  # default: the file's name
    assert models[0].object == "model" and models[0].model_extra["max_model_len"] == 1024
    # the model's path (`root`), which vLLM and llama.cpp's server name it by, is a name of it too (listed once)
    root = models[0].model_extra["root"]
    assert os.path.isabs(root) and root.endswith(".gguf")
    resp = client.completions.create(model=root, prompt=PROMPT, max_tokens=1)
    assert resp.model == root and resp.choices[0].text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=root + "x", prompt=PROMPT, max_tokens=1)
    assert server.request("GET", "/version") == (200, {"version": pagedllm.__version__})
    assert server.request("GET", "/ping")[0] == 200
    assert server.request("POST", "/ping")[0] == 200
    assert server.request("GET", "/health")[0] == 200
    assert server.request("GET", "/load") == (200, {"server_load": 0})
    status, text = server.request("GET", "/metrics")
    assert status == 200 and "# TYPE" in text


def test_unknown_route_has_error_shape(server):
    status, body = server.request("GET", "/v1/nothing-here")
    assert status == 404 and body["error"]["type"] == "NotFoundError" and body["error"]["code"] == 404


def test_api_key(server, model_name):
    status, body = server.request("GET", "/v1/models", headers={})
    assert status == 401 and body["error"]["type"] == "AuthenticationError" and body["error"]["code"] == 401
    wrong = {"Authorization": "Bearer not-the-key", "Content-Type": "application/json"}
    assert server.request("POST", "/v1/completions", {"prompt": "x"}, headers=wrong)[0] == 401
    for path in ("/version", "/load", "/tokenize", "/debug/kv_cache"):
        assert server.request("GET", path, headers={})[0] == 401, path
    # probes need no key
    assert server.request("GET", "/health", headers={})[0] == 200
    assert server.request("GET", "/ping", headers={})[0] == 200
    bad_client = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_client.completions.create(model=model_name, prompt="x", max_tokens=1)


def test_tokenize_detokenize_round_trip(server, model_name):
    text = "Hello, world! Ünïcödé text and an emoji 🎉 too."
    status, tok = server.request("POST", "/tokenize", {"model": model_name, "prompt": text})
    assert status == 200 and tok["count"] == len(tok["tokens"]) > 5 and tok["max_model_len"] == 1024
    status, detok = server.request("POST", "/detokenize", {"model": model_name, "tokens": tok["tokens"]})
    assert status == 200 and detok == {"prompt": text}
    status, strs = server.request("POST", "/tokenize", {"prompt": text, "return_token_strs": True})
    assert len(strs["token_strs"]) == tok["count"]
    messages = [{"role": "user", "content": "hi"}]
    status, chat_tok = server.request("POST", "/tokenize", {"messages": messages})
    assert status == 200 and chat_tok["count"] > 3
    status, templated = server.request("POST", "/detokenize", {"tokens": chat_tok["tokens"]})
    assert "hi" in templated["prompt"] and templated["prompt"].endswith("assistant\n")


def test_tokenize_errors(server):
    assert server.request("POST", "/tokenize", {})[0] == 400
    assert server.request("POST", "/tokenize", {"prompt": "a", "messages": [{"role": "user"}]})[0] == 400
    status, body = server.request("POST", "/detokenize", {"tokens": [1, 10**9]})
    assert status == 400 and body["error"]["param"] == "tokens"
    assert server.request("POST", "/detokenize", {"tokens": "abc"})[0] == 400
    assert server.request("POST", "/tokenize", {"prompt": "a", "model": "other"})[0] == 404


# ---- many clients at once, checked against the offline engine ---------------------------------------------


@pytest.fixture(scope="module")
def offline_reference() -> list[str]:
    """Greedy texts of PROMPTS from the offline `LLM` with the server's engine settings."""
    from pagedllm import LLM, SamplingParams

    with LLM(max_model_len=1024, kv_cache_memory_bytes="128MiB") as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def test_32_concurrent_streams_match_offline(server, model_name, offline_reference):
    async def one_stream(client, prompt: str) -> tuple[str, str | None]:
        stream = await client.completions.create(
            model=model_name, prompt=prompt, max_tokens=16, temperature=0, stream=True
        )
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def one_bad(client) -> str:
        try:
            await client.completions.create(model=model_name, prompt=PROMPT, temperature=-1, max_tokens=4)
        except openai.BadRequestError as e:
            return e.body["type"]
        return "accepted?!"

    async def run():
        async with server.async_client(timeout=120) as client:
            streams = [one_stream(client, p) for p in PROMPTS]
            bad = [one_bad(client) for _ in range(4)]  # bad requests in the middle disturb nobody
            return await asyncio.gather(*streams, *bad)

    start = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - start
    texts = [t for t, _ in results[: len(PROMPTS)]]
    assert results[len(PROMPTS) :] == ["BadRequestError"] * 4
    assert all(f in ("stop", "length") for _, f in results[: len(PROMPTS)])
    mismatches = [(p, t, r) for p, t, r in zip(PROMPTS, texts, offline_reference) if t != r]
    assert not mismatches, f"{len(mismatches)} streams differ from the offline engine: {mismatches[:3]}"
    print(f"32 concurrent streams in {elapsed:.1f} s")


# ---- disconnects ------------------------------------------------------------------------------------------------


def _long_request(model_name: str, stream: bool) -> str:
    return json.dumps(
        {
            "model": model_name,
            "prompt": PROMPT,
            "max_tokens": 900,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }
    )


def _wait_for(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached")


def test_stream_disconnect_aborts_and_frees_kv(server, model_name):
    conn = server.connect()
    conn.request("POST", "/v1/completions", body=_long_request(model_name, True), headers=server.headers())
    resp = conn.getresponse()
    assert resp.status == 200
    events = 0
    while events < 3:
        if resp.readline().startswith(b"data: "):
            events += 1
    kv = server.kv()
    assert kv["server_load"] == 1 and kv["unfinished"] == 1 and kv["in_use"] > 0, kv
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    kv = server.wait_idle(timeout=10)
    assert kv["free"] == kv["num_blocks"]


def test_non_stream_disconnect_aborts_and_frees_kv(server, model_name):
    conn = server.connect()
    conn.request("POST", "/v1/completions", body=_long_request(model_name, False), headers=server.headers())
    _wait_for(lambda: server.kv()["in_use"] > 0)
    assert server.kv()["server_load"] == 1
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    server.wait_idle(timeout=10)


def test_chat_stream_closed_by_openai_client(server, client, model_name):
    stream = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Count to a thousand."}],
        max_tokens=900,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    server.wait_idle(timeout=10)
