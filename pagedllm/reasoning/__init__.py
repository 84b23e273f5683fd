"""Reasoning parsers: split a thinking model's output into `reasoning_content` and `content` (`--reasoning-parser`).

Contract. A parser is registered by name (vLLM's: "deepseek_r1", "qwen3", "openai_gptoss") with the text of its start
and end tags; "openai_gptoss" reads gpt-oss's harmony channels instead (harmony.py; the default reasoning parser of
a gpt-oss model, `default_reasoning_parser`). `ReasoningParser.for_tokenizer(name, tokenizer)` checks that the
tokenizer has the end tag as one token (ValueError naming the parser otherwise: the engine core detects the end of
reasoning by that token id; openai_gptoss: that it has harmony's tokens).
* Whole text: `extract_reasoning(text)` -> (reasoning, content), either None when empty.
  - deepseek_r1: the prompt opens the thinking (its template ends with `<think>`), so everything before `</think>`
    is reasoning; a `<think>` the model writes anyway is dropped; no `</think>` at all: all of it is reasoning.
  - qwen3: reasoning only after a `<think>` the model writes, up to `</think>` (or the end, if the thinking was
    cut off); without `<think>`, all of it is content.
* Streamed: `parser.stream().step(delta_text)` (`ReasoningStream` for tags) -> (reasoning piece, content piece); a
  tag split across deltas is held back until it is whole; `finish()` flushes at the end. The pieces join into the
  whole split.
* In the engine core, structured output applies only after reasoning ends: `is_reasoning_end(token_ids)` says
  whether these (prompt) tokens already close the thinking; the scheduler then watches the output for the end
  token id and starts the grammar with the tokens after it. (openai_gptoss: the grammar applies from the first
  token, and the reply, not in harmony then, is all content.)
* `needs_special_tokens`: the parser reads markers that are special tokens; the server keeps them in the text.
"""

from __future__ import annotations

from typing import Any

from pagedllm.reasoning import harmony
from pagedllm.text_tags import partial_tag_length

REASONING_PARSERS = ("deepseek_r1", "qwen3", "openai_gptoss")


def default_reasoning_parser(model_type: str | None, tokenizer: Any) -> str | None:
    """The reasoning parser the server reads a model's replies with when none is named: a gpt-oss model's harmony
    channels (as vLLM does), where its vocabulary has harmony's tokens; else none. Only the front end: openai_gptoss
    changes nothing in the engine core (`is_reasoning_end` is always true)."""
    if model_type not in ("gpt_oss", "gpt-oss"):
        return None
    return "openai_gptoss" if not GptOssReasoningParser.missing(tokenizer.get_vocab()) else None


