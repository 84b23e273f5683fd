"""The pythonic tool-call format (Llama 3.2 and 4, ToolACE), vLLM's `pythonic` (alias `llama4_pythonic`): the output
is a Python list of calls, `[get_weather(city="Paris", days=3), other()]`, optionally between `<|python_start|>`
and `<|python_end|>`.

A call is a plain name called with keyword arguments whose values are literals (`ast.literal_eval`: strings,
numbers, booleans, None, and lists, tuples and dicts with string keys of those); its `arguments` is
`json.dumps` of them (in order, not ASCII-escaped). Anything else is no call: when the output does not start with
`[` or its first element is no call, all of it is content; a later element that is no call ends the calls (those
before it are kept), and text after the list is dropped. Streamed, each call goes out whole (id, name and
arguments) as soon as the element after it begins or the list closes."""

from __future__ import annotations

import ast
import json
import math
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract import IncrementalToolParser, ToolParserManager
from pagedllm.entrypoints.openai.tool_parsers.json_calls import skip_whitespace

PYTHON_START = "<|python_start|>"


def element_end(text: str, start: int) -> int | None:
    """The index of the `,` or `]` that ends the list element starting at `text[start]` (brackets and Python
    strings skipped over; a `)` or `}` closing nothing ends it too), or None while the text does not hold it yet."""
    depth, i, n = 0, start, len(text)
    while i < n:
        ch = text[i]
        if ch in "'\"":
            quote = ch * 3 if text.startswith(ch * 3, i) else ch
            i += len(quote)
            while not text.startswith(quote, i):
                if i >= n:
                    return None
                i += 2 if text[i] == "\\" else 1
            i += len(quote)
            continue
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                return i
            depth -= 1
        elif ch == "," and depth == 0:
            return i
        i += 1
    return None


def _json_value(value: Any) -> Any:
    """A literal as JSON data (tuples become lists); ValueError when it has none (bytes, sets, nan, ...)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("not a finite number")
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ValueError("a dict key is not a string")
        return {k: _json_value(v) for k, v in value.items()}
    raise ValueError(f"{type(value).__name__} is not JSON")


def python_call(source: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of `source` when it is a call with literal keyword arguments, else None."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            return None
        try:
            arguments[keyword.arg] = _json_value(ast.literal_eval(keyword.value))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    return node.func.id, json.dumps(arguments, ensure_ascii=False)


@ToolParserManager.register("pythonic", "llama4_pythonic")
class PythonicToolParser(IncrementalToolParser):
    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self._mode = "start"  # "start", "element" (at `_pos`), "after" (at the `,` or `]` after an element)

    def _advance(self, final: bool) -> None:
        while not (self._stopped or self._rest_is_content):
            if self._mode == "start":
                more = self._start_step(final)
            elif self._mode == "element":
                more = self._element_step(final)
            else:
                more = self._after_step()
            if not more:
                return

    def _start_step(self, final: bool) -> bool:
        text = self._text
        j = skip_whitespace(text, 0)
        if text.startswith(PYTHON_START, j):
            j = skip_whitespace(text, j + len(PYTHON_START))
        elif PYTHON_START.startswith(text[j:]) and not final:  # nothing yet, or a partial tag
            return False
        if j == len(text) and not final:
            return False
        if j == len(text) or text[j] != "[":
            self._give_up(0)
            return False
        self._pos, self._mode = j + 1, "element"
        return True

    def _element_step(self, final: bool) -> bool:
        text = self._text
        j = skip_whitespace(text, self._pos)
        if j < len(text) and text[j] == "]":  # the list ends (`[]`, or after a trailing comma)
            self._give_up(0)
            return False
        end = element_end(text, j)
        if end is None:
            if final:
                self._give_up(0)
            return False
        call = python_call(text[j:end]) if text[end] in ",]" else None  # not a `)` or `}` too many
        if call is None:
            self._give_up(0)
            return False
        self._open_call(call[0])
        self._close_call(call[1])
        self._pos, self._mode = end, "after"
        return True

    def _after_step(self) -> bool:
        if self._text[self._pos] == ",":
            self._pos, self._mode = self._pos + 1, "element"
            return True
        self._stop()  # `]`: text after the list is dropped
        return False
