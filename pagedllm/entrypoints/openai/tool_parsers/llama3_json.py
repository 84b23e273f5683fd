"""The Llama 3.1/3.2 (and 4) JSON tool-call format, vLLM's `llama3_json` (alias `llama4_json`): an optional
`<|python_tag|>`, then one or more calls `{"name": ..., "parameters": {...}}` ("arguments" is accepted too)
separated by `;`.

Where the calls start: at a `<|python_tag|>` followed by a call, or at a JSON object in the text that is a call
(it begins `{"name": "...", "parameters":`, or it is complete and has a string "name" and one object "parameters" or
"arguments"). The text before is the content; a tag or an object that is no call stays content (its text is held
back while it may still be one). After the calls, text that is not `;` and another object is dropped, and a call
that turns out broken is left out (see IncrementalToolParser)."""

from __future__ import annotations

import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract import ToolParserManager, value_end
from pagedllm.entrypoints.openai.tool_parsers.json_calls import JsonObjectCalls, skip_whitespace
from pagedllm.text_tags import partial_tag_length

PYTHON_TAG = "<|python_tag|>"
_CANDIDATE = re.compile(r'<\|python_tag\|>|\{(?=\s*")')
_OPEN_BRACE_AT_END = re.compile(r"\{\s*\Z")


@ToolParserManager.register("llama3_json", "llama4_json")
class Llama3JsonToolParser(JsonObjectCalls):
    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self._mode = "content"  # "content", "call" (at the object `_pos`), "separator" (after a call)

    def _advance(self, final: bool) -> None:
        while not self._stopped:
            if self._mode == "content":
                more = self._content_step(final)
            elif self._mode == "call":
                more = self._call_step(final)
            else:
                more = self._separator_step(final)
            if not more:
                return

    def _content_step(self, final: bool) -> bool:
        text, pos = self._text, self._pos
        m = _CANDIDATE.search(text, pos)
        if m is None:
            end = len(text)
            if not final:
                end -= self._held_back(text, pos)
            self._emit_content(text[pos:end])
            self._pos = end
            return False
        start = obj = m.start()
        if m.group() == PYTHON_TAG:
            obj = skip_whitespace(text, m.end())
            if obj < len(text) and text[obj] != "{":  # a tag without JSON after it is content
                self._emit_content(text[pos : m.end()])
                self._pos = m.end()
                return True
            if obj == len(text):
                if final:
                    self._emit_content(text[pos:])
                    self._pos = len(text)
                    return False
                self._emit_content(text[pos:start])
                self._pos = start
                return False
        decision = self.is_call(obj, final)
        if decision is None:  # hold the candidate back until it tells
            self._emit_content(text[pos:start])
            self._pos = start
            return False
        if not decision:  # an object that is no call: content
            end = value_end(text, obj) or len(text)
            self._emit_content(text[pos:end])
            self._pos = end
            return True
        self._emit_content(text[pos:start])
        self._pos, self._mode = obj, "call"
        return True

    @staticmethod
    def _held_back(text: str, pos: int) -> int:
        """How much of the text's end may still become the start of a call (a partial tag, or `{` and spaces)."""
        held = partial_tag_length(text[pos:], PYTHON_TAG)
        m = _OPEN_BRACE_AT_END.search(text, pos)
        return max(held, len(text) - m.start()) if m is not None else held

    def _call_step(self, final: bool) -> bool:
        end = self.object_call(self._pos, final)
        if end is None:
            return False
        self._pos, self._mode = end, "separator"
        return True

    def _separator_step(self, final: bool) -> bool:
        text = self._text
        i = skip_whitespace(text, self._pos)
        if i < len(text) and text[i] == ";":
            j = skip_whitespace(text, i + 1)
            if j < len(text):
                if text[j] != "{":
                    self._stop()
                    return False
                self._pos, self._mode = j, "call"
                return True
        elif i < len(text):
            self._stop()
            return False
        if final:
            self._stop()
        return False
