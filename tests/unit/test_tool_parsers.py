"""Tool-call parsers: the Hermes, llama3_json, mistral, pythonic and qwen3_coder formats whole and streamed in
random splits of the text (ids sent once per call); the streamed argument pieces join into exactly the
non-streamed arguments; malformed output stays content; the argument streamer never sends what a later token
changes, and says so if it ever would; the request's tools reach the parser; `parallel_tool_calls: false` keeps
the first call (FirstCallOnly, ToolPlan) and limits "required" to one call."""

from __future__ import annotations

import json
import random

import pytest

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.serving_chat import plan_tools, tool_constraint
from pagedllm.entrypoints.openai.tool_parsers import (
    FirstCallOnly,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
    Qwen3CoderToolParser,
    ToolParser,
    ToolParserManager,
)
from pagedllm.entrypoints.openai.tool_parsers.abstract import ArgumentsStreamer, raw_arguments, value_end
from pagedllm.entrypoints.openai.tool_parsers.required import RequiredToolCallsParser

TEXT = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris, \\"FR\\"", "days": 12, "units": ["c", "f"], '
    '"opts": {"wind": true, "gust": null, "ratio": -1.5e3}}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


def _stream(parser: ToolParser, pieces: list[str]) -> tuple[str, dict[int, dict]]:
    content, calls = "", {}
    deltas = [parser.extract_tool_calls_streaming(p) for p in pieces] + [parser.finish()]
    for d in deltas:
        content += d.content or ""
        for tc in d.tool_calls:
            call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id is not None:
                assert call["id"] is None, "a call's id is sent once"
                call["id"], call["name"] = tc.id, tc.name
            call["arguments"] += tc.arguments or ""
    return content, calls


def test_hermes_whole() -> None:
    out = HermesToolParser(None).extract_tool_calls(TEXT)
    assert out.tools_called and out.content == "Let me check.\n"
    assert [c.function.name for c in out.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(out.tool_calls[0].function.arguments)["city"] == 'Paris, "FR"'
    assert out.tool_calls[1].function.arguments == "{}"
    assert out.tool_calls[0].function.arguments.endswith('"ratio": -1.5e3}}')  # the model's own text
    plain = HermesToolParser(None).extract_tool_calls("no calls here")
    assert not plain.tools_called and plain.content == "no calls here"
    broken = HermesToolParser(None).extract_tool_calls("<tool_call>{not json</tool_call>")
    assert not broken.tools_called and broken.content == "<tool_call>{not json</tool_call>"


@pytest.mark.parametrize("seed", range(30))
def test_hermes_streamed_equals_whole(seed: int) -> None:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(TEXT)), rng.randint(5, 60)))
    pieces = [TEXT[a:b] for a, b in zip([0, *cuts], [*cuts, len(TEXT)])]
    whole = HermesToolParser(None).extract_tool_calls(TEXT)
    content, calls = _stream(HermesToolParser(None), pieces)
    assert content == whole.content
    assert [calls[i]["name"] for i in sorted(calls)] == [c.function.name for c in whole.tool_calls]
    assert [calls[i]["arguments"] for i in sorted(calls)] == [c.function.arguments for c in whole.tool_calls]


def test_hermes_streamed_one_character_at_a_time_sends_arguments_early() -> None:
    parser = HermesToolParser(None)
    pieces = list(TEXT)
    first_args_at = None
    for i, piece in enumerate(pieces):
        delta = parser.extract_tool_calls_streaming(piece)
        if first_args_at is None and any(tc.arguments for tc in delta.tool_calls):
            first_args_at = i
    assert first_args_at is not None and first_args_at < TEXT.index("</tool_call>")


def test_unterminated_call_is_closed_at_the_end_and_partial_tags_are_held() -> None:
    parser = HermesToolParser(None)
    content, calls = _stream(parser, ["Hi <tool", '_call>{"name": "f", "arguments": {"x": 1}}'])
    assert content == "Hi " and calls[0]["name"] == "f" and calls[0]["arguments"] == '{"x": 1}'
    content, calls = _stream(HermesToolParser(None), ["a <tool", "box> b"])
    assert content == "a <toolbox> b" and not calls


