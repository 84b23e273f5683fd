"""OpenAI's Responses API (/v1/responses, GET /v1/responses/{id}) on the shared server, through the official
client's `responses.create`: the same greedy text as the chat endpoint for the same conversation (instructions
as the system message, previous_response_id as the earlier turns), streamed events in order whose deltas join
into the completed response, incomplete responses, function tools (required, named, results as input items) with
arguments valid by their schemas, text.format JSON schemas, storing and retrieving, and errors."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server.server_utils import TIME, WEATHER

TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
    {"type": "function", "name": "get_time", "description": "Time now", "parameters": TIME},
]
QUESTION = "What is the capital of France?"


def _create(client, model_name, **kw):
    kw.setdefault("max_output_tokens", 24)
    kw.setdefault("input", QUESTION)
    kw.setdefault("temperature", 0)
    return client.responses.create(model=model_name, **kw)


def _chat(client, model_name, messages, max_tokens=24):
    return client.chat.completions.create(model=model_name, messages=messages, max_tokens=max_tokens, temperature=0)


def test_text_matches_the_chat_endpoint(client, model_name):
    r = _create(client, model_name, instructions="Be brief.")
    chat = _chat(
        client, model_name, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == model_name
    assert r.output_text == chat.choices[0].message.content
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == chat.usage.total_tokens
    assert r.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")


def test_previous_response_continues_the_conversation(client, model_name):
    first = _create(client, model_name, instructions="Be brief.")
    second = _create(client, model_name, input="And of Italy?", previous_response_id=first.id)
    chat = _chat(
        client,
        model_name,
        [
            {"role": "user", "content": QUESTION},  # instructions are not carried over
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And of Italy?"},
        ],
    )
    assert second.previous_response_id == first.id
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_items_as_input(client, model_name):
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
    ]
    r = _create(client, model_name, input=items)
    chat = _chat(
        client, model_name, [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    )
    assert r.output_text == chat.choices[0].message.content


def test_stream_events_join_into_the_response(client, model_name):
    whole = _create(client, model_name)
    events = list(_create(client, model_name, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_incomplete_at_max_output_tokens(client, model_name):
    r = _create(client, model_name, max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2


def test_function_tools(client, model_name):
    ask = "What is the weather in Paris?"
    r = _create(client, model_name, input=ask, tools=TOOLS, tool_choice="required", max_output_tokens=80)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and all(c.call_id and c.name in ("get_weather", "get_time") for c in calls)
    for call in calls:
        if call.name == "get_weather":
            jsonschema.validate(json.loads(call.arguments), WEATHER)
    named = {"type": "function", "name": "get_weather"}
    whole = _create(client, model_name, input=ask, tools=TOOLS, tool_choice=named, max_output_tokens=80)
    assert [o.type for o in whole.output] == ["function_call"]
    jsonschema.validate(json.loads(whole.output[0].arguments), WEATHER)
    events = list(
        _create(client, model_name, input=ask, tools=TOOLS, tool_choice=named, max_output_tokens=80, stream=True)
    )
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert deltas == done.arguments == whole.output[0].arguments == events[-1].response.output[0].arguments
    one = _create(
        client, model_name, input="Weather in Paris and Rome?", tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=120,
    )  # fmt: skip
    assert len([o for o in one.output if o.type == "function_call"]) == 1


def test_function_call_output_as_input(client, model_name):
    items = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris", "unit": "celsius"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C, sunny"},
    ]
    r = _create(client, model_name, input=items, tools=TOOLS, tool_choice="none", max_output_tokens=8)
    bare = _create(client, model_name, input=items[:1], tools=TOOLS, tool_choice="none", max_output_tokens=8)
    assert r.usage.input_tokens > bare.usage.input_tokens
    assert r.output[0].type == "message"


def test_text_format_json_schema(client, model_name):
    schema = {
        "type": "object",
        "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "color", "schema": schema}}
    r = _create(client, model_name, input="Name a primary color as JSON.", text=fmt, max_output_tokens=30)
    jsonschema.validate(json.loads(r.output_text), schema)


def test_store_false_is_not_kept(client, model_name):
    r = _create(client, model_name, store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        _create(client, model_name, input="Go on.", previous_response_id=r.id)


@pytest.mark.parametrize(
    "change, status, words",
    [
        ({"model": "gpt-none"}, 404, "does not exist"),
        ({"input": []}, 400, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input_image"),
        ({"input": [{"type": "web_search_call"}]}, 400, "not supported"),
        ({"tools": [{"type": "web_search"}]}, 400, "built-in tools"),
        ({"tool_choice": {"type": "mcp"}, "tools": [TOOLS[0]]}, 400, "tool_choice"),
        ({"text": {"format": {"type": "yaml"}}}, 400, "text.format"),
        ({"max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"previous_response_id": "resp_unknown"}, 400, "resp_unknown"),
        ({"input": "word " * 5000}, 400, "maximum context length"),
    ],
)
def test_errors(server, model_name, change, status, words):
    body = {"model": model_name, "input": QUESTION, "max_output_tokens": 4, **change}
    got, out = server.request("POST", "/v1/responses", body)
    assert got == status and out["error"]["code"] == status, out
    assert words in out["error"]["message"], out
    got, out = server.request("GET", "/v1/responses/resp_unknown")
    assert got == 404 and "not found" in out["error"]["message"]


def test_auto_tool_choice_without_tools_is_plain_text(client, model_name):
    """The Responses API reports tool_choice "auto" by default; clients send it back without tools."""
    r = _create(client, model_name, tool_choice="auto", max_output_tokens=2)
    assert r.output[0].type == "message"
