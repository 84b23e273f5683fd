"""The tool-parser interface, its registry, and the streaming of arguments from partial JSON (see __init__.py)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class FunctionCall:
    name: str
    arguments: str  # JSON text


@dataclass
class ToolCall:
    function: FunctionCall
    id: str = field(default_factory=lambda: new_tool_call_id())
    type: str = "function"


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


@dataclass
class StreamedToolCallDelta:
    """A piece of tool call `index`: its id, type and name come once, in its first piece."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass
class StreamDelta:
    content: str | None = None
    tool_calls: list[StreamedToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content) or bool(self.tool_calls)


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


_SCALAR = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|true|false|null")


def value_end(text: str, start: int) -> int | None:
    """The end (exclusive) of the JSON value that starts at `text[start]` (after whitespace), or None while the
    text does not hold all of it yet. A scanner of brackets and strings: what it measures is the model's own text,
    never a re-serialisation of it."""
    i, n = start, len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    if i >= n:
        return None
    if text[i] in '{["':
        depth, in_string, escaped = 0, False, False
        for j in range(i, n):
            ch = text[j]
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
                    if depth == 0:
                        return j + 1  # a string value
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
        return None
    m = _SCALAR.match(text, i)
    if m is None or m.end() == n:  # a number may still grow; the next character tells
        return None
    return m.end()


class ArgumentsStreamer:
    """Streams one call's arguments as the model writes them: the raw JSON text of the arguments value (from
    `value_start` in the call's text), sent as it grows; objects and arrays piece by piece, a scalar once it is
    complete. Joined, the pieces are `raw_arguments(text, value_start)` of the whole call: the same string the
    non-streamed response gives."""

    def __init__(self) -> None:
        self.sent = ""

    def update(self, text: str, value_start: int) -> str:
        stripped = text[value_start:].lstrip()
        end = value_end(text, value_start)
        if end is not None:
            current = text[value_start:end].strip()
        elif stripped[:1] in ("{", "["):
            current = stripped
        else:
            current = ""
        if not current.startswith(self.sent) or len(current) <= len(self.sent):
            return ""
        piece, self.sent = current[len(self.sent) :], current
        return piece

    def finish(self, final: str) -> str:
        if not final.startswith(self.sent):  # the model's text only grows: this would be a bug here
            raise ValueError(f"streamed tool arguments {self.sent!r} are not a prefix of the final {final!r}")
        piece, self.sent = final[len(self.sent) :], final
        return piece


def raw_arguments(text: str, value_start: int) -> str:
    """The raw JSON text of the arguments value starting at `value_start` (the whole rest when it does not end)."""
    end = value_end(text, value_start)
    return text[value_start:end].strip() if end is not None else text[value_start:].strip()


class ToolParser:
    """Base of the parsers: one per request (it keeps the state of a stream)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def extract_tool_calls_streaming(self, delta_text: str) -> StreamDelta:
        raise NotImplementedError

    def finish(self) -> StreamDelta:
        return StreamDelta()


class ToolParserManager:
    parsers: dict[str, type[ToolParser]] = {}

    @classmethod
    def register(cls, *names: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
        def wrap(parser: type[ToolParser]) -> type[ToolParser]:
            for name in names:
                cls.parsers[name] = parser
            return parser

        return wrap

    @classmethod
    def get(cls, name: str) -> type[ToolParser]:
        if name not in cls.parsers:
            raise ValueError(f"tool_call_parser must be one of {', '.join(sorted(cls.parsers))}, got {name!r}")
        return cls.parsers[name]