def test_arguments_streamer_sends_the_model_text_as_it_grows() -> None:
    text = '{"a": "he said \\"}\\"", "b": [1, 2.5e3], "c": {"d": true}}, "tail": 1}'
    value = text[: text.index(', "tail"')]
    streamer, sent = ArgumentsStreamer(), ""
    for i in range(1, len(text) + 1):
        sent += streamer.update(text[:i], 0)
        assert value.startswith(sent), sent
    assert sent == value and raw_arguments(text, 0) == value
    assert value_end(text, 0) == len(value)
    assert value_end("12", 0) is None and value_end("12,", 0) == 2 and value_end('"a\\"b"', 0) == 6


def test_a_broken_call_is_skipped_whole_and_streamed() -> None:
    text = '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call><tool_call>{"name": "b", "argu</tool_call>'
    whole = HermesToolParser(None).extract_tool_calls(text)
    assert [c.function.name for c in whole.tool_calls] == ["a"]
    _, calls = _stream(HermesToolParser(None), [text[:30], text[30:]])
    assert [c["arguments"] for _, c in sorted(calls.items()) if c["name"] == "a"] == ['{"x": 1}']


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
BARE = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.mark.parametrize(
    "text, names",
    [
        (BARE, ["get_weather"]),  # what Qwen2.5-Coder-0.5B writes with tool_choice auto
        ('[{"name": "get_weather", "arguments": {"city": "A"}}, {"name": "get_weather"}]', ["get_weather"] * 2),
        ('{"name": "other", "arguments": {}}', []),  # not one of the request's tools: content
        ('{"name": "get_weather", "arguments": {}, "why": 1}', []),  # not only a call
        ('{"city": "Paris"}', []),
        ("The answer is {1, 2}", []),
        (BARE[:-2], []),  # cut short: not JSON
    ],
)
def test_hermes_untagged_call_json_whole_and_streamed(text: str, names: list[str]) -> None:
    whole = HermesToolParser(None, tools=WEATHER).extract_tool_calls(text)
    assert [c.function.name for c in whole.tool_calls] == names and whole.tools_called == bool(names)
    assert whole.content == (None if names else text)
    for seed in range(5):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        content, calls = _stream(HermesToolParser(None, tools=WEATHER), pieces)
        assert content == (whole.content or "")
        assert [calls[i]["name"] for i in sorted(calls)] == names
        assert [calls[i]["arguments"] for i in sorted(calls)] == [c.function.arguments for c in whole.tool_calls]
    # without tools (or with the tags) the old rules hold
    assert not HermesToolParser(None).extract_tool_calls(BARE).tools_called


def test_registry() -> None:
    assert ToolParserManager.get("hermes") is HermesToolParser
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ToolParserManager.get("nope")


# ---- llama3_json, mistral, pythonic, qwen3_coder ------------------------------------------------------------------

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "ratio": {"type": "number"},
                    "windy": {"type": "boolean"},
                    "opts": {"type": "object"},
                    "tags": {"type": ["array", "null"]},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]

