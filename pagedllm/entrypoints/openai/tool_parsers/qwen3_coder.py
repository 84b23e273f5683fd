"""The Qwen3-Coder XML tool-call format, vLLM's `qwen3_coder`:

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

The content is the text before the first `<tool_call>` (or a bare `<function=`); text between and after the calls is
dropped. A value loses one leading and one trailing newline and ends at `</parameter>` (or, as in vLLM, at the next
`<parameter=`, `</function>` or `</tool_call>`; a function ends at `</function>`, `</tool_call>` or the next
`<function=`, and at the end of the output whatever is open ends there). Values are typed by the request's tools (the
parameter's schema "type", as vLLM's parser): "null" (any case) is null; string types and parameters the tool does
not declare stay strings; integer and number types are parsed (a whole number is an integer); booleans are
"true" (any case); other types (object, array, ...) are parsed as JSON, else as a Python literal; a value that does
not parse stays a string.

`arguments` is `{"P": value, ...}` with `json.dumps` of each key and value (not ASCII-escaped), `", "` and `": "`,
the order of the output; a parameter written twice keeps its first value. Streamed: `{` when the function opens,
each parameter when its value ends, except string values, which go out as they are written (held back only while
they may still be "null", a closing tag, or the last newline), then `}`: joined, the same string."""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract import IncrementalToolParser, ToolParserManager
from pagedllm.text_tags import partial_tag_length

TOOL_CALL, FUNCTION, PARAMETER = "<tool_call>", "<function=", "<parameter="
_CALL_START = re.compile(r"<tool_call>|<function=")
_BODY = re.compile(r"<parameter=|</function>|</tool_call>|<function=")
_VALUE_ENDS = ("</parameter>", "<parameter=", "</function>", "</tool_call>")
_VALUE_END = re.compile("|".join(re.escape(t) for t in _VALUE_ENDS))

_STRING_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})


def _finite(value: Any) -> bool:
    """Whether `value` is JSON data json.dumps writes as valid JSON (no nan or infinity, string keys)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _finite(v) for k, v in value.items())
    return value is None or isinstance(value, (bool, int, str))


def value_kind(schema: Any) -> str:
    """How a parameter with this schema is typed: "string", "integer", "number", "boolean" or "other"."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):  # ["integer", "null"]
        kind = next((k for k in kind if k != "null"), None)
    if kind is None:
        return "string"
    kind = str(kind).strip().lower()
    if kind in _STRING_TYPES:
        return "string"
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        return "integer"
    if kind.startswith(("num", "float")):
        return "number"
    if kind in ("boolean", "bool", "binary"):
        return "boolean"
    return "other"


