"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) on the shared server, through the official
`anthropic` client: the same greedy text as the chat endpoint for the same conversation, streamed events in
Anthropic's order whose deltas join into the non-streamed message, stop reasons (end_turn, max_tokens,
stop_sequence, tool_use), tools (any, a named tool, tool results in the conversation) with inputs valid by their
schemas, output_config JSON schemas, token counts, x-api-key and Bearer auth, and Anthropic-shaped errors."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.server.server_utils import API_KEY, TIME, WEATHER

anthropic = pytest.importorskip("anthropic")

TOOLS = [
    {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER},
    {"name": "get_time", "description": "Time now", "input_schema": TIME},
]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # Anthropic's SDK 2.x sends sampling settings in the body's extras


@pytest.fixture(scope="module")
def aclient(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)


def _create(aclient, model_name, **kw):
    kw.setdefault("max_tokens", 24)
    kw.setdefault("messages", QUESTION)
    return aclient.messages.create(model=model_name, extra_body=GREEDY, **kw)


def test_text_matches_the_chat_endpoint(aclient, client, model_name):
    msg = _create(aclient, model_name, system="Be brief.")
    chat = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "system", "content": "Be brief."}, *QUESTION],
        max_tokens=24,
        temperature=0,
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.model == model_name
    assert msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == chat.choices[0].message.content
    assert msg.usage.input_tokens == chat.usage.prompt_tokens
    assert msg.usage.output_tokens == chat.usage.completion_tokens
    expected = {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert msg.stop_reason == expected and msg.stop_sequence is None


def test_system_blocks_and_count_tokens(aclient, client, model_name):
    system = [{"type": "text", "text": "Be brief."}]
    msg = _create(aclient, model_name, system=system, max_tokens=2)
    counted = aclient.messages.count_tokens(model=model_name, messages=QUESTION, system=system)
    assert counted.input_tokens == msg.usage.input_tokens
    with_tools = aclient.messages.count_tokens(model=model_name, messages=QUESTION, system=system, tools=TOOLS)
    chat = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "system", "content": "Be brief."}, *QUESTION],
        tools=[{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}} for t in TOOLS],
        tool_choice="none",
        max_tokens=1,
    )
    assert with_tools.input_tokens == chat.usage.prompt_tokens  # the tools rendered as the chat endpoint does