# (parser, text, expected content, expected calls as (name, arguments as data)); each is parsed whole and streamed
CASES = {
    "llama3_json": (
        Llama3JsonToolParser,
        'Checking. {"not": "a call"} <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris, \\"FR\\"", '
        '"days": 12, "units": ["c", "f"], "opts": {"ratio": -1.5e3, "gust": null}}}; '
        '{"arguments": {"tz": "UTC"}, "name": "get_time"} ; {"name": "noop", "parameters": {}}',
        'Checking. {"not": "a call"} ',
        [
            (
                "get_weather",
                {"city": 'Paris, "FR"', "days": 12, "units": ["c", "f"], "opts": {"ratio": -1500.0, "gust": None}},
            ),
            ("get_time", {"tz": "UTC"}),
            ("noop", {}),
        ],
    ),
    "llama3_json_bare": (
        Llama3JsonToolParser,
        '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}',
        None,
        [("get_time", {"tz": "Europe/Paris"})],
    ),
    "mistral_list": (
        MistralToolParser,
        'Let me see.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, {"d": 2}]}}, '
        '{"name": "get_time", "arguments": {}}]',
        "Let me see.",
        [("get_weather", {"city": "Paris", "days": [1, {"d": 2}]}), ("get_time", {})],
    ),
    "mistral_args": (
        MistralToolParser,
        'Sure[TOOL_CALLS]get_weather[ARGS]{"city": "Paris, \\"FR\\"", "days": 3}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e'
        '[ARGS]{"tz": "UTC"}[TOOL_CALLS]noop{}',
        "Sure",
        [("get_weather", {"city": 'Paris, "FR"', "days": 3}), ("get_time", {"tz": "UTC"}), ("noop", {})],
    ),
    "pythonic": (
        PythonicToolParser,
        ' [get_weather(city="Paris, (FR)", days=-3, opts={"a": [1, 2.5, None, True], "b": (1, 2)}), get_time(),'
        "\n note(text='''a, ] b''', esc=\"q\\\"x\")]",
        None,
        [
            ("get_weather", {"city": "Paris, (FR)", "days": -3, "opts": {"a": [1, 2.5, None, True], "b": [1, 2]}}),
            ("get_time", {}),
            ("note", {"text": "a, ] b", "esc": 'q"x'}),
        ],
    ),
    "pythonic_tags": (
        PythonicToolParser,
        "<|python_start|>[get_time(tz='UTC')]<|python_end|>",
        None,
        [("get_time", {"tz": "UTC"})],
    ),
    "qwen3_coder": (
        Qwen3CoderToolParser,
        'I\'ll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis "FR"\nsecond <b>line</b>\n'
        "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=ratio>\n2.0\n</parameter>\n"
        '<parameter=windy>\nTrue\n</parameter>\n<parameter=opts>\n{"a": [1, 2]}\n</parameter>\n'
        "<parameter=tags>\nnull\n</parameter>\n<parameter=note>\nnul\n</parameter>\n<parameter=city>\nagain\n"
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
        "I'll check.\n",
        [
            (
                "get_weather",
                {
                    "city": 'Paris "FR"\nsecond <b>line</b>',
                    "days": 3,
                    "ratio": 2,
                    "windy": True,
                    "opts": {"a": [1, 2]},
                    "tags": None,
                    "note": "nul",
                },
            ),
            ("get_time", {}),
        ],
    ),
}


def _splits(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(60, len(text) - 1))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("case", sorted(CASES))
def test_whole(case: str) -> None:
    cls, text, content, expected = CASES[case]
    out = cls(None, tools=WEATHER_TOOLS).extract_tool_calls(text)
    assert out.tools_called and out.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in out.tool_calls] == expected
    assert len({c.id for c in out.tool_calls}) == len(expected)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("case", sorted(CASES))
def test_streamed_equals_whole(case: str, seed: int) -> None:
    cls, text, _, _ = CASES[case]
    whole = cls(None, tools=WEATHER_TOOLS).extract_tool_calls(text)
    pieces = list(text) if seed == 0 else _splits(text, seed)
    content, calls = _stream(cls(None, tools=WEATHER_TOOLS), pieces)
    assert (content or None) == whole.content
    assert [calls[i]["name"] for i in sorted(calls)] == [c.function.name for c in whole.tool_calls]
    assert [calls[i]["arguments"] for i in sorted(calls)] == [c.function.arguments for c in whole.tool_calls]
    assert all(c["id"] for c in calls.values())


MALFORMED = [
    (Llama3JsonToolParser, 'Here is JSON: {"name": "Bob", "age": 3} and {"name": "x", "parameters": 5}'),
    (Llama3JsonToolParser, "<|python_tag|>brave_search.call(query='x')"),
    (Llama3JsonToolParser, "function f() { return {a: 1}; }"),
    (MistralToolParser, "Hi [TOOL_CALLS] not a call at all"),
    (MistralToolParser, '[TOOL_CALLS][{"no": "name"}]'),
    (MistralToolParser, "[TOOL_CALLS]get_weather"),
    (PythonicToolParser, "Sure: [get_weather(city='Paris')]"),
    (PythonicToolParser, "[get_weather(city=paris)]"),
    (PythonicToolParser, "[get_weather('Paris')]"),
    (PythonicToolParser, "[os.system(cmd='ls')]"),
    (PythonicToolParser, "[f(x={1, 2})]"),
    (PythonicToolParser, "[]"),
    (Qwen3CoderToolParser, "Use <tool_call> like this, no function here </tool_call>"),
    (Qwen3CoderToolParser, "<function=\nbroken"),
]


