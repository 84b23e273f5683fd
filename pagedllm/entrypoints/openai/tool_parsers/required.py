"""The output of `tool_choice: "required"`: a JSON list of calls, `[{"name": ..., "parameters": {...}}, ...]`, which
the server's JSON-schema constraint makes the model write; parsed whole or streamed like any tool parser (each
call's `arguments` is the raw text of its "parameters" value)."""

from __future__ import annotations

import json
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
    new_tool_call_id,
    raw_arguments,
    value_end,
)

_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_PARAMETERS = re.compile(r'"parameters"\s*:')


def required_calls_schema(tools: list[dict[str, Any]], max_calls: int | None = None) -> dict[str, Any]:
    """The JSON schema of a non-empty list of calls to these tools, with each tool's own parameters (at most
    `max_calls` of them: 1 for `parallel_tool_calls: false`, so that generation stops after one). A tool's `$defs`
    (and `definitions`) move to the root, where its `#/$defs/...` references point once its parameters sit inside
    this schema; two tools defining one name differently are a ValueError naming both."""
    variants = []
    hoisted: dict[str, dict[str, Any]] = {}
    owners: dict[tuple[str, str], str] = {}
    for tool in tools:
        fn = tool["function"]
        params = dict(fn.get("parameters") or {"type": "object"})
        for key in ("$defs", "definitions"):
            defs = params.pop(key, None)
            if not isinstance(defs, dict):
                continue
            for name, definition in defs.items():
                known = hoisted.setdefault(key, {})
                if name in known and known[name] != definition:
                    raise ValueError(
                        f"tools {owners[(key, name)]!r} and {fn['name']!r} define {key}/{name} differently; "
                        "give the definitions distinct names"
                    )
                known[name] = definition
                owners[(key, name)] = fn["name"]
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [fn["name"]]}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}, **hoisted}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return schema


def _elements(text: str) -> list[tuple[int, int | None]]:
    """(start, end) of each element of the JSON list in `text` (end None for an element not complete yet)."""
    out: list[tuple[int, int | None]] = []
    pos = text.find("[")
    if pos < 0:
        return out
    pos += 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return out
        end = value_end(text, pos)
        out.append((pos, end))
        if end is None:
            return out
        pos = end


class RequiredToolCallsParser(ToolParser):
    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self._text = ""
        self._names_sent: dict[int, bool] = {}
        self._streamers: dict[int, ArgumentsStreamer] = {}
        self._finished: set[int] = set()

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        calls = []
        for start, end in _elements(text):
            if end is None:
                break
            element = text[start:end]
            obj = json.loads(element)
            m = _PARAMETERS.search(element)
            arguments = raw_arguments(element, m.end()) if m is not None else "{}"
            calls.append(ToolCall(FunctionCall(str(obj["name"]), arguments)))
        return ExtractedToolCalls(bool(calls), calls, None)

    def extract_tool_calls_streaming(self, delta_text: str) -> StreamDelta:
        self._text += delta_text
        out = StreamDelta()
        for index, (start, end) in enumerate(_elements(self._text)):
            if index in self._finished:
                continue
            element = self._text[start : end if end is not None else len(self._text)]
            if not self._names_sent.get(index):
                m = _NAME.search(element)
                if m is None:
                    continue
                self._names_sent[index] = True
                out.tool_calls.append(StreamedToolCallDelta(index, new_tool_call_id(), json.loads(f'"{m.group(1)}"')))
            streamer = self._streamers.setdefault(index, ArgumentsStreamer())
            p = _PARAMETERS.search(element)
            if p is None:
                continue
            if end is None:
                piece = streamer.update(element, p.end())
            else:
                piece = streamer.finish(raw_arguments(element, p.end()))
                self._finished.add(index)
            if piece:
                out.tool_calls.append(StreamedToolCallDelta(index, arguments=piece))
        return out
