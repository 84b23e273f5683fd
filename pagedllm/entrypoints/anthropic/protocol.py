"""Pydantic models of Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`).

Contract: as the OpenAI models (entrypoints/openai/protocol.py), requests validate types and shapes only and keep
unknown fields (ignored with a warning); content blocks, tools and tool_choice are checked by the handler
(serving_messages.py), which names the offending field in Anthropic's notation (`messages.0.content.1.type`).
Responses mirror Anthropic's objects: a `message` with content blocks (`text`, `thinking`, `tool_use`), its
`stop_reason` (end_turn, max_tokens, stop_sequence, tool_use) and `usage` in input/output tokens. Errors are
`{"type": "error", "error": {"type": ..., "message": ...}}` (`AnthropicErrorResponse`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from pagedllm.entrypoints.openai.protocol import Int64, OpenAIBaseModel

# Anthropic's error types by HTTP status (an unknown status is an api_error).
ANTHROPIC_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class AnthropicErrorInfo(OpenAIBaseModel):
    type: str
    message: str


class AnthropicErrorResponse(OpenAIBaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo


# The paths of the Anthropic API: their errors (401, 429 and validation errors included) take Anthropic's shape.
ANTHROPIC_PATH_PREFIX = "/v1/messages"


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PATH_PREFIX or path.startswith(ANTHROPIC_PATH_PREFIX + "/")


def anthropic_error_body(message: str, status: int) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}


class AnthropicMessage(OpenAIBaseModel):
    role: Literal["user", "assistant"]
    # A string, or content blocks: text, tool_use (assistant), tool_result (user); checked by the handler.
    content: str | list[dict[str, Any]]


_EXAMPLE = {"role": "user", "content": "Name a primary color."}


class MessagesRequestBase(OpenAIBaseModel):
    """What `/v1/messages` and `/v1/messages/count_tokens` share: the conversation and the tools."""

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    # [{"name", "description"?, "input_schema"}]: custom tools (server tools such as web search are a 400)
    tools: list[dict[str, Any]] | None = None
    # {"type": "auto" | "any" | "tool" | "none", "name"?: ..., "disable_parallel_tool_use"?: bool}
    tool_choice: dict[str, Any] | None = None
    # {"type": "enabled", "budget_tokens"?} or {"type": "disabled"}: the chat template's `enable_thinking`
    thinking: dict[str, Any] | None = None


class MessagesRequest(MessagesRequestBase):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"model": "default", "max_tokens": 4, "messages": [_EXAMPLE], "system": "Be brief."},
                {"model": "default", "max_tokens": 3, "messages": [_EXAMPLE], "stream": True, "temperature": 0},
            ]
        }
    )

    max_tokens: Annotated[Int64, Field(ge=1)]
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    metadata: dict[str, Any] | None = None
    # {"format": {"type": "json_schema", "schema": {...}}} constrains the text to the schema; "effort" is ignored
    output_config: dict[str, Any] | None = None


class CountTokensRequest(MessagesRequestBase):
    model_config = ConfigDict(json_schema_extra={"examples": [{"model": "default", "messages": [_EXAMPLE]}]})


class CountTokensResponse(OpenAIBaseModel):
    input_tokens: int


class AnthropicUsage(OpenAIBaseModel):
    input_tokens: int
    output_tokens: int


class MessagesResponse(OpenAIBaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    # {"type": "text", "text"}, {"type": "thinking", "thinking", "signature"},
    # {"type": "tool_use", "id", "name", "input"}
    content: list[dict[str, Any]]
    model: str
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None = None
    stop_sequence: str | None = None
    usage: AnthropicUsage
