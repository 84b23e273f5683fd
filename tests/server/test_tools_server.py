"""Tool calling over HTTP on the default model, with a server started with `--enable-auto-tool-choice
--tool-call-parser hermes`: tool_choice "required" and a named function give valid calls (enforced by a JSON
schema built from the tools, checked here with jsonschema); "auto" parses Hermes `<tool_call>` blocks; "none"
gives text; streamed calls assemble into exactly the non-streamed ones; `parallel_tool_calls: false` gives one call
at most (required and auto, streamed and not); bad tool requests are 400s."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server.server_utils import TIME, WEATHER, RemoteServer

TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "Time in a timezone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_REGEX = (
    r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,9}", "unit": "celsius"\}\}</tool_call>'
)


@pytest.fixture(scope="module")
def tool_server():
    srv = RemoteServer("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tclient(tool_server):
    return tool_server.client()


def _create(client, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 80)
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, messages=MESSAGES, **kw)


def _streamed_calls(client, **kw) -> tuple[dict[int, dict], str | None, str]:
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in _create(client, stream=True, **kw):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert call["id"] is None
                call["id"], call["name"] = tc.id, tc.function.name
            call["arguments"] += tc.function.arguments or ""
        finish = choice.finish_reason or finish
    return calls, finish, content


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_gives_valid_calls_streamed_as_whole(tclient):
    resp = _create(tclient, tools=TOOLS, tool_choice="required")
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message.tool_calls)
    calls, finish, _ = _streamed_calls(tclient, tools=TOOLS, tool_choice="required")
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_named_function_gives_a_valid_call(tclient, name):
    choice_arg = {"type": "function", "function": {"name": name}}
    resp = _create(tclient, tools=TOOLS, tool_choice=choice_arg, temperature=0.8, seed=5)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == name and call.id and call.type == "function"
    _check_calls([call])
    calls, finish, _ = _streamed_calls(tclient, tools=TOOLS, tool_choice=choice_arg, temperature=0.8, seed=5)
    assert finish == "tool_calls" and calls[0]["name"] == name
    assert calls[0]["arguments"] == call.function.arguments


def test_auto_parses_hermes_calls(tclient):
    # The small model does not write Hermes calls unprompted: a regex makes it write one, the parser reads it.
    extra = {"structured_outputs": {"regex": HERMES_REGEX}}
    resp = _create(tclient, tools=TOOLS, tool_choice="auto", extra_body=extra)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    _check_calls([call])
    calls, finish, content = _streamed_calls(tclient, tools=TOOLS, extra_body=extra)  # auto is the default
    assert finish == "tool_calls" and content == ""
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == call.function.arguments
    # Text without a call stays text.
    plain = _create(tclient, tools=TOOLS, extra_body={"guided_choice": ["It is sunny."]})
    assert plain.choices[0].message.content == "It is sunny." and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "stop"


def test_parallel_tool_calls_false_gives_one_call(tclient):
    kw = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 120}
    resp = _create(tclient, **kw)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    _check_calls([call])
    calls, finish, _ = _streamed_calls(tclient, **kw)
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(call.function.name, call.function.arguments)]
    # auto: the output holds two calls (a regex makes the model write them); only the first is returned
    second = r'<tool_call>\{"name": "get_time", "arguments": \{"timezone": "UTC"\}\}</tool_call>'
    auto = {"tools": TOOLS, "extra_body": {"structured_outputs": {"regex": HERMES_REGEX + second}}, "max_tokens": 160}
    both = _create(tclient, **auto)
    assert [c.function.name for c in both.choices[0].message.tool_calls] == ["get_weather", "get_time"]
    one = _create(tclient, parallel_tool_calls=False, **auto)
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["get_weather"]
    calls, finish, _ = _streamed_calls(tclient, parallel_tool_calls=False, **auto)
    assert finish == "tool_calls" and [c["name"] for c in calls.values()] == ["get_weather"]
    assert calls[0]["arguments"] == one.choices[0].message.tool_calls[0].function.arguments


def test_none_gives_text(tclient):
    resp = _create(tclient, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert resp.choices[0].message.content and not resp.choices[0].message.tool_calls


@pytest.mark.parametrize(
    ("kw", "param", "fragment"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0]", "name"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
                "tool_choice": "required",
            },
            "tools",
            "does not compile",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "cannot be combined",
        ),
    ],
)
def test_bad_tool_requests_are_400(tclient, kw, param, fragment):
    with pytest.raises(openai.BadRequestError) as exc:
        _create(tclient, **kw)
    assert exc.value.body["param"] == param and fragment in exc.value.body["message"], exc.value.body


def test_server_flags_are_checked_at_startup():
    srv = RemoteServer("--enable-auto-tool-choice", start=False)
    try:
        assert srv.proc.wait(timeout=120) != 0
        assert "--enable-auto-tool-choice needs --tool-call-parser" in srv.log_text()
    finally:
        srv.stop()
