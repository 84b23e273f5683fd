"""POST /v1/chat/completions through the official openai client against a real `pagedllm serve`."""

from __future__ import annotations

import openai
import pytest

MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name a primary color."},
]


def chat(client, model, messages=MESSAGES, **kw):
    kw.setdefault("max_tokens", 10)
    return client.chat.completions.create(model=model, messages=messages, temperature=0, **kw)


def test_chat_shape_and_usage(server, client, model_name):
    resp = chat(client, model_name)
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"
    assert resp.model == model_name
    [choice] = resp.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    status, tok = server.request("POST", "/tokenize", {"messages": MESSAGES})
    assert status == 200 and resp.usage.prompt_tokens == tok["count"]
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_stream_role_first_then_content_and_usage(client, model_name):
    full = chat(client, model_name)
    chunks = list(chat(client, model_name, stream=True, stream_options={"include_usage": True}))
    first, *content, last = chunks
    assert first.object == "chat.completion.chunk" and first.id.startswith("chatcmpl-")
    assert first.choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in content)
    assert "".join(c.choices[0].delta.content or "" for c in content) == full.choices[0].message.content
    assert content[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert last.choices == [] and last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.id == first.id for c in chunks)


def test_continuous_usage_stats(client, model_name):
    chunks = list(
        chat(
            client,
            model_name,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks[:-1]]
    assert counts == sorted(counts) and counts[-1] == 5 and chunks[-1].usage.completion_tokens == 5


def test_n2_streaming(client, model_name):
    stream = chat(client, model_name, n=2, max_tokens=6, stream=True, extra_body={"ignore_eos": True})
    roles, texts, finish = set(), {0: "", 1: ""}, {}
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.role:
                roles.add(c.index)
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert roles == {0, 1} and finish == {0: "length", 1: "length"}
    assert texts[0] == texts[1] == chat(client, model_name, max_tokens=6).choices[0].message.content


def test_n2_non_streaming(client, model_name):
    resp = chat(client, model_name, n=2, max_tokens=4, extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1] and resp.usage.completion_tokens == 8


def test_max_completion_tokens_and_length(client, model_name):
    resp = chat(client, model_name, max_tokens=None, max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 3
    # max_completion_tokens wins over the deprecated max_tokens
    resp = chat(client, model_name, max_tokens=50, max_completion_tokens=2, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 2


def test_chat_logprobs(client, model_name):
    resp = chat(client, model_name, max_tokens=5, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(c.token for c in content) == resp.choices[0].message.content
    for c in content:
        assert c.logprob <= 0 and c.bytes == list(c.token.encode())
        assert len(c.top_logprobs) == 3
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
        assert c.top_logprobs[0].token == c.token  # greedy
    no_top = chat(client, model_name, max_tokens=2, logprobs=True)
    assert all(c.top_logprobs == [] for c in no_top.choices[0].logprobs.content)
    assert chat(client, model_name, max_tokens=2).choices[0].logprobs is None


def test_chat_logprobs_streaming(client, model_name):
    full = chat(client, model_name, max_tokens=5, logprobs=True, top_logprobs=2)
    chunks = list(chat(client, model_name, max_tokens=5, logprobs=True, top_logprobs=2, stream=True))
    tokens = [t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert tokens == [t.token for t in full.choices[0].logprobs.content]


def test_chat_stop(client, model_name):
    text = chat(client, model_name, max_tokens=16).choices[0].message.content
    stop = text[1:4]
    resp = chat(client, model_name, max_tokens=16, stop=[stop])
    assert resp.choices[0].finish_reason == "stop" and resp.choices[0].message.content == text[: text.index(stop)]


def test_content_parts_equal_string_content(client, model_name):
    parts = [
        MESSAGES[0],
        {"role": "user", "content": [{"type": "text", "text": "Name a primary "}, {"type": "text", "text": "color."}]},
    ]
    assert (
        chat(client, model_name, parts).choices[0].message.content
        == chat(client, model_name).choices[0].message.content
    )


def test_multi_turn_with_assistant_message(client, model_name):
    messages = [*MESSAGES, {"role": "assistant", "content": "Red."}, {"role": "user", "content": "Another one?"}]
    resp = chat(client, model_name, messages)
    assert resp.choices[0].message.content


def test_seeded_sampling_is_reproducible(client, model_name):
    def sample():
        return (
            client.chat.completions.create(model=model_name, messages=MESSAGES, temperature=1.2, seed=99, max_tokens=12)
            .choices[0]
            .message.content
        )

    assert sample() == sample()


def test_auto_tools_need_the_flags_and_response_format_types(client, model_name):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    with pytest.raises(openai.BadRequestError) as exc:  # "auto" (the default with tools) needs the server's flags
        chat(client, model_name, tools=tools)
    assert exc.value.body["param"] == "tool_choice" and "--enable-auto-tool-choice" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, model_name, response_format={"type": "yaml"})
    assert exc.value.body["param"] == "response_format" and "'yaml'" in exc.value.body["message"]
    assert chat(client, model_name, max_tokens=2, response_format={"type": "text"}).choices[0].message is not None


def test_context_length_error_message(client, model_name):
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, model_name, max_tokens=1020)
    msg = exc.value.body["message"]
    assert msg.startswith("This model's maximum context length is 1024 tokens. However, you requested")
    assert "in the messages, 1020 in the completion" in msg


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages[0].role"),
        ({"messages": MESSAGES, "temperature": -1}, "temperature"),
        ({"messages": MESSAGES, "top_p": 2}, "top_p"),
        ({"messages": MESSAGES, "n": 0}, "n"),
        ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
        ({"messages": MESSAGES, "max_completion_tokens": "ten"}, "max_completion_tokens"),
        ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": MESSAGES, "logprobs": "yes please"}, "logprobs"),
        ({"messages": MESSAGES, "stream": True, "n": 0}, "n"),
    ],
)
def test_bad_chat_parameters_are_400(server, model_name, body, param):
    status, resp = server.request("POST", "/v1/chat/completions", {"model": model_name, **body})
    assert status == 400, resp
    assert resp["error"]["type"] == "BadRequestError" and resp["error"]["code"] == 400
    assert resp["error"]["param"] == param


def test_request_chat_template_needs_the_server_flag(server, model_name):
    body = {"model": model_name, "messages": MESSAGES, "chat_template": "{{ messages[0].content }}"}
    status, resp = server.request("POST", "/v1/chat/completions", body)
    assert status == 400 and resp["error"]["param"] == "chat_template"
    status, resp = server.request("POST", "/tokenize", {"messages": MESSAGES, "chat_template": "x"})
    assert status == 400 and resp["error"]["param"] == "chat_template"


def test_non_text_content_part_is_400(server, model_name):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    status, resp = server.request("POST", "/v1/chat/completions", {"model": model_name, "messages": messages})
    assert status == 400 and "only text" in resp["error"]["message"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES, max_tokens=2)


USER = {"role": "user", "content": "Hi."}
CALL = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]


