"""Calls written as JSON objects, `{"name": ..., "parameters"|"arguments": {...}}` (llama3_json, Mistral's list
form): whether an object is a call, and streaming one. The name goes out once the object's text reads
`{"name": "...", "arguments": {` (or "parameters"), then the raw text of the arguments as it grows; an object written
in another order goes out whole once it is complete. A call's `arguments` is the raw text of that value (a JSON
object), as with Hermes."""

from __future__ import annotations

import json
import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract import IncrementalToolParser, value_end

ARGUMENT_KEYS = ("parameters", "arguments")
_COMMIT = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:parameters|arguments)"\s*:(?=\s*\{)')


def skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def object_members(text: str, start: int) -> dict[str, tuple[int, int]] | None:
    """The members of the well-formed JSON object at `text[start]`: key -> (start, end) of its raw value; None when
    the text there is not one, or repeats a key."""
    i = skip_whitespace(text, start)
    if i >= len(text) or text[i] != "{":
        return None
    members: dict[str, tuple[int, int]] = {}
    i = skip_whitespace(text, i + 1)
    if i < len(text) and text[i] == "}":
        return members
    while True:
        if i >= len(text) or text[i] != '"':
            return None
        key_end = value_end(text, i)
        if key_end is None:
            return None
        key = json.loads(text[i:key_end])
        i = skip_whitespace(text, key_end)
        if i >= len(text) or text[i] != ":":
            return None
        value_start = skip_whitespace(text, i + 1)
        end = value_end(text, value_start)
        if end is None or key in members:
            return None
        members[key] = (value_start, end)
        i = skip_whitespace(text, end)
        if i < len(text) and text[i] == ",":
            i = skip_whitespace(text, i + 1)
        elif i < len(text) and text[i] == "}":
            return members
        else:
            return None


def json_call(text: str, start: int, end: int, arguments_required: bool) -> tuple[str, str] | None:
    """(name, raw arguments) of the call written as the JSON object `text[start:end]`, or None when it is not one:
    a non-empty string "name" and one object "parameters" or "arguments" (absent: "{}" unless required)."""
    try:
        json.loads(text[start:end])
        members = object_members(text[:end], start)
    except ValueError:
        return None
    if members is None or "name" not in members:
        return None
    name = json.loads(text[slice(*members["name"])])
    keys = [k for k in ARGUMENT_KEYS if k in members]
    if not isinstance(name, str) or not name or len(keys) > 1 or (arguments_required and not keys):
        return None
    if not keys:
        return name, "{}"
    arguments = text[slice(*members[keys[0]])]
    if not arguments.startswith("{"):
        return None
    return name, arguments


def _commit(text: str, start: int) -> tuple[str, int] | None:
    """(name, where the arguments value starts) when the object at `start` begins as a call, else None."""
    m = _COMMIT.match(text, start)
    if m is None:
        return None
    try:
        name = json.loads(f'"{m.group(1)}"')
    except ValueError:
        return None
    return (name, m.end()) if name else None


class JsonObjectCalls(IncrementalToolParser):
    """An IncrementalToolParser whose calls are JSON objects (see the module docstring)."""

    arguments_required = True

    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self._arguments_start = 0

    def is_call(self, start: int, final: bool) -> bool | None:
        """Whether the object at `text[start]` is a call: None while the text does not tell yet."""
        if _commit(self._text, start) is not None:
            return True
        end = value_end(self._text, start)
        if end is None:
            return False if final else None
        return json_call(self._text, start, end, self.arguments_required) is not None

    def object_call(self, start: int, final: bool) -> int | None:
        """Advance the call written as the object at `text[start]`: its end once it is whole (the call is then
        closed, or dropped when the object is not a call; at the end of the output an unfinished one is dropped),
        None while it is not."""
        text = self._text
        if self._call is None:
            committed = _commit(text, start)
            if committed is not None:
                self._open_call(committed[0])
                self._arguments_start = committed[1]
        end = value_end(text, start)
        if end is None:
            if not final:
                if self._call is not None:
                    self._stream_arguments(text, self._arguments_start)
                return None
            if self._call is not None:
                self._close_call(None)
            return len(text)
        call = json_call(text, start, end, self.arguments_required)
        if call is None:
            if self._call is not None:
                self._close_call(None)
            return end
        if self._call is None:
            self._open_call(call[0])
        self._close_call(call[1])
        return end
