"""The served OpenAPI description (/openapi.json): what each route can answer, so that generated clients are right.

Contract: every status a route can answer is declared, with its content type and schema, and none other:
* errors carry OpenAI's body (`ErrorResponse`), Anthropic's on its routes (`AnthropicErrorResponse`): 400 bad input
  and 413 a body over --max-request-bytes (every route with a body), 404 an unknown
  `model`, 503 a dead engine core (the routes that need it); 401 a missing or wrong API key (every route but
  /health and /ping) only when the server has a key, and 429 over --max-queued-requests (the generation routes)
  only when the server has that limit;
* FastAPI's default 422 is removed: the server turns every validation error into a 400 (api_server.py);
* a generation route answers 200 with `application/json`, or `text/event-stream` when the request streams: each
  event's `data` is one JSON chunk, an error object, or the final `[DONE]`;
* /health and /ping answer 200 with an empty body, /metrics `text/plain` (Prometheus' text format);
* with an API key, the description names the bearer scheme on every route that wants it.
A 500 is not declared: it is a bug, never an answer the server means to give.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pagedllm.entrypoints.anthropic.protocol import AnthropicErrorResponse, is_anthropic_path
from pagedllm.entrypoints.openai.protocol import ErrorResponse

ERROR_DESCRIPTIONS: dict[int, str] = {
    400: "Invalid request: malformed JSON, a wrong type, a value out of range, or a prompt too long for the "
    "context. `error.param` names the field when there is one.",
    401: "A missing or wrong API key (only when the server has one): send `Authorization: Bearer <key>`.",
    404: "The `model` named in the request is not served here.",
    413: "The request body is larger than the server's --max-request-bytes.",
    429: "More generation requests in flight than --max-queued-requests allows; retry after `Retry-After` seconds.",
    503: "The engine core process died; the server is about to exit.",
}
RESPONSE_HEADERS: dict[int, dict[str, Any]] = {
    401: {"WWW-Authenticate": {"description": "`Bearer`", "schema": {"type": "string"}}},
    429: {"Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "integer"}}},
}
# The paths a client may call without the API key (api_server.AUTH_EXEMPT_PATHS).
NO_AUTH_PATHS = frozenset({"/health", "/ping"})
BEARER_SCHEME = "bearer"
API_KEY_HEADER_SCHEME = "x-api-key"

# Open API 3.1 reads the schema of a `text/event-stream` response as the schema of one event (3.2 calls it
# `itemSchema`): an event has a `data` field, here the text of one JSON object or `[DONE]`.
SSE_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "One server-sent event.",
    "properties": {
        "data": {
            "type": "string",
            "description": "A JSON chunk (`object` ending in `.chunk` for chat, `text_completion` otherwise), an "
            'error object `{"error": {...}}` if the generation failed after the stream began, or `[DONE]` last.',
        }
    },
    "required": ["data"],
}


# Anthropic's stream: each event names its type in `event` and carries the JSON object in `data`.
ANTHROPIC_SSE_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "One server-sent event of Anthropic's Messages stream.",
    "properties": {
        "event": {
            "type": "string",
            "description": "message_start, content_block_start, content_block_delta, content_block_stop, "
            "message_delta, message_stop, or error.",
        },
        "data": {"type": "string", "description": "The event's JSON object, whose `type` is the event's name."},
    },
    "required": ["event", "data"],
}


def errors(*statuses: int, anthropic: bool = False) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` entries for these error statuses, each with OpenAI's error body (Anthropic's with
    `anthropic`)."""
    model = AnthropicErrorResponse if anthropic else ErrorResponse
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {"model": model, "description": ERROR_DESCRIPTIONS[status]}
        if status in RESPONSE_HEADERS:
            entry["headers"] = RESPONSE_HEADERS[status]
        out[status] = entry
    return out


def streamable(description: str, anthropic: bool = False) -> dict[int | str, dict[str, Any]]:
    """The 200 entry of a route answering JSON (its `response_model`) or, with `stream: true`, an event stream."""
    schema = ANTHROPIC_SSE_EVENT_SCHEMA if anthropic else SSE_EVENT_SCHEMA
    return {200: {"description": description, "content": {"text/event-stream": {"schema": schema}}}}


def empty_ok(description: str) -> dict[int | str, dict[str, Any]]:
    """A 200 without a body (use with `response_class=Response`)."""
    return {200: {"description": description}}


def install_openapi(app: FastAPI, api_key: bool, queue_limit: bool, generation_paths: frozenset[str]) -> None:
    """Make `app.openapi()` build the description once, with what FastAPI cannot be told per route: the 422
    it adds by default removed, and the statuses that depend on the server's flags (`describe`)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(
                title=app.title, version=app.version, openapi_version=app.openapi_version, routes=app.routes
            )
            describe(spec, api_key, generation_paths if queue_limit else frozenset())
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def describe(spec: dict[str, Any], api_key: bool, limited_paths: frozenset[str]) -> None:
    """Edit `spec` in place: drop FastAPI's 422 (never sent) and its schemas; with an API key, declare the bearer
    scheme and a 401 on every route that wants it; declare a 429 on the `limited_paths`."""
    for path, operations in spec.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            anthropic = is_anthropic_path(path)
            if api_key and path not in NO_AUTH_PATHS:
                operation["security"] = [{BEARER_SCHEME: []}, {API_KEY_HEADER_SCHEME: []}]
                responses["401"] = _error_entry(401, anthropic)
            if path in limited_paths:
                responses["429"] = _error_entry(429, anthropic)
            if "requestBody" in operation:
                responses["413"] = _error_entry(413, anthropic)
    components = spec.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for model in (ErrorResponse, AnthropicErrorResponse):
        if model.__name__ not in schemas:  # no route declared such an error itself
            defs = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(defs.pop("$defs", {}))
            schemas[model.__name__] = defs
    if api_key:
        schemes = components.setdefault("securitySchemes", {})
        schemes[BEARER_SCHEME] = {
            "type": "http",
            "scheme": "bearer",
            "description": "The server's API key (--api-key or $PAGEDLLM_API_KEY).",
        }
        schemes[API_KEY_HEADER_SCHEME] = {
            "type": "apiKey",
            "in": "header",
            "name": "x-api-key",
            "description": "The same key in Anthropic's header.",
        }


def _error_entry(status: int, anthropic: bool = False) -> dict[str, Any]:
    name = "AnthropicErrorResponse" if anthropic else "ErrorResponse"
    entry: dict[str, Any] = {
        "description": ERROR_DESCRIPTIONS[status],
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
    }
    if status in RESPONSE_HEADERS:
        entry["headers"] = RESPONSE_HEADERS[status]
    return entry