@pytest.mark.parametrize(
    "messages, param",
    [
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": None}], "messages[0].content"),
        ([{"role": "", "content": "empty role"}], "messages[0].role"),
        ([{"role": "wizard", "content": "unknown role"}], "messages[0].role"),
        ([{"role": "system"}, USER], "messages[0].content"),
        ([{"role": "developer", "content": None}, USER], "messages[0].content"),
        ([USER, {"role": "assistant"}, USER], "messages[1].content"),
        ([USER, {"role": "assistant", "content": None, "tool_calls": []}, USER], "messages[1].content"),
        (
            [USER, {"role": "assistant", "tool_calls": CALL}, {"role": "tool", "content": "1"}],
            "messages[2].tool_call_id",
        ),
        (
            [USER, {"role": "assistant", "tool_calls": CALL}, {"role": "tool", "tool_call_id": "call_1"}],
            "messages[2].content",
        ),
        ([USER, {"role": "function", "content": "1"}], "messages[1].name"),
        ([USER, {"role": "function", "name": "f"}], "messages[1].content"),
    ],
)
def test_messages_breaking_openai_role_rules_are_400(server, model_name, messages, param):
    """OpenAI's per-role rules: a 400 naming the field, for /v1/chat/completions and for /tokenize alike."""
    for path in ("/v1/chat/completions", "/tokenize"):
        status, resp = server.request("POST", path, {"model": model_name, "messages": messages, "max_tokens": 2})
        assert status == 400, (path, resp)
        err = resp["error"]
        assert err["type"] == "BadRequestError" and err["code"] == 400 and err["param"] == param, (path, err)


@pytest.mark.parametrize(
    "messages",
    [
        [USER, {"role": "assistant", "tool_calls": CALL}, {"role": "tool", "content": "1", "tool_call_id": "call_1"}],
        [USER, {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}],
        [USER, {"role": "function", "name": "f", "content": None}],
        [{"role": "developer", "content": ""}, USER],
    ],
)
def test_messages_following_openai_role_rules_are_accepted(client, model_name, messages):
    assert chat(client, model_name, messages, max_tokens=2).choices[0].message.role == "assistant"


def test_return_token_ids_echo_and_truncation(server, client, model_name):
    status, tok = server.request("POST", "/tokenize", {"messages": MESSAGES})
    resp = chat(client, model_name, max_tokens=4, extra_body={"return_token_ids": True})
    assert resp.model_extra["prompt_token_ids"] == tok["tokens"]
    [choice] = resp.choices
    said = server.request("POST", "/detokenize", {"tokens": choice.model_extra["token_ids"]})[1]["prompt"]
    assert len(choice.model_extra["token_ids"]) == resp.usage.completion_tokens and said == choice.message.content
    chunks = list(chat(client, model_name, max_tokens=4, stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].model_extra["prompt_token_ids"] == tok["tokens"]
    assert [t for c in chunks[1:] for t in c.choices[0].model_extra.get("token_ids") or []] == choice.model_extra[
        "token_ids"
    ]
    assert "prompt_token_ids" not in chunks[1].model_extra  # only in the first chunk
    # echo: a reply that continues the last message starts with it (vLLM's); a new reply does not
    start = [*MESSAGES, {"role": "assistant", "content": "The color"}]
    kw = dict(max_tokens=3, extra_body={"echo": True, "continue_final_message": True, "add_generation_prompt": False})
    echoed = chat(client, model_name, messages=start, **kw).choices[0].message.content
    plain = chat(client, model_name, messages=start, max_tokens=3, extra_body=kw["extra_body"] | {"echo": False})
    assert echoed == "The color" + plain.choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or "" for c in chat(client, model_name, messages=start, stream=True, **kw)
    )
    assert streamed == echoed
    assert (
        chat(client, model_name, extra_body={"echo": True}).choices[0].message.content
        == chat(client, model_name).choices[0].message.content
    )
    # truncate_prompt_tokens keeps the prompt's last N tokens
    cut = chat(client, model_name, max_tokens=2, extra_body={"truncate_prompt_tokens": 5, "return_token_ids": True})
    assert cut.usage.prompt_tokens == 5 and cut.model_extra["prompt_token_ids"] == tok["tokens"][-5:]
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        chat(client, model_name, extra_body={"truncate_prompt_tokens": 0})