@pytest.mark.parametrize(("cls", "text"), MALFORMED)
def test_malformed_output_stays_content(cls: type[ToolParser], text: str) -> None:
    out = cls(None).extract_tool_calls(text)
    assert not out.tools_called and out.tool_calls == [] and out.content == text
    for seed in range(5):
        content, calls = _stream(cls(None), _splits(text, seed))
        assert content == text and not calls


def test_llama3_json_streams_arguments_before_the_object_closes() -> None:
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
    parser, sent = Llama3JsonToolParser(None), ""
    for i, ch in enumerate(text):
        delta = parser.extract_tool_calls_streaming(ch)
        assert not delta.content
        sent += "".join(tc.arguments or "" for tc in delta.tool_calls)
        if i == text.index('"days"'):
            assert sent == '{"city": "Paris", "'
    assert sent == '{"city": "Paris", "days": 3}'


def test_llama3_json_holds_back_what_may_be_a_call_only() -> None:
    parser = Llama3JsonToolParser(None)
    assert parser.extract_tool_calls_streaming("a { b").content == "a { b"  # no JSON key after the brace
    assert parser.extract_tool_calls_streaming(" {").content == " "
    assert parser.extract_tool_calls_streaming(' "k": 1').content is None  # may still be a call
    assert parser.extract_tool_calls_streaming("}").content == '{ "k": 1}'
    assert parser.extract_tool_calls_streaming(" <|python_").content == " "


def test_later_broken_calls_are_dropped_earlier_ones_kept() -> None:
    out = Llama3JsonToolParser(None).extract_tool_calls('{"name": "a", "parameters": {}}; {"name": "b"}; junk')
    assert [c.function.name for c in out.tool_calls] == ["a"] and out.content is None
    out = PythonicToolParser(None).extract_tool_calls("[a(x=1), b(y=z), c()] and text")
    assert [c.function.name for c in out.tool_calls] == ["a"] and out.content is None
    out = MistralToolParser(None).extract_tool_calls('[TOOL_CALLS]a[ARGS]{"x": 1} trailing [TOOL_CALLS]b[ARGS]{}')
    assert [c.function.name for c in out.tool_calls] == ["a"] and out.content is None


def test_mistral_ids_are_nine_alphanumerics_and_special_tokens_are_kept() -> None:
    _, text, _, _ = CASES["mistral_args"]
    out = MistralToolParser(None).extract_tool_calls(text)
    assert all(len(c.id) == 9 and c.id.isalnum() for c in out.tool_calls)
    _, calls = _stream(MistralToolParser(None), _splits(text, 3))
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls.values())
    assert MistralToolParser.needs_special_tokens and not HermesToolParser.needs_special_tokens
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=WEATHER_TOOLS)
    assert plan_tools(request, True, "mistral").needs_special_tokens()
    assert not plan_tools(request, True, "hermes").needs_special_tokens()


def test_qwen3_coder_streams_string_values_as_written() -> None:
    head = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    parser = Qwen3CoderToolParser(None, tools=WEATHER_TOOLS)
    delta = parser.extract_tool_calls_streaming(head)
    assert [tc.name for tc in delta.tool_calls if tc.id] == ["get_weather"]
    assert "".join(tc.arguments or "" for tc in delta.tool_calls) == '{"city": "Par'
    # held back: the newline before the closing tag, and the partial tag itself
    assert not parser.extract_tool_calls_streaming("is\n</param").tool_calls[0].arguments.endswith("\\n")
    rest = parser.extract_tool_calls_streaming("eter>\n<parameter=days>\n4\n</parameter>\n</function>")
    assert "".join(tc.arguments or "" for tc in rest.tool_calls) == '", "days": 4}'
    # a string that may still be "null" is held back
    parser = Qwen3CoderToolParser(None, tools=WEATHER_TOOLS)
    delta = parser.extract_tool_calls_streaming("<function=get_weather>\n<parameter=city>\nNul")
    assert "".join(tc.arguments or "" for tc in delta.tool_calls) == "{"
    rest = parser.extract_tool_calls_streaming("L\n</parameter>\n</function>")
    assert "".join(tc.arguments or "" for tc in rest.tool_calls) == '"city": null}'


