"""Tool-call parsers: the Hermes format whole and streamed in every split of the text; the streamed argument
pieces join into exactly the non-streamed arguments; the argument streamer never sends what a later token
changes, and says so if it ever would."""

from __future__ import annotations

import json
import random

import pytest

from pagedllm.entrypoints.openai.tool_parsers import HermesToolParser, ToolParserManager
from pagedllm.entrypoints.openai.tool_parsers.abstract import ArgumentsStreamer, raw_arguments, value_end

TEXT = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris, \\"FR\\"", "days": 12, "units": ["c", "f"], '
    '"opts": {"wind": true, "gust": null, "ratio": -1.5e3}}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


def _stream(parser: HermesToolParser, pieces: list[str]) -> tuple[str, dict[int, dict]]:
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


def test_registry() -> None:
    assert ToolParserManager.get("hermes") is HermesToolParser
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ToolParserManager.get("nope")
