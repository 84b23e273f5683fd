"""gpt-oss's harmony format (pagedllm/reasoning/harmony.py), on replies written as the harmony format's documentation
describes them (the prompt ends with `<|start|>assistant`, so a reply opens with its first header):
* the `openai_gptoss` reasoning parser: the analysis channel (and built-in tools' messages) is the reasoning, the
  final channel and preambles the content, calls to `functions.*` handed on to the `openai` tool parser; text not
  in harmony is all content; a stop token kept at the end is dropped;
* streamed in random splits (markers cut anywhere), the reasoning, content and calls join into the whole reply's,
  through the server's own ChoiceStream and message builder;
* the tool parser: names, arguments as written (whitespace around them dropped, `{}` when empty), content around;
* the parser needs harmony's tokens; gpt-oss models take it by default, and their end tokens stop at <|call|>."""

from __future__ import annotations

import random

import pytest

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.serving_chat import ChoiceStream, plan_tools
from pagedllm.entrypoints.openai.tool_parsers import HarmonyToolParser, ToolParserManager
from pagedllm.reasoning import ReasoningParser, default_reasoning_parser
from pagedllm.reasoning.harmony import HarmonyStream, split

THINK = "<|channel|>analysis<|message|>The user wants the weather. I should call get_weather.<|end|>"
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
CASES = {
    "answer": (
        THINK + "<|start|>assistant<|channel|>final<|message|>It is **sunny** in Paris.<|return|>",
        ("The user wants the weather. I should call get_weather.", "It is **sunny** in Paris.", []),
    ),
    "final only": ("<|channel|>final<|message|>4", ("", "4", [])),
    "call": (THINK + CALL + "<|call|>", ("The user wants the weather. I should call get_weather.", "", [
        ("get_weather", '{"city": "Paris"}')])),
    "recipient first, bare json, preamble": (
        "<|channel|>commentary<|message|>Checking two cities.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|> {"city": "Oslo"}\n<|call|>'
        "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|><|call|>",
        ("", "Checking two cities.", [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]),
    ),
    "built-in tool": (
        '<|channel|>analysis to=python code<|message|>print(2 + 2)<|call|>',
        ("print(2 + 2)", "", []),
    ),
    "cut off in the arguments": (THINK + CALL[:-4], ("The user wants the weather. I should call get_weather.", "", [
        ("get_weather", '{"city": "Par')])),
    "cut off in a header": (THINK + "<|start|>assistant<|channel|>fin", (
        "The user wants the weather. I should call get_weather.", "", [])),
    "not harmony": ('{"a": 1}', ("", '{"a": 1}', [])),
}  # fmt: skip


def _whole(text: str) -> tuple[str, str, list[tuple[str, str]]]:
    parts = split(text)
    calls = HarmonyToolParser().extract_tool_calls(parts.content)
    content = calls.content or "" if calls.tools_called else parts.content
    return parts.reasoning, content, [(c.function.name, c.function.arguments) for c in calls.tool_calls]


@pytest.mark.parametrize("case", CASES)
def test_whole(case: str) -> None:
    text, want = CASES[case]
    assert _whole(text) == want


def _pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", range(6))
def test_streamed_joins_into_whole(case: str, seed: int) -> None:
    text, want = CASES[case]
    pieces = _pieces(text, random.Random(seed)) if seed else list(text)  # seed 0: one character at a time
    stream, parser = HarmonyStream(), HarmonyToolParser()
    reasoning, content, calls = "", "", {}
    for k, piece in enumerate(pieces):
        r, c = stream.step(piece)
        if k == len(pieces) - 1:
            r2, c2 = stream.finish()
            r, c = (r or "") + (r2 or ""), (c or "") + (c2 or "")
        reasoning += r or ""
        deltas = [parser.extract_tool_calls_streaming(c or "")] + ([parser.finish()] if k == len(pieces) - 1 else [])
        for d in deltas:
            content += d.content or ""
            for tc in d.tool_calls:
                call = calls.setdefault(tc.index, ["", ""])
                call[0] += tc.name or ""
                call[1] += tc.arguments or ""
    assert (reasoning, content, [tuple(calls[i]) for i in sorted(calls)]) == want


class _Vocab:
    def __init__(self, tokens: list[str]) -> None:
        self.vocab = {t: i for i, t in enumerate(tokens)}

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


HARMONY_VOCAB = _Vocab(["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>"])


def test_the_servers_choice_stream_and_message() -> None:
    """Through serving_chat's ChoiceStream (reasoning parser, then the tool plan's parser), streamed in pieces."""
    reasoner = ReasoningParser.for_tokenizer("openai_gptoss", HARMONY_VOCAB)
    assert reasoner.needs_special_tokens and reasoner.is_reasoning_end([])  # a grammar applies from the start
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "Weather?"}], tools=tools)
    plan = plan_tools(request, True, "openai")
    assert plan.needs_special_tokens()
    text, _ = CASES["call"]
    stream = ChoiceStream(plan, None, reasoner)
    reasoning, names, args, finish = "", [], "", None
    pieces = _pieces(text, random.Random(7))
    for k, piece in enumerate(pieces):
        r, c, calls, finish = stream.step(piece, "stop" if k == len(pieces) - 1 else None)
        reasoning += r or ""
        assert not c
        for call in calls or []:
            names += [call["function"]["name"]] if call["function"].get("name") else []
            args += call["function"].get("arguments") or ""
    assert (reasoning, names, args, finish) == (CASES["call"][1][0], ["get_weather"], '{"city": "Paris"}', "tool_calls")


def test_the_parser_needs_harmonys_tokens_and_is_gpt_oss_default() -> None:
    with pytest.raises(ValueError, match="openai_gptoss.*<\\|channel\\|>"):
        ReasoningParser.for_tokenizer("openai_gptoss", _Vocab(["<|message|>", "<think>"]))
    assert default_reasoning_parser("gpt_oss", HARMONY_VOCAB) == "openai_gptoss"
    assert default_reasoning_parser("gpt_oss", _Vocab(["<s>", "</s>"])) is None  # a vocabulary without harmony
    assert default_reasoning_parser("llama", HARMONY_VOCAB) is None
    assert ToolParserManager.get("openai") is HarmonyToolParser