def test_qwen3_coder_without_tools_keeps_strings() -> None:
    text = "<tool_call>\n<function=f>\n<parameter=n>\n3\n</parameter>\n<parameter=b>\ntrue\n</parameter>\n</function>"
    (call,) = Qwen3CoderToolParser(None).extract_tool_calls(text).tool_calls
    assert call.function.arguments == '{"n": "3", "b": "true"}'
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"n": {"type": "integer"}}}}}]
    (call,) = Qwen3CoderToolParser(None, tools=tools).extract_tool_calls(text).tool_calls
    assert call.function.arguments == '{"n": 3, "b": "true"}'  # b is not declared: a string
    bad = text.replace("\n3\n", "\nthree\n")
    (call,) = Qwen3CoderToolParser(None, tools=tools).extract_tool_calls(bad).tool_calls
    assert json.loads(call.function.arguments)["n"] == "three"


def test_an_output_cut_short_closes_what_it_can() -> None:
    # qwen3_coder: an open parameter and function end with the output (as vLLM's parser reads them)
    text = "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC"
    (call,) = Qwen3CoderToolParser(None).extract_tool_calls(text).tool_calls
    assert call.function.arguments == '{"tz": "UTC"}'
    _, calls = _stream(Qwen3CoderToolParser(None), _splits(text, 1))
    assert calls[0]["arguments"] == '{"tz": "UTC"}'
    # JSON formats: an object that never closes is no call
    out = Llama3JsonToolParser(None).extract_tool_calls('{"name": "a", "parameters": {"x": 1}')
    assert not out.tools_called


def test_the_request_tools_reach_the_parser() -> None:
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=WEATHER_TOOLS)
    parser = plan_tools(request, True, "qwen3_coder").parser(None)
    assert isinstance(parser, Qwen3CoderToolParser) and parser.tools == WEATHER_TOOLS


def test_first_call_only() -> None:
    _, text, _, _ = CASES["llama3_json"]
    out = FirstCallOnly(Llama3JsonToolParser(None)).extract_tool_calls(text)
    assert [c.function.name for c in out.tool_calls] == ["get_weather"]
    assert out.content == 'Checking. {"not": "a call"} '
    content, calls = _stream(FirstCallOnly(Llama3JsonToolParser(None)), _splits(text, 7))
    assert list(calls) == [0] and calls[0]["arguments"] == out.tool_calls[0].function.arguments
    assert content == out.content


def test_parallel_tool_calls_false_plans_one_call() -> None:
    def request(**kw: object) -> ChatCompletionRequest:
        return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=WEATHER_TOOLS, **kw)

    assert request().parallel_tool_calls is True
    plan = plan_tools(request(tool_choice="required", parallel_tool_calls=False), True, "hermes")
    assert not plan.parallel
    constraint = tool_constraint(request(), plan)
    assert constraint is not None and constraint.json["maxItems"] == 1
    assert isinstance(plan.parser(None), FirstCallOnly)
    parallel = plan_tools(request(tool_choice="required"), True, "hermes")
    assert "maxItems" not in tool_constraint(request(), parallel).json
    assert isinstance(parallel.parser(None), RequiredToolCallsParser)
    auto = plan_tools(request(parallel_tool_calls=False), True, "qwen3_coder")
    parser = auto.parser(None)
    assert isinstance(parser, FirstCallOnly) and isinstance(parser.parser, Qwen3CoderToolParser)
    assert parser.parser.tools == WEATHER_TOOLS


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("llama3_json", Llama3JsonToolParser),
        ("llama4_json", Llama3JsonToolParser),
        ("mistral", MistralToolParser),
        ("pythonic", PythonicToolParser),
        ("llama4_pythonic", PythonicToolParser),
        ("qwen3_coder", Qwen3CoderToolParser),
    ],
)
def test_registered_under_vllm_names(name: str, cls: type[ToolParser]) -> None:
    assert ToolParserManager.get(name) is cls