class ReasoningParser:
    name = ""
    start_tag = "<think>"
    end_tag = "</think>"
    prompt_opens_thinking = False  # deepseek_r1: output before the end tag is reasoning even without a start tag
    needs_special_tokens = False

    def __init__(self, end_token_id: int | None = None, start_token_id: int | None = None) -> None:
        self.end_token_id = end_token_id
        self.start_token_id = start_token_id

    @staticmethod
    def for_tokenizer(name: str, tokenizer: Any) -> ReasoningParser:
        cls = _PARSERS.get(name)
        if cls is None:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {name!r}")
        return cls.from_vocab(name, tokenizer.get_vocab())

    @classmethod
    def from_vocab(cls, name: str, vocab: dict[str, int]) -> ReasoningParser:
        """The parser for a tokenizer of this vocabulary, which must hold the end tag as one token."""
        end_id = vocab.get(cls.end_tag)
        if end_id is None:
            raise ValueError(
                f"reasoning_parser {name!r} needs the token {cls.end_tag!r} in the model's vocabulary, which has none"
            )
        return cls(end_id, vocab.get(cls.start_tag))

    def stream(self) -> Any:
        """The streamed split of one output: `step(delta)` and `finish()`, each -> (reasoning, content) pieces."""
        return ReasoningStream(self)

    def is_reasoning_end(self, token_ids: list[int]) -> bool:
        """Whether these tokens (a prompt) close the thinking: the last start/end tag among them is an end tag. With
        neither, the thinking is still to come (vLLM's rule): a grammar waits for the end tag in the output."""
        for tid in reversed(token_ids):
            if tid == self.end_token_id:
                return True
            if tid == self.start_token_id:
                return False
        return False

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        end = text.find(self.end_tag)
        if self.prompt_opens_thinking:
            if end < 0:
                return _none_if_empty(text.replace(self.start_tag, "", 1)), None
            reasoning = text[:end].replace(self.start_tag, "", 1)
            return _none_if_empty(reasoning), _none_if_empty(text[end + len(self.end_tag) :])
        start = text.find(self.start_tag)
        if start < 0:
            return None, _none_if_empty(text)
        end = text.find(self.end_tag, start)
        if end < 0:  # the thinking was cut off (max_tokens): all of it is reasoning
            return _none_if_empty(text[start + len(self.start_tag) :]), _none_if_empty(text[:start])
        reasoning = text[start + len(self.start_tag) : end]
        content = text[:start] + text[end + len(self.end_tag) :]
        return _none_if_empty(reasoning), _none_if_empty(content)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    prompt_opens_thinking = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class GptOssReasoningParser(ReasoningParser):
    """gpt-oss's harmony format (harmony.py): the analysis channel is the reasoning, the rest the content."""

    name = "openai_gptoss"
    needs_special_tokens = True

    @staticmethod
    def missing(vocab: dict[str, int]) -> list[str]:
        """The harmony tokens the parser reads that `vocab` lacks."""
        return [t for t in (harmony.CHANNEL, harmony.MESSAGE) if t not in vocab]

    @classmethod
    def from_vocab(cls, name: str, vocab: dict[str, int]) -> ReasoningParser:
        missing = cls.missing(vocab)
        if missing:
            raise ValueError(
                f"reasoning_parser {name!r} reads gpt-oss's harmony format, whose tokens {', '.join(missing)} the "
                "model's vocabulary lacks"
            )
        return cls()

    def is_reasoning_end(self, token_ids: list[int]) -> bool:
        return True

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        parts = harmony.split(text)
        return _none_if_empty(parts.reasoning), _none_if_empty(parts.content)

    def stream(self) -> Any:
        return harmony.HarmonyStream()


_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
    "openai_gptoss": GptOssReasoningParser,
}


def _none_if_empty(text: str) -> str | None:
    return text if text else None


class ReasoningStream:
    """The streamed split of one output (see the module docstring)."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self._buffer = ""
        # deepseek_r1 starts inside the thinking; qwen3 before it (until a start tag comes)
        self._state = "reasoning" if parser.prompt_opens_thinking else "before"
        self._start_seen = False

    def step(self, delta: str) -> tuple[str | None, str | None]:
        self._buffer += delta
        reasoning, content = "", ""
        p = self.parser
        while self._buffer:
            if self._state == "before":  # qwen3: content until a start tag
                i = self._buffer.find(p.start_tag)
                if i < 0:
                    keep = partial_tag_length(self._buffer, p.start_tag)
                    content += self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                content += self._buffer[:i]
                self._buffer = self._buffer[i + len(p.start_tag) :]
                self._state = "reasoning"
                self._start_seen = True
            elif self._state == "reasoning":
                if p.prompt_opens_thinking and not self._start_seen:
                    j = self._buffer.find(p.start_tag)
                    if j >= 0 and self._buffer.find(p.end_tag) not in range(0, j):
                        reasoning += self._buffer[:j]
                        self._buffer = self._buffer[j + len(p.start_tag) :]
                        self._start_seen = True
                        continue
                i = self._buffer.find(p.end_tag)
                if i < 0:
                    tags = [p.end_tag] + ([p.start_tag] if p.prompt_opens_thinking and not self._start_seen else [])
                    keep = max(partial_tag_length(self._buffer, t) for t in tags)
                    reasoning += self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                reasoning += self._buffer[:i]
                self._buffer = self._buffer[i + len(p.end_tag) :]
                self._state = "content"
            else:
                content += self._buffer
                self._buffer = ""
        return reasoning or None, content or None

    def finish(self) -> tuple[str | None, str | None]:
        rest, self._buffer = self._buffer, ""
        if not rest:
            return None, None
        return (rest, None) if self._state == "reasoning" else (None, rest)
