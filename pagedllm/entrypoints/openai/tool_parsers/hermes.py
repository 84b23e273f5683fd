"""The Hermes tool-call format (Hermes, Qwen 2/2.5/3 families): each call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the output, content may come before the calls.

Small Qwen models (Qwen2.5-Coder-0.5B) often write a call without its tags: the whole output one JSON object, or a
list of them, `{"name": ..., "arguments": {...}}`. Such an output is taken as the calls when every name is one of
the request's tools (vLLM's parser returns it as content). Streamed, an output that opens with `{` or `[` (after
spaces) is held back until it ends, then sent as those calls, else as content: streamed and whole agree."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract import (
    ArgumentsStreamer,
    ExtractedToolCalls,
    FunctionCall,
    StreamDelta,
    StreamedToolCallDelta,
    ToolCall,
    ToolParser,
    ToolParserManager,
    new_tool_call_id,
    raw_arguments,
)
from pagedllm.text_tags import partial_tag_length

logger = logging.getLogger(__name__)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'"arguments"\s*:')


def _call_from(body: str) -> ToolCall:
    """One call from its JSON text (ValueError, KeyError or TypeError when it is not a Hermes call)."""
    obj = json.loads(body)
    name = obj["name"]
    if not isinstance(name, str):
        raise TypeError("the name is not a string")
    m = _ARGUMENTS.search(body)
    arguments = raw_arguments(body, m.end()) if m is not None and "arguments" in obj else "{}"
    return ToolCall(FunctionCall(name, arguments))


@ToolParserManager.register("hermes")
class HermesToolParser(ToolParser):
    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self._text = ""
        self._pos = 0  # text before this index has been handled
        self._in_call = False
        self._index = -1  # the current (or last) call
        self._name_sent = False
        self._args: ArgumentsStreamer | None = None

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        start = text.find(OPEN)
        if start < 0:
            bare = self._bare_calls(text)
            return ExtractedToolCalls(True, bare, None) if bare else ExtractedToolCalls(False, [], text)
        calls = []
        for body in _CALL.findall(text[start:]):
            try:
                calls.append(_call_from(body))
            except (ValueError, KeyError, TypeError):  # skipped, as the stream skips it when it closes
                logger.warning("a tool call is not valid Hermes JSON: %.200s", body)
        if not calls:
            return ExtractedToolCalls(False, [], text)
        return ExtractedToolCalls(True, calls, text[:start] or None)

    # ---- streaming ------------------------------------------------------------------------------------------

    def _bare_calls(self, text: str) -> list[ToolCall]:
        """The calls of an output that is nothing but untagged call JSON naming the request's tools; [] otherwise."""
        names = {t.get("function", {}).get("name") for t in self.tools if isinstance(t, dict)}
        body = text.strip()
        if not names or not body.startswith(("{", "[")):
            return []
        try:
            items = json.loads(body)
        except ValueError:
            return []
        items = items if isinstance(items, list) else [items]
        calls = []
        for item in items:
            if not isinstance(item, dict) or item.get("name") not in names or not set(item) <= {"name", "arguments"}:
                return []
            arguments = item.get("arguments", {})
            if not isinstance(arguments, dict):
                return []
            calls.append(ToolCall(FunctionCall(item["name"], json.dumps(arguments, ensure_ascii=False))))
        return calls

    def _holding_bare(self) -> bool:
        """Whether the stream holds its text back: nothing sent yet, no tag, and all of it so far spaces or the
        opening of untagged call JSON."""
        if self._index >= 0 or self._pos > 0 or not self.tools or OPEN in self._text:
            return False
        head = self._text.lstrip()
        return not head or head.startswith(("{", "["))

    def extract_tool_calls_streaming(self, delta_text: str) -> StreamDelta:
        self._text += delta_text
        out = StreamDelta()
        if self._holding_bare():
            return out
        while True:
            if not self._in_call:
                start = self._text.find(OPEN, self._pos)
                if start < 0:
                    end = len(self._text) - partial_tag_length(self._text[self._pos :], OPEN)
                    self._content(out, self._text[self._pos : end])
                    self._pos = end
                    return out
                self._content(out, self._text[self._pos : start])
                self._pos = start + len(OPEN)
                self._in_call, self._index, self._name_sent = True, self._index + 1, False
                self._args = ArgumentsStreamer()
                continue
            end = self._text.find(CLOSE, self._pos)
            body = self._text[self._pos : end if end >= 0 else len(self._text)]
            if end < 0:
                self._stream_open_call(out, body)
                return out
            self._close_call(out, body)
            self._pos = end + len(CLOSE)
            self._in_call = False

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        if self._holding_bare():
            calls = self._bare_calls(self._text)
            for i, call in enumerate(calls):
                out.tool_calls.append(StreamedToolCallDelta(i, new_tool_call_id(), call.function.name))
                out.tool_calls.append(StreamedToolCallDelta(i, arguments=call.function.arguments))
            if calls:
                self._index, self._pos = len(calls) - 1, len(self._text)
                return out
        if self._in_call:  # the output ended inside a call (max_tokens): close it if its JSON is complete
            self._close_call(out, self._text[self._pos :])
            self._in_call = False
        else:
            self._content(out, self._text[self._pos :])
        self._pos = len(self._text)
        return out

    def _content(self, out: StreamDelta, text: str) -> None:
        if text and self._index < 0:  # content after the calls is not content of the message (as vLLM's parser)
            out.content = (out.content or "") + text

    def _stream_open_call(self, out: StreamDelta, body: str) -> None:
        if not self._name_sent:
            m = _NAME.search(body)
            if m is None:
                return
            self._name_sent = True
            name = json.loads(f'"{m.group(1)}"')
            out.tool_calls.append(StreamedToolCallDelta(self._index, new_tool_call_id(), name))
        m = _ARGUMENTS.search(body)
        if m is not None:
            assert self._args is not None
            piece = self._args.update(body, m.end())
            if piece:
                out.tool_calls.append(StreamedToolCallDelta(self._index, arguments=piece))

    def _close_call(self, out: StreamDelta, body: str) -> None:
        try:
            call = _call_from(body)
        except (ValueError, KeyError, TypeError):
            logger.warning("streamed tool call is not valid Hermes JSON: %.200s", body)
            return
        if not self._name_sent:
            self._name_sent = True
            out.tool_calls.append(StreamedToolCallDelta(self._index, new_tool_call_id(), call.function.name))
        assert self._args is not None
        piece = self._args.finish(call.function.arguments)
        if piece:
            out.tool_calls.append(StreamedToolCallDelta(self._index, arguments=piece))