def test_stream_events_join_into_the_message(aclient, model_name):
    whole = _create(aclient, model_name)
    events = list(
        aclient.messages.create(model=model_name, max_tokens=24, messages=QUESTION, stream=True, extra_body=GREEDY)
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    with aclient.messages.stream(model=model_name, max_tokens=24, messages=QUESTION, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text


def test_stop_reasons(aclient, model_name):
    short = _create(aclient, model_name, max_tokens=3)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    text = _create(aclient, model_name).content[0].text
    word = text.split()[2]  # a stop sequence the greedy output reaches
    stopped = _create(aclient, model_name, stop_sequences=[word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == text[: text.index(word)]


def test_prefill_continues_the_assistant_turn(aclient, model_name):
    msg = _create(aclient, model_name, messages=[*QUESTION, {"role": "assistant", "content": "The capital"}])
    whole = _create(aclient, model_name).content[0].text
    assert whole.startswith("The capital")
    assert msg.content[0].text == whole[len("The capital") :][: len(msg.content[0].text)]


def test_tool_choice_any_and_named(aclient, model_name):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    msg = _create(aclient, model_name, messages=ask, tools=TOOLS, tool_choice={"type": "any"}, max_tokens=80)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert uses and msg.stop_reason == "tool_use"
    for use in uses:
        assert use.name in ("get_weather", "get_time") and use.id
        if use.name == "get_weather":
            jsonschema.validate(use.input, WEATHER)
    named = {"type": "tool", "name": "get_weather"}
    whole = _create(aclient, model_name, messages=ask, tools=TOOLS, tool_choice=named, max_tokens=80)
    assert [b.type for b in whole.content] == ["tool_use"] and whole.content[0].name == "get_weather"
    jsonschema.validate(whole.content[0].input, WEATHER)
    stream = aclient.messages.create(
        model=model_name, max_tokens=80, messages=ask, tools=TOOLS, tool_choice=named, stream=True, extra_body=GREEDY
    )
    events = list(stream)
    start = next(e for e in events if e.type == "content_block_start")
    assert start.content_block.type == "tool_use" and start.content_block.name == "get_weather"
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert json.loads(partial) == whole.content[0].input
    assert events[-2].delta.stop_reason == "tool_use"


def test_one_call_without_parallel_tool_use(aclient, model_name):
    ask = [{"role": "user", "content": "Weather in Paris and in Rome, and the time?"}]
    choice = {"type": "any", "disable_parallel_tool_use": True}
    msg = _create(aclient, model_name, messages=ask, tools=TOOLS, tool_choice=choice, max_tokens=120)
    assert len([b for b in msg.content if b.type == "tool_use"]) == 1


def test_tool_results_in_the_conversation(aclient, model_name):
    turns = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris", "unit": "celsius"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "21 C, sunny"}]},
                {"type": "text", "text": "Answer in one sentence."},
            ],
        },
    ]
    counted = aclient.messages.count_tokens(model=model_name, messages=turns, tools=TOOLS)
    msg = _create(aclient, model_name, messages=turns, tools=TOOLS, tool_choice={"type": "none"}, max_tokens=8)
    assert msg.usage.input_tokens == counted.input_tokens > 40
    assert msg.content[0].type == "text"


def test_output_config_json_schema(aclient, model_name):
    schema = {
        "type": "object",
        "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    }
    ask = [{"role": "user", "content": "Name a primary color as JSON."}]
    msg = _create(
        aclient,
        model_name,
        messages=ask,
        max_tokens=30,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    jsonschema.validate(json.loads(msg.content[0].text), schema)


def test_auth_by_x_api_key_or_bearer(server, model_name):
    body = {"model": model_name, "max_tokens": 2, "messages": QUESTION}
    for headers in ({"x-api-key": API_KEY}, {"Authorization": f"Bearer {API_KEY}"}):
        status, out = server.request(
            "POST", "/v1/messages", body, headers={"Content-Type": "application/json", **headers}
        )
        assert status == 200 and out["type"] == "message", out
    status, out = server.request("POST", "/v1/messages", body, headers={"x-api-key": "wrong"})
    assert status == 401 and out["type"] == "error" and out["error"]["type"] == "authentication_error"
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=model_name, max_tokens=2, messages=QUESTION)


@pytest.mark.parametrize(
    "change, status, words",
    [
        ({"model": "claude-none"}, 404, "does not exist"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, 400, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}]},
            400,
            "image blocks are not supported",
        ),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "server tools"),
        ({"tool_choice": {"type": "sometimes"}}, 400, "tool_choice"),
        ({"temperature": -1}, 400, "temperature"),
        ({"max_tokens": 10**6}, 400, "maximum context length"),
        ({"messages": [{"role": "user", "content": "word " * 5000}]}, 400, "maximum context length"),
    ],
)
def test_errors_have_anthropics_shape(server, model_name, change, status, words):
    body = {"model": model_name, "max_tokens": 4, "messages": QUESTION, **change}
    got, out = server.request("POST", "/v1/messages", body)
    assert got == status, out
    assert out["type"] == "error" and set(out["error"]) == {"type", "message"}, out
    assert out["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert words in out["error"]["message"], out


def test_consecutive_user_turns_are_one(aclient, client, model_name):
    """As Anthropic: two user messages in a row are one turn (templates that want the roles to alternate would
    refuse them apart)."""
    two = [{"role": "user", "content": "What is the capital"}, {"role": "user", "content": "of France?"}]
    counted = aclient.messages.count_tokens(model=model_name, messages=two)
    chat = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "What is the capital\nof France?"}], max_tokens=1
    )
    assert counted.input_tokens == chat.usage.prompt_tokens
    assert _create(aclient, model_name, messages=two, max_tokens=2).usage.input_tokens == counted.input_tokens


def test_auto_without_tools_is_plain_text(aclient, model_name):
    msg = _create(aclient, model_name, tool_choice={"type": "auto"}, max_tokens=2)
    assert msg.content[0].type == "text"
