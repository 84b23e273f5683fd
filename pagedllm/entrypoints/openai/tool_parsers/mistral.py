"""The Mistral tool-call format, vLLM's `mistral`: content, then `[TOOL_CALLS]` and either a JSON list of calls
`[{"name": ..., "arguments": {...}}, ...]` (tokenizers before v11) or one or more `[TOOL_CALLS]NAME[ARGS]{...}`
(v11 on; `[ARGS]` may be missing, and a `[CALL_ID]id` between the name and `[ARGS]` is read over).

`[TOOL_CALLS]` and `[ARGS]` are special tokens: the parser asks the server to keep them in the text
(`needs_special_tokens`). Tool-call ids are 9 letters and digits, as Mistral's tokenizers require (vLLM's
MistralToolCall). A call's `arguments` is the raw text of its JSON object. When what follows the first
`[TOOL_CALLS]` is no call, all of the text is content; text after the calls is dropped."""

from __future__ import annotations

import json
import random
import re
import string
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract import ToolParserManager, value_end
from pagedllm.entrypoints.openai.tool_parsers.json_calls import JsonObjectCalls, skip_whitespace

TOOL_CALLS = "[TOOL_CALLS]"
_ID_CHARS = string.ascii_letters + string.digits
_HEADER = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[CALL_ID\]\s*[A-Za-z0-9]+\s*)?(?:\[ARGS\])?\s*")


def mistral_tool_call_id() -> str:
    return "".join(random.choices(_ID_CHARS, k=9))


@ToolParserManager.register("mistral")
class MistralToolParser(JsonObjectCalls):
    needs_special_tokens = True
    arguments_required = False  # vLLM reads a missing "arguments" of the list form as {}

    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        # "content", "start" (after the first [TOOL_CALLS]), "item"/"item_end" (the list form),
        # "name"/"arguments"/"next" (the [TOOL_CALLS]NAME[ARGS]{...} form)
        self._mode = "content"
        self._region = 0  # where the first [TOOL_CALLS] is

    def new_id(self) -> str:
        return mistral_tool_call_id()

    def _advance(self, final: bool) -> None:
        steps = {
            "content": self._content_step,
            "start": self._start_step,
            "item": self._item_step,
            "item_end": self._item_end_step,
            "name": self._name_step,
            "arguments": self._arguments_step,
            "next": self._next_step,
        }
        self._run_steps(steps, final)

    def _end(self) -> None:
        self._give_up(self._region)

    def _content_step(self, final: bool) -> bool:
        i = self._content_until(TOOL_CALLS, final)
        if i is None:
            return False
        self._region, self._pos, self._mode = i, i + len(TOOL_CALLS), "start"
        return True

    def _start_step(self, final: bool) -> bool:
        j = skip_whitespace(self._text, self._pos)
        if j == len(self._text):
            if final:
                self._end()
            return False
        if self._text[j] == "[":
            self._pos, self._mode = j + 1, "item"
        else:
            self._mode = "name"
        return True

    # ---- the list form ------------------------------------------------------------------------------------------

    def _item_step(self, final: bool) -> bool:
        text = self._text
        j = skip_whitespace(text, self._pos)
        if j == len(text) or text[j] != "{":
            if j < len(text) or final:
                self._end()
            return False
        self._pos = j
        end = self.object_call(j, final)
        if end is None:
            return False
        self._pos, self._mode = end, "item_end"
        return True

    def _item_end_step(self, final: bool) -> bool:
        text = self._text
        j = skip_whitespace(text, self._pos)
        if j < len(text) and text[j] == ",":
            self._pos, self._mode = j + 1, "item"
            return True
        if j < len(text) or final:
            self._end()
        return False

    # ---- the [TOOL_CALLS]NAME[ARGS]{...} form ----------------------------------------------------------------

    def _name_step(self, final: bool) -> bool:
        text = self._text
        brace = text.find("{", self._pos)
        if brace < 0:
            if final:
                self._end()
            return False
        m = _HEADER.fullmatch(text, self._pos, brace)
        if m is None:
            self._end()
            return False
        self._open_call(m.group(1))
        self._pos, self._mode = brace, "arguments"
        return True

    def _arguments_step(self, final: bool) -> bool:
        text = self._text
        end = value_end(text, self._pos)
        if end is None:
            if not final:
                self._stream_arguments(text, self._pos)
                return False
            self._close_call(None)
            self._stop()
            return False
        arguments = text[self._pos : end]
        try:
            valid = isinstance(json.loads(arguments), dict)
        except ValueError:
            valid = False
        self._close_call(arguments if valid else None)
        self._pos, self._mode = end, "next"
        return True

    def _next_step(self, final: bool) -> bool:
        text = self._text
        j = skip_whitespace(text, self._pos)
        if text.startswith(TOOL_CALLS, j):
            self._pos, self._mode = j + len(TOOL_CALLS), "name"
            return True
        if not final and TOOL_CALLS.startswith(text[j:]):
            return False
        self._stop()
        return False
