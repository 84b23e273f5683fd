"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the chat handler.

Contract:
* A Messages request becomes a chat request (`to_chat_request`) and runs as one: the same template, sampling,
  context rule, tool handling and checks, so everything that rejects a chat completion rejects it too, before
  anything is sent. The mapping:
  - `system` (a string or text blocks) is the system message; a user message's `tool_result` blocks become tool
    messages (in order, with the `tool_use_id`), its text blocks its content; an assistant message's `tool_use`
    blocks become its tool calls (input as JSON), `thinking` blocks are dropped; a last assistant message is
    continued (Anthropic's prefill). Image, document and other blocks are a 400 naming the block.
  - consecutive user (or assistant) messages are one turn, as Anthropic combines them.
  - `tools` ({name, description, input_schema}) are function tools; `tool_choice` auto (the default with tools),
    any (at least one call), tool (that one), none; `disable_parallel_tool_use` allows one call. Server tools
    (a `type` other than custom) are a 400.
  - max_tokens, stop_sequences, temperature, top_p and top_k as their chat counterparts (Anthropic's SDK 2.x
    sends the last three only in `extra_body`); `output_config.format` ({"type": "json_schema", "schema"})
    constrains the text to the schema, as a chat `response_format`.
* The answer is a `message`: thinking (with --reasoning-parser), text and tool_use blocks, `stop_reason`
  end_turn, max_tokens, stop_sequence (with the `stop_sequence` that matched) or tool_use, and usage.
* Streamed: Anthropic's events `message_start`, then per block `content_block_start`, `content_block_delta`
  (text_delta, thinking_delta, input_json_delta whose pieces join into the block's input JSON) and
  `content_block_stop`, then `message_delta` (stop reason, output tokens) and `message_stop`; a failure after the
  stream began is an `error` event.
* Errors are Anthropic's shape (`protocol.anthropic_error_body`), with the chat handler's statuses and messages.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.anthropic.protocol import (
    AnthropicUsage,
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
    MessagesRequestBase,
    MessagesResponse,
    anthropic_error_body,
)
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, random_uuid
from pagedllm.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from pagedllm.entrypoints.openai.serving_engine import SSEResponse, merge_async_iterators, raise_if_failed, sse_event
from pagedllm.outputs import CompletionOutput

logger = logging.getLogger(__name__)


def _invalid(message: str, field: str) -> OpenAIError:
    return OpenAIError(message, 400, field)


def _text_of(content: Any, where: str) -> str:
    """The text of a string or of a list of text blocks (a tool result's content, the system prompt)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(f"{where}: expected a string or a list of text blocks", where)
    parts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise _invalid(f"{where}.{j}: only text blocks are supported here, got {kind!r}", f"{where}.{j}")
        parts.append(block["text"])
    return "\n".join(parts)


def _user_messages(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict[str, Any]] = []
    text: list[str] = []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_result" and isinstance(block.get("tool_use_id"), str):
            if text:
                out.append({"role": "user", "content": "\n".join(text)})
                text = []
            result = _text_of(block.get("content", ""), f"{at}.content")
            if block.get("is_error"):
                result = f"Error: {result}"
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
        else:
            raise _invalid(_block_error(block, at, "text or tool_result (with tool_use_id)"), at)
    if text or not out:
        out.append({"role": "user", "content": "\n".join(text)})
    return out


def _assistant_message(content: Any, where: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use" and isinstance(block.get("name"), str) and isinstance(block.get("input"), dict):
            call_id = block.get("id") if isinstance(block.get("id"), str) else f"toolu_{random_uuid()[:24]}"
            arguments = json.dumps(block["input"], ensure_ascii=False)
            function = {"name": block["name"], "arguments": arguments}
            calls.append({"id": call_id, "type": "function", "function": function})
        elif kind not in ("thinking", "redacted_thinking"):  # earlier turns' thinking is not shown to the model again
            raise _invalid(_block_error(block, at, "text, tool_use (with name and input) or thinking"), at)
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(text)}
    if calls:
        message["tool_calls"] = calls
    return message


def _block_error(block: dict[str, Any], at: str, expected: str) -> str:
    kind = block.get("type")
    if kind in ("image", "document", "search_result", "container_upload"):
        return f"{at}: {kind} blocks are not supported: this server runs text-only models"
    return f"{at}: expected a {expected} block, got {json.dumps(block)[:120]}"


def _tools(request: MessagesRequestBase) -> list[dict[str, Any]] | None:
    if request.tools is None:
        return None
    out = []
    for i, tool in enumerate(request.tools):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise _invalid(
                f"tools.{i}: server tools ({kind!r}) are not available here; give custom tools "
                "({name, description, input_schema})",
                f"tools.{i}.type",
            )
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name or not isinstance(schema, dict):
            raise _invalid(f"tools.{i}: a tool needs a `name` and an `input_schema` object", f"tools.{i}")
        function = {"name": name, "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(request: MessagesRequestBase) -> tuple[Any, bool]:
    """The chat tool_choice and whether several calls are allowed."""
    choice = request.tool_choice
    if choice is None or (choice.get("type") == "auto" and not request.tools):
        return None, True  # auto without tools: plain text
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise _invalid(
        'tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": ...} or {"type": "none"}, '
        f"got {json.dumps(choice)[:120]}",
        "tool_choice",
    )


def _merge_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive user (or assistant) messages as one turn, as Anthropic combines them: chat templates that want
    the roles to alternate would refuse them apart. Tool messages stay where they are."""
    out: list[dict[str, Any]] = []
    for m in messages:
        last = out[-1] if out else None
        if last is None or m["role"] != last["role"] or m["role"] not in ("user", "assistant"):
            out.append(dict(m))
            continue
        last["content"] = "\n".join(c for c in (last["content"], m["content"]) if c)
        if m.get("tool_calls"):
            last["tool_calls"] = [*last.get("tool_calls", []), *m["tool_calls"]]
    return out


def to_chat_request(request: MessagesRequestBase) -> ChatCompletionRequest:
    """The chat request a Messages (or count_tokens) request stands for; a 400 naming the field if it is not one."""
    messages: list[dict[str, Any]] = []
    if request.system is not None:
        messages.append({"role": "system", "content": _text_of(request.system, "system")})
    for i, m in enumerate(request.messages):
        where = f"messages.{i}"
        if m.role == "user":
            messages += _user_messages(m.content, where)
        else:
            messages.append(_assistant_message(m.content, where))
    messages = _merge_turns(messages)
    prefill = request.messages[-1].role == "assistant"
    choice, parallel = _tool_choice(request)
    fields: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "tools": _tools(request),
        "tool_choice": choice,
        "add_generation_prompt": not prefill,
        "continue_final_message": prefill,
        "chat_template_kwargs": _thinking_kwargs(request.thinking),
    }
    if not parallel:
        fields["parallel_tool_calls"] = False
    if isinstance(request, MessagesRequest):
        fields |= {
            "max_tokens": request.max_tokens,
            "stop": request.stop_sequences,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": request.top_k,
            "stream": request.stream,
            "response_format": _response_format(request.output_config),
        }
    return ChatCompletionRequest(**fields)


def _thinking_kwargs(thinking: dict[str, Any] | None) -> dict[str, Any] | None:
    """Anthropic's `thinking` as the chat template's `enable_thinking` (what Qwen3-style templates read to open or
    skip the model's thinking); `budget_tokens` is not enforced."""
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise _invalid(f"thinking.type must be enabled, adaptive or disabled, got {kind!r}", "thinking")
    return {"enable_thinking": kind != "disabled"}


def _response_format(output_config: dict[str, Any] | None) -> dict[str, Any] | None:
    """The chat response_format of `output_config.format` (Anthropic's structured outputs)."""
    fmt = (output_config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _invalid(
            f'output_config.format must be {{"type": "json_schema", "schema": {{...}}}}, got {json.dumps(fmt)[:120]}',
            "output_config.format",
        )
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def stop_reason(finish_reason: str | None, matched: int | str | None) -> tuple[str, str | None]:
    """Anthropic's stop_reason (and stop_sequence) for a chat finish reason."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def _event(kind: str, data: dict[str, Any]) -> str:
    return sse_event(kind, {"type": kind, **data})


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    def _chat_request(self, request: MessagesRequestBase) -> ChatCompletionRequest:
        self.chat.warn_ignored_fields(request)
        try:
            return to_chat_request(request)
        except ValueError as e:  # pydantic: a message the chat model refuses
            raise _invalid(str(e), "messages") from None

    async def count_tokens(self, request: CountTokensRequest) -> Response:
        chat_request = self._chat_request(request)
        self.chat.check_model(chat_request.model)
        try:
            _, ids = await self.chat.off_loop(self.chat.render, chat_request)
        except OpenAIError:
            raise
        except Exception as e:
            raise self.chat.error_for(e, chat_request) from e
        return Response(CountTokensResponse(input_tokens=len(ids)).model_dump_json(), media_type="application/json")

    async def create_message(self, request: MessagesRequest, raw_request: Request) -> Response:
        chat_request = self._chat_request(request)
        run = await self.chat.start(chat_request, f"msg_{random_uuid()}")
        model = self.chat.response_model(request.model)
        if request.stream:
            return SSEResponse(self._stream(run, model, chat_request))
        final = await self.chat.collect(run, chat_request, raw_request)
        output = final.outputs[0]
        return Response(self._message(run, model, output).model_dump_json(), media_type="application/json")

    def _message(self, run: ChatRun, model: str, output: CompletionOutput) -> MessagesResponse:
        message, finish_reason = self.chat.message(run.plan, output.text, output.finish_reason)
        content: list[dict[str, Any]] = []
        if message.reasoning_content:
            content.append({"type": "thinking", "thinking": message.reasoning_content, "signature": ""})
        if message.content:
            content.append({"type": "text", "text": message.content})
        for call in message.tool_calls or []:
            fn = call["function"]
            try:
                arguments = json.loads(fn["arguments"] or "{}")
            except json.JSONDecodeError:  # cut short by max_tokens: the text as it is
                content.append({"type": "text", "text": fn["arguments"]})
                continue
            if not isinstance(arguments, dict):
                arguments = {"value": arguments}
            content.append({"type": "tool_use", "id": call["id"], "name": fn["name"], "input": arguments})
        reason, sequence = stop_reason(finish_reason, output.stop_reason)
        return MessagesResponse(
            id=run.request_id,
            content=content,
            model=model,
            stop_reason=reason,  # type: ignore[arg-type]
            stop_sequence=sequence,
            usage=AnthropicUsage(input_tokens=run.prompt_tokens, output_tokens=len(output.token_ids)),
        )

    async def _stream(self, run: ChatRun, model: str, request: ChatCompletionRequest) -> AsyncGenerator[str, None]:
        blocks = _BlockStream()
        output_tokens = 0
        usage = AnthropicUsage(input_tokens=run.prompt_tokens, output_tokens=0)
        start = MessagesResponse(id=run.request_id, content=[], model=model, usage=usage)
        merged = merge_async_iterators(run.gen)
        try:
            yield _event("message_start", {"message": start.model_dump(mode="json")})
            choice = self.chat.choice_stream(run.plan)
            try:
                async for _, out in merged:
                    raise_if_failed(out)
                    c = out.outputs[0]
                    output_tokens += len(c.token_ids)
                    reasoning, content, tool_calls, finish_reason = choice.step(c.text, c.finish_reason)
                    for event in blocks.step(reasoning, content, tool_calls):
                        yield event
                    if finish_reason is not None:
                        for event in blocks.close():
                            yield event
                        reason, sequence = stop_reason(finish_reason, c.stop_reason)
                        delta = {"stop_reason": reason, "stop_sequence": sequence}
                        yield _event("message_delta", {"delta": delta, "usage": {"output_tokens": output_tokens}})
                        yield _event("message_stop", {})
            except Exception as e:
                err = self.chat.error_for(e, request)
                yield sse_event("error", anthropic_error_body(err.message, err.status))
        finally:
            await merged.aclose()


class _BlockStream:
    """Turns a choice's reasoning, text and tool-call pieces into Anthropic's content-block events."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None  # the open block's type
        self.call_index: int | None = None  # the open tool_use block's call (OpenAI's index)

    def _open(self, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index += 1
        self.kind = block["type"]
        return events + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind, self.call_index = None, None
        return [_event("content_block_stop", {"index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def step(self, reasoning: str | None, content: str | None, tool_calls: list[dict[str, Any]] | None) -> list[str]:
        events: list[str] = []
        if reasoning:
            if self.kind != "thinking":
                events += self._open({"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        if content:
            if self.kind != "text":
                events += self._open({"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": content}))
        for piece in tool_calls or []:
            fn = piece.get("function", {})
            if piece.get("id") is not None:
                events += self._open({"type": "tool_use", "id": piece["id"], "name": fn.get("name"), "input": {}})
                self.call_index = piece["index"]
            if fn.get("arguments") and self.call_index == piece["index"]:
                events.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return events


__all__ = ["AnthropicServingMessages", "to_chat_request"]
