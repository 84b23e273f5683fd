"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API on the chat handler.

Contract:
* A Responses request becomes a chat request (`to_chat_request`) and runs as one (template, sampling, context rule,
  tools, structured output, every check before anything is sent). The mapping:
  - `instructions` is the system message (not carried over from a previous response, as OpenAI does); `input` is a
    string (one user message) or items: messages (roles user, system, developer, assistant; content a string or
    input_text/output_text parts), `function_call` items (the assistant's calls) and `function_call_output`
    items (tool messages); reasoning items are dropped; images, files and other items are a 400 naming the item.
  - `previous_response_id` puts that response's conversation (its input and output, without its instructions)
    before `input`; an id that is unknown, expired or was not stored (`store: false`) is a 400 naming it.
  - function `tools` ({type: function, name, description, parameters}) and `tool_choice` (auto, none, required,
    {type: function, name}) as chat's; built-in tools (web search, file search, ...) are a 400;
    `parallel_tool_calls: false` allows one call.
  - `text.format` json_schema / json_object is chat's response_format; max_output_tokens, temperature, top_p (and
    vLLM's top_k) as their chat counterparts.
* The answer is a `response`: output items (reasoning with --reasoning-parser, one assistant message of
  output_text, function_call items with `call_id`), status completed, or incomplete with reason
  max_output_tokens, and usage (input tokens with cached_tokens from the prefix cache, output tokens).
* Streamed: response.created, response.in_progress, then per item output_item.added, its content events
  (content_part.added, output_text.delta ..., output_text.done, content_part.done; reasoning_text.delta/done;
  function_call_arguments.delta ... / done, whose pieces join into the call's arguments), output_item.done, and
  last response.completed or response.incomplete with the whole response; `sequence_number` counts the events. A
  failure after the stream began is an `error` event.
* Responses with `store` (the default) are kept in memory, the last `MAX_STORED_RESPONSES` within
  `MAX_STORED_BYTES` of their JSON (the oldest dropped first; one larger than that is not kept), for
  `previous_response_id` and GET /v1/responses/{id} (404 for any other id).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.errors import OpenAIError, error_body
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ResponsesRequest, now_s, random_uuid
from pagedllm.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from pagedllm.entrypoints.openai.serving_engine import SSEResponse, merge_async_iterators, raise_if_failed, sse_event
from pagedllm.outputs import RequestOutput

# Stored responses kept for previous_response_id and GET /v1/responses/{id}; the oldest are dropped first.
MAX_STORED_RESPONSES = 1024
MAX_STORED_BYTES = 256 << 20


def _invalid(message: str, param: str) -> OpenAIError:
    return OpenAIError(message, 400, param)


def _text_parts(content: Any, where: str) -> str:
    """The text of a message's content: a string or input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(f"{where} must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise _invalid(f"{where}[{j}]: {kind} parts are not supported: this server runs text-only models", where)
        else:
            raise _invalid(f"{where}[{j}]: expected an input_text or output_text part, got {str(part)[:120]}", where)
    return "".join(texts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a Responses `input`."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") in ("user", "system", "developer", "assistant"):
            messages.append({"role": item["role"], "content": _text_parts(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name, call_id, arguments = item.get("name"), item.get("call_id"), item.get("arguments")
            if not (isinstance(name, str) and isinstance(call_id, str) and isinstance(arguments, str)):
                raise _invalid(f"{where}: a function_call item needs name, call_id and arguments strings", where)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _invalid(f"{where}: a function_call_output item needs a call_id string", where)
            output = _text_parts(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind != "reasoning":  # earlier reasoning is not shown to the model again
            raise _invalid(
                f"{where}: items of type {kind!r} (role {item.get('role')!r}) are not supported; give messages "
                "(user, system, developer, assistant), function_call or function_call_output items",
                where,
            )
    return messages


def _tools(request: ResponsesRequest) -> list[dict[str, Any]] | None:
    if request.tools is None:
        return None
    out = []
    for i, tool in enumerate(request.tools):
        if tool.get("type") != "function":
            raise _invalid(
                f"tools[{i}]: built-in tools ({tool.get('type')!r}) are not available here; give function tools",
                f"tools[{i}]",
            )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise _invalid(f"tools[{i}]: a function tool needs a name", f"tools[{i}].name")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any, has_tools: bool) -> Any:
    if choice == "auto" and not has_tools:
        return None  # the Responses API's default, which clients send back even without tools: plain text
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _invalid('tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}', "tool_choice")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"]}}
    raise _invalid(
        'text.format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name", "schema"}',
        "text.format",
    )


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the response object
    conversation: list[dict[str, Any]]  # its chat messages, input and output, without the instructions
    size: int = 0  # bytes of both as JSON


class OpenAIServingResponses:
    def __init__(
        self, chat: OpenAIServingChat, max_stored: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES
    ) -> None:
        self.chat = chat
        self.max_stored = max_stored
        self.max_bytes = max_bytes
        self.stored: OrderedDict[str, StoredResponse] = OrderedDict()
        self.stored_bytes = 0

    # ---- the request ----------------------------------------------------------------------------------------

    def to_chat_request(self, request: ResponsesRequest) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
        """The chat request, and the conversation it continues plus its own input (without the instructions)."""
        conversation: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            previous = self.stored.get(request.previous_response_id)
            if previous is None:
                raise _invalid(
                    f"Previous response with id '{request.previous_response_id}' not found: it was never stored "
                    f"here (store: false), or it is older than the last {self.max_stored} responses (or the last "
                    f"{self.max_bytes >> 20} MiB of them).",
                    "previous_response_id",
                )
            conversation = list(previous.conversation)
        conversation += input_messages(request.input)
        if not conversation:
            raise _invalid("input must not be empty", "input")
        messages = [{"role": "system", "content": request.instructions}] if request.instructions else []
        fields: dict[str, Any] = {
            "model": request.model,
            "messages": messages + conversation,
            "max_tokens": request.max_output_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": request.top_k,
            "tools": _tools(request),
            "tool_choice": _tool_choice(request.tool_choice, bool(request.tools)),
            "response_format": _response_format(request.text),
            "stream": request.stream,
            "priority": request.priority,
            "chat_template_kwargs": request.chat_template_kwargs,
            "cache_salt": request.cache_salt,
            "vllm_xargs": request.vllm_xargs,
            "reasoning_effort": (request.reasoning or {}).get("effort"),
        }
        if not request.parallel_tool_calls:
            fields["parallel_tool_calls"] = False
        try:
            return ChatCompletionRequest(**fields), conversation
        except ValueError as e:  # pydantic: a message the chat model refuses
            raise _invalid(str(e), "input") from None

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        self.chat.warn_ignored_fields(request)
        if request.background:
            raise _invalid("background responses are not supported", "background")
        chat_request, conversation = self.to_chat_request(request)
        response_id = f"resp_{random_uuid()}"
        run = await self.chat.start(chat_request, response_id)
        shell = self._shell(request, response_id)
        if request.stream:
            return SSEResponse(self._stream(request, chat_request, run, shell, conversation))
        final = await self.chat.collect(run, chat_request, raw_request)
        output = final.outputs[0]
        message, finish_reason = self.chat.message(run.plan, output.text, output.finish_reason)
        items = _Items()
        if message.reasoning_content:
            items.add_reasoning(message.reasoning_content)
        if message.content:
            items.add_text(message.content)
        for call in message.tool_calls or []:
            items.add_call(call["id"], call["function"]["name"], call["function"]["arguments"])
        body = self._finish(shell, items, run, final, len(output.token_ids), finish_reason)
        self._store(request, body, conversation, items)
        return Response(json.dumps(body, ensure_ascii=False), media_type="application/json")

    def retrieve(self, response_id: str) -> Response:
        stored = self.stored.get(response_id)
        if stored is None:
            raise OpenAIError(f"Response with id '{response_id}' not found.", 404, "response_id")
        return Response(json.dumps(stored.body, ensure_ascii=False), media_type="application/json")

    # ---- the response ---------------------------------------------------------------------------------------

    def _shell(self, request: ResponsesRequest, response_id: str) -> dict[str, Any]:
        """The response object before its output: what the request asked for, status in_progress."""
        return {
            "id": response_id,
            "object": "response",
            "created_at": now_s(),
            "status": "in_progress",
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata,
            "model": self.chat.response_model(request.model),
            "output": [],
            "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": request.previous_response_id,
            "reasoning": None,
            "store": request.store,
            "temperature": request.temperature,
            "text": request.text or {"format": {"type": "text"}},
            "tool_choice": request.tool_choice if request.tool_choice is not None else "auto",
            "tools": request.tools or [],
            "top_p": request.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": request.user,
        }

    def _finish(
        self,
        shell: dict[str, Any],
        items: _Items,
        run: ChatRun,
        final: RequestOutput,
        output_tokens: int,
        finish_reason: str | None,
    ) -> dict[str, Any]:
        body = dict(shell, output=items.items, completed_at=now_s())
        if finish_reason == "length":
            body["status"], body["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        else:
            body["status"] = "completed"
        body["usage"] = {
            "input_tokens": run.prompt_tokens,
            "input_tokens_details": {"cached_tokens": final.num_cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": run.prompt_tokens + output_tokens,
        }
        return body

    def _store(
        self, request: ResponsesRequest, body: dict[str, Any], conversation: list[dict[str, Any]], items: _Items
    ) -> None:
        if not request.store:
            return
        entry = StoredResponse(body, conversation + items.messages())
        entry.size = len(json.dumps(entry.body)) + len(json.dumps(entry.conversation))
        if entry.size > self.max_bytes:
            return
        self.stored[body["id"]] = entry
        self.stored_bytes += entry.size
        while len(self.stored) > self.max_stored or self.stored_bytes > self.max_bytes:
            self.stored_bytes -= self.stored.popitem(last=False)[1].size

    async def _stream(
        self,
        request: ResponsesRequest,
        chat_request: ChatCompletionRequest,
        run: ChatRun,
        shell: dict[str, Any],
        conversation: list[dict[str, Any]],
    ) -> AsyncGenerator[str, None]:
        events = _Events()
        items = _Items(events)
        output_tokens = 0
        merged = merge_async_iterators(run.gen)
        try:
            events.emit("response.created", response=shell)
            events.emit("response.in_progress", response=shell)
            for event in events.drain():
                yield event
            choice = self.chat.choice_stream(run.plan)
            try:
                async for _, out in merged:
                    raise_if_failed(out)
                    c = out.outputs[0]
                    output_tokens += len(c.token_ids)
                    reasoning, content, tool_calls, finish_reason = choice.step(c.text, c.finish_reason)
                    if reasoning:
                        items.stream_reasoning(reasoning)
                    if content:
                        items.stream_text(content)
                    for piece in tool_calls or []:
                        fn = piece.get("function", {})
                        if piece.get("id") is not None:
                            items.stream_call(piece["id"], fn.get("name", ""))
                        if fn.get("arguments"):
                            items.stream_arguments(fn["arguments"])
                    if finish_reason is not None:
                        items.close()
                        body = self._finish(shell, items, run, out, output_tokens, finish_reason)
                        self._store(request, body, conversation, items)
                        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
                        events.emit(kind, response=body)
                    for event in events.drain():
                        yield event
            except Exception as e:
                err = self.chat.error_for(e, chat_request)
                body = error_body(err.message, err.status, err.param)["error"]
                events.emit("error", code=str(err.status), message=body["message"], param=body["param"])
                for event in events.drain():
                    yield event
        finally:
            await merged.aclose()


class _Events:
    """Numbered Responses stream events, queued until drained."""

    def __init__(self) -> None:
        self.sequence = 0
        self.queue: list[str] = []

    def emit(self, kind: str, **fields: Any) -> None:
        """Queue an event; its data is serialised now (an item that changes later is sent as it is now)."""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        self.queue.append(sse_event(kind, data))

    def drain(self) -> list[str]:
        out, self.queue = self.queue, []
        return out


class _Items:
    """A response's output items, built whole or streamed (with `events`: the events that build them)."""

    def __init__(self, events: _Events | None = None) -> None:
        self.items: list[dict[str, Any]] = []
        self.events = events
        self.open: dict[str, Any] | None = None  # the item being streamed

    # whole
    def add_reasoning(self, text: str) -> None:
        self.items.append(_reasoning_item([_reasoning_part(text)], "completed"))

    def add_text(self, text: str) -> None:
        self.items.append(_message_item([_text_part(text)], "completed"))

    def add_call(self, call_id: str, name: str, arguments: str) -> None:
        self.items.append(_call_item(call_id, name, arguments, "completed"))

    def messages(self) -> list[dict[str, Any]]:
        """The items as chat messages (for a later previous_response_id): the text and calls of one assistant turn."""
        text = "".join(p["text"] for it in self.items if it["type"] == "message" for p in it["content"])
        calls = [
            {"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
            for it in self.items
            if it["type"] == "function_call"
        ]
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        return [message]

    # streamed
    def _emit(self, kind: str, **fields: Any) -> None:
        assert self.events is not None
        self.events.emit(kind, **fields)

    def _start(self, item: dict[str, Any]) -> None:
        self.close()
        self.items.append(item)
        self.open = item
        self._emit("response.output_item.added", output_index=len(self.items) - 1, item=item)

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def stream_reasoning(self, text: str) -> None:
        if self.open is None or self.open["type"] != "reasoning":
            self._start(_reasoning_item([], "in_progress"))
            self._add_part(_reasoning_part(""))
        assert self.open is not None
        self.open["content"][0]["text"] += text
        self._emit("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)

    def stream_text(self, text: str) -> None:
        if self.open is None or self.open["type"] != "message":
            self._start(_message_item([], "in_progress"))
            self._add_part(_text_part(""))
        assert self.open is not None
        self.open["content"][0]["text"] += text
        self._emit("response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=[])

    def _add_part(self, part: dict[str, Any]) -> None:
        assert self.open is not None
        self.open["content"].append(part)
        self._emit("response.content_part.added", **self._where(), content_index=0, part=part)

    def stream_call(self, call_id: str, name: str) -> None:
        self._start(_call_item(call_id, name, "", "in_progress"))

    def stream_arguments(self, piece: str) -> None:
        if self.open is None or self.open["type"] != "function_call":
            return
        self.open["arguments"] += piece
        self._emit("response.function_call_arguments.delta", **self._where(), delta=piece)

    def close(self) -> None:
        item = self.open
        if item is None:
            return
        where = self._where()
        if item["type"] == "message":
            part = item["content"][0]
            self._emit("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            self._emit("response.content_part.done", **where, content_index=0, part=part)
        elif item["type"] == "reasoning":
            part = item["content"][0]
            self._emit("response.reasoning_text.done", **where, content_index=0, text=part["text"])
            self._emit("response.content_part.done", **where, content_index=0, part=part)
        else:
            self._emit("response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"])
        item["status"] = "completed"
        self._emit("response.output_item.done", output_index=where["output_index"], item=item)
        self.open = None


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _message_item(content: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{random_uuid()}", "status": status, "role": "assistant", "content": content}


def _reasoning_item(content: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": f"rs_{random_uuid()}", "summary": [], "content": content, "status": status}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{random_uuid()}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


__all__ = ["MAX_STORED_RESPONSES", "OpenAIServingResponses", "input_messages"]