def convert_value(value: str, kind: str) -> Any:
    """The value of a parameter's text, by its kind (see the module docstring)."""
    if value.lower() == "null":
        return None
    if kind == "integer":
        try:
            return int(value)
        except ValueError:
            return value
    if kind == "number":
        try:
            number = float(value)
        except ValueError:
            return value
        if not math.isfinite(number):
            return value
        return int(number) if number.is_integer() else number
    if kind == "boolean":
        return value.strip().lower() == "true"
    if kind == "other":
        try:
            parsed = json.loads(value)
        except ValueError:
            try:
                parsed = ast.literal_eval(value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return value
        if isinstance(parsed, tuple):
            parsed = list(parsed)
        return parsed if _finite(parsed) else value
    return value


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


@ToolParserManager.register("qwen3_coder")
class Qwen3CoderToolParser(IncrementalToolParser):
    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        # "content", "seek" (a function), "header" (its name), "body" (its parameters), "parameter" (a name),
        # "value" (from `_value_start`)
        self._mode = "content"
        self._region = 0  # where the calls start
        self._arguments = ""  # the open call's arguments, up to its last whole parameter
        self._seen: set[str] = set()
        self._parameter: str | None = None  # the parameter being read (None: a repeated one, skipped)
        self._value_start = 0

    def _properties(self, function: str) -> dict[str, Any] | None:
        for tool in self.tools:
            fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
            if fn.get("name") == function:
                params = fn.get("parameters")
                props = params.get("properties") if isinstance(params, dict) else None
                return props if isinstance(props, dict) else None
        return None

    def _kind(self, parameter: str) -> str:
        assert self._call is not None
        props = self._properties(self._call.function.name)
        if props is None or parameter not in props:
            return "string"
        return value_kind(props[parameter])

    def _advance(self, final: bool) -> None:
        steps = {
            "content": self._content_step,
            "seek": self._seek_step,
            "header": self._header_step,
            "body": self._body_step,
            "parameter": self._parameter_step,
            "value": self._value_step,
        }
        self._run_steps(steps, final)

    def _end(self) -> None:
        self._give_up(self._region)

    def _content_step(self, final: bool) -> bool:
        text, pos = self._text, self._pos
        m = _CALL_START.search(text, pos)
        if m is None:
            end = len(text)
            if not final:
                end -= max(partial_tag_length(text[pos:], TOOL_CALL), partial_tag_length(text[pos:], FUNCTION))
            self._emit_content(text[pos:end])
            self._pos = end
            return False
        self._emit_content(text[pos : m.start()])
        self._region = self._pos = m.start()
        self._mode = "seek"
        return True

    def _seek_step(self, final: bool) -> bool:
        i = self._text.find(FUNCTION, self._pos)
        if i < 0:
            if final:
                self._end()
            return False
        self._pos, self._mode = i + len(FUNCTION), "header"
        return True

    def _header_step(self, final: bool) -> bool:
        text = self._text
        gt = text.find(">", self._pos)
        if gt < 0:
            if final:
                self._end()
            return False
        name = text[self._pos : gt].strip()
        if not name or any(c in name for c in "<\n"):  # not a function tag after all
            self._mode = "seek"
            return True
        self._open_call(name)
        self._arguments, self._seen = "{", set()
        self._send_arguments("{")
        self._pos, self._mode = gt + 1, "body"
        return True

    def _body_step(self, final: bool) -> bool:
        m = _BODY.search(self._text, self._pos)
        if m is None:
            if final:
                self._close_function()
            return False
        if m.group() == PARAMETER:
            self._pos, self._mode = m.end(), "parameter"
            return True
        self._close_function()
        self._pos = m.start() if m.group() == FUNCTION else m.end()
        return True

    def _close_function(self) -> None:
        self._close_call(self._arguments + "}")
        self._mode = "seek"

    def _parameter_step(self, final: bool) -> bool:
        text = self._text
        gt = text.find(">", self._pos)
        if gt < 0:
            if final:
                self._close_function()
            return False
        name = text[self._pos : gt].strip()
        self._parameter = None if name in self._seen else name
        self._seen.add(name)
        self._value_start = gt + 1
        self._mode = "value"
        return True

    def _key(self, name: str) -> str:
        return ("{" if self._arguments == "{" else self._arguments + ", ") + _dumps(name) + ": "

    def _value_step(self, final: bool) -> bool:
        text = self._text
        m = _VALUE_END.search(text, self._value_start)
        if m is None and not final:
            self._stream_value(text[self._value_start :])
            return False
        end = m.start() if m is not None else len(text)
        value = text[self._value_start : end]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        if self._parameter is not None:
            converted = convert_value(value, self._kind(self._parameter))
            self._arguments = self._key(self._parameter) + _dumps(converted)
            self._send_arguments(self._arguments)
        self._pos = m.end() if m is not None and m.group() == "</parameter>" else end
        self._mode = "body"
        return True

    def _stream_value(self, raw: str) -> None:
        """Send what is safe of a string value still being written."""
        if self._parameter is None or self._kind(self._parameter) != "string":
            return
        raw = raw[: len(raw) - max(partial_tag_length(raw, tag) for tag in _VALUE_ENDS)]
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        if "null".startswith(raw.lower()):  # "", "n", ..., "null": it may still be null
            return
        self._send_arguments(self._key(self._parameter) + _dumps(raw)[:-1])
