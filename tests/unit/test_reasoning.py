"""Reasoning parsers: the whole-text split, and the streamed split in every cut of the text joining into it."""

from __future__ import annotations

import random

import pytest

from pagedllm.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser, ReasoningParser, ReasoningStream

CASES = [
    (DeepSeekR1ReasoningParser(), "let me think</think>The answer is 4.", ("let me think", "The answer is 4.")),
    (DeepSeekR1ReasoningParser(), "<think>hmm</think>4", ("hmm", "4")),
    (DeepSeekR1ReasoningParser(), "still thinking", ("still thinking", None)),
    (DeepSeekR1ReasoningParser(), "</think>only content", (None, "only content")),
    (Qwen3ReasoningParser(), "<think>a < b</think>\n\nYes.", ("a < b", "\n\nYes.")),
    (Qwen3ReasoningParser(), "No thinking here <thi", (None, "No thinking here <thi")),
    (Qwen3ReasoningParser(), "<think>cut off", ("cut off", None)),
]


@pytest.mark.parametrize(("parser", "text", "want"), CASES)
def test_whole(parser: ReasoningParser, text: str, want: tuple) -> None:
    assert parser.extract_reasoning(text) == want


@pytest.mark.parametrize(("parser", "text", "want"), CASES)
@pytest.mark.parametrize("seed", range(8))
def test_streamed_joins_into_whole(parser: ReasoningParser, text: str, want: tuple, seed: int) -> None:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    stream = ReasoningStream(parser)
    reasoning, content = "", ""
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        r, c = stream.step(text[a:b])
        reasoning += r or ""
        content += c or ""
    r, c = stream.finish()
    reasoning += r or ""
    content += c or ""
    assert (reasoning or None, content or None) == want


def test_reasoning_end_in_prompt() -> None:
    r1 = DeepSeekR1ReasoningParser(end_token_id=9, start_token_id=8)
    assert not r1.is_reasoning_end([1, 2, 8]) and r1.is_reasoning_end([1, 8, 3, 9]) and not r1.is_reasoning_end([1])
    q = Qwen3ReasoningParser(end_token_id=9, start_token_id=8)
    assert q.is_reasoning_end([1, 8, 9]) and not q.is_reasoning_end([1, 9, 8]) and not q.is_reasoning_end([1])


def test_for_tokenizer_needs_the_end_token() -> None:
    class Tok:
        def __init__(self, vocab: dict[str, int]) -> None:
            self.vocab = vocab

        def get_vocab(self) -> dict[str, int]:
            return self.vocab

    parser = ReasoningParser.for_tokenizer("qwen3", Tok({"<think>": 5, "</think>": 6}))
    assert isinstance(parser, Qwen3ReasoningParser) and parser.end_token_id == 6
    with pytest.raises(ValueError, match="needs the token '</think>'"):
        ReasoningParser.for_tokenizer("deepseek_r1", Tok({"a": 1}))
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        ReasoningParser.for_tokenizer("nope", Tok({}))
