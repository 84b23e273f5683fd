"""The tool-parser interface, its registry, the streaming of arguments from partial JSON, the base of parsers written
once as a stream (`IncrementalToolParser`) and the `parallel_tool_calls: false` limit (`FirstCallOnly`); see
__init__.py."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.text_tags import partial_tag_length


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

    def advance_to(self, text: str) -> str:
        """The piece that takes what was sent to `text` (the arguments so far, or whole: see `finish`)."""
        if not text.startswith(self.sent):  # the model's text only grows: this would be a bug here
            raise ValueError(f"streamed tool arguments {self.sent!r} are not a prefix of {text!r}")
        piece, self.sent = text[len(self.sent) :], text
        return piece

    def finish(self, final: str) -> str:
        return self.advance_to(final)


def raw_arguments(text: str, value_start: int) -> str:
    """The raw JSON text of the arguments value starting at `value_start` (the whole rest when it does not end)."""
    end = value_end(text, value_start)
    return text[value_start:end].strip() if end is not None else text[value_start:].strip()


class ToolParser:
    """Base of the parsers: one per request (it keeps the state of a stream). `tools` are the request's tools
    (OpenAI's `[{"type": "function", "function": {"name", "parameters"}}]`), for formats whose values are typed by
    the tools' schemas; `needs_special_tokens` says the format's markers are special tokens, which the server then
    keeps in the text it parses (skip_special_tokens false unless the request sets it)."""

    needs_special_tokens: bool = False

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools or [])

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


class IncrementalToolParser(ToolParser):
    """A parser written once, as a stream: `_advance(final)` reads `self._text` on from `self._pos` and calls
    `_emit_content`, `_open_call`, `_stream_arguments` / `_send_arguments`, `_close_call`; `final` is true when no
    more text will come. The whole-text parse is the same machine fed the whole text at once, so streamed and
    whole agree whenever the machine does not depend on where the deltas split (which the tests check with
    random splits). A call's id and name come in its first piece; a call closed with arguments None (broken) is
    left out of the whole parse (streamed, its first pieces are already out, as with Hermes). With no call at all
    the whole text is the content."""

    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self._text = ""
        self._pos = 0  # text before this index has been handled
        self._out = StreamDelta()
        self._index = -1  # the current (or last) call
        self._call: ToolCall | None = None  # the open call
        self._args = ArgumentsStreamer()
        self._calls: list[ToolCall] = []  # the calls closed with valid arguments
        self._content: list[str] = []
        self._rest_is_content = False  # set by `_give_up`: all text from `_pos` on is content
        self._stopped = False  # set by `_stop`: the calls are over, the rest of the text is dropped

    def new_id(self) -> str:
        return new_tool_call_id()

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        parser = type(self)(self.tokenizer, tools=self.tools)
        parser.extract_tool_calls_streaming(text)
        parser.finish()
        if not parser._calls:
            return ExtractedToolCalls(False, [], text)
        return ExtractedToolCalls(True, parser._calls, "".join(parser._content) or None)

    def extract_tool_calls_streaming(self, delta_text: str) -> StreamDelta:
        self._text += delta_text
        return self._run(final=False)

    def finish(self) -> StreamDelta:
        return self._run(final=True)

    def _run(self, final: bool) -> StreamDelta:
        self._out = StreamDelta()
        if not (self._rest_is_content or self._stopped):
            self._advance(final)
        if self._rest_is_content:
            self._emit_content(self._text[self._pos :])
            self._pos = len(self._text)
        out, self._out = self._out, StreamDelta()
        return out

    def _advance(self, final: bool) -> None:
        """Handle what can be handled of the text from `_pos` on, and return (also after `_give_up`/`_stop`)."""
        raise NotImplementedError

    def _run_steps(self, steps: dict[str, Callable[[bool], bool]], final: bool) -> None:
        """A state machine's `_advance`: run the step of the current `self._mode` while it makes progress (a step
        returns False to wait for more text) and the calls go on."""
        while not (self._stopped or self._rest_is_content) and steps[self._mode](final):
            pass

    def _give_up(self, start: int) -> None:
        """The text from `start` on (held back so far) is not a call after all: with no call before it, it and all
        that follows are content; after calls, the calls are over."""
        if self._index < 0:
            self._pos, self._rest_is_content = start, True
        else:
            self._stopped = True

    def _stop(self) -> None:
        """The calls are over: the rest of the text is dropped (as with Hermes, text after the calls is no content)."""
        self._stopped = True

    def _content_until(self, marker: str, final: bool) -> int | None:
        """Send the text from `_pos` up to the next `marker` as content and return the marker's index; while no
        marker has come, send what cannot be its start (all of it when `final`) and return None."""
        text, pos = self._text, self._pos
        i = text.find(marker, pos)
        end = i if i >= 0 else len(text) if final else len(text) - partial_tag_length(text[pos:], marker)
        self._emit_content(text[pos:end])
        self._pos = end
        return i if i >= 0 else None

    def _emit_content(self, text: str) -> None:
        if text:
            self._out.content = (self._out.content or "") + text
            self._content.append(text)

    def _open_call(self, name: str) -> None:
        self._index += 1
        self._call = ToolCall(FunctionCall(name, ""), id=self.new_id())
        self._args = ArgumentsStreamer()
        self._out.tool_calls.append(StreamedToolCallDelta(self._index, self._call.id, name))

    def _piece(self, piece: str) -> None:
        if piece:
            self._out.tool_calls.append(StreamedToolCallDelta(self._index, arguments=piece))

    def _stream_arguments(self, text: str, value_start: int) -> None:
        """Send what is new of the raw JSON value starting at `text[value_start]` (see ArgumentsStreamer)."""
        self._piece(self._args.update(text, value_start))

    def _send_arguments(self, so_far: str) -> None:
        """Send what is new of the open call's arguments, `so_far` being them up to now (a prefix of the whole)."""
        self._piece(self._args.advance_to(so_far))

    def _close_call(self, arguments: str | None) -> None:
        """Close the open call with its whole `arguments`, or None when it turned out broken (then dropped)."""
        assert self._call is not None
        if arguments is not None:
            self._piece(self._args.finish(arguments))
            self._call.function.arguments = arguments
            self._calls.append(self._call)
        self._call = None


class FirstCallOnly(ToolParser):
    """`parallel_tool_calls: false`: the wrapped parser's output with its first call only (later calls are dropped,
    whole and streamed)."""

    def __init__(self, parser: ToolParser) -> None:
        super().__init__(parser.tokenizer, parser.tools)
        self.parser = parser

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        out = self.parser.extract_tool_calls(text)
        return ExtractedToolCalls(out.tools_called, out.tool_calls[:1], out.content)

    def extract_tool_calls_streaming(self, delta_text: str) -> StreamDelta:
        return self._first(self.parser.extract_tool_calls_streaming(delta_text))

    def finish(self) -> StreamDelta:
        return self._first(self.parser.finish())

    @staticmethod
    def _first(delta: StreamDelta) -> StreamDelta:
        delta.tool_calls = [piece for piece in delta.tool_calls if piece.index == 0]
        return delta
