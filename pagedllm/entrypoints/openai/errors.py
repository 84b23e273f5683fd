"""OpenAI-style errors for the HTTP server.

Contract: every error the server answers has OpenAI's shape
`{"error": {"message": str, "type": str, "param": str | None, "code": int}}` with `code` equal to the HTTP
status and `type` one of the names in `ERROR_TYPES` (the names vLLM uses). Handlers raise `OpenAIError`
(or let a `ValueError` from input validation escape); `error_from_exception` maps any exception to the one
status it deserves: bad input 400, unknown model 404, dead engine 503, anything else 500 (a bug, logged).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse
from jinja2 import TemplateError

from pagedllm.engine.exceptions import EngineDeadError, EngineSleepingError

ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """An error answered to the client with `status` and OpenAI's error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, err_type: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.param = param
        self.err_type = err_type or ERROR_TYPES.get(self.status) or HTTPStatus(self.status).phrase.replace(" ", "")


def error_body(message: str, status: int, param: str | None = None, err_type: str | None = None) -> dict[str, Any]:
    """The JSON body of an error response."""
    err = OpenAIError(message, status, param, err_type)
    return {"error": {"message": err.message, "type": err.err_type, "param": err.param, "code": err.status}}


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.status, err.param, err.err_type), status_code=err.status)


def error_bytes(message: str, status: int, param: str | None = None) -> bytes:
    """The error body as bytes, for the raw ASGI middlewares and for SSE error events."""
    return json.dumps(error_body(message, status, param)).encode()


_LEADING_NAME = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)")


def param_from_message(message: str, fields: Iterable[str]) -> str | None:
    """The request field a validation message names first ("top_p must be in (0, 1], got 2.0" -> "top_p")."""
    m = _LEADING_NAME.match(message)
    if m and m.group(1) in set(fields):
        return m.group(1)
    return None


def error_from_exception(exc: BaseException, fields: Iterable[str] = ()) -> OpenAIError:
    """Map an exception raised while serving a request to the error the client receives."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return OpenAIError(f"The engine is not available: {exc}", 503)
    if isinstance(exc, EngineSleepingError):
        return OpenAIError(f"The engine is not available: {exc}", 503)
    if isinstance(exc, TemplateError):
        # The chat template itself refused the conversation (e.g. roles out of order).
        return OpenAIError(f"the chat template rejected the messages: {exc}", 400, "messages")
    if isinstance(exc, ValueError | OverflowError):
        # Input validation (SamplingParams, InputProcessor) raises ValueError naming the offending value.
        # (A TypeError is left to be a 500: past pydantic, it means a bug, not bad input.)
        message = str(exc) or type(exc).__name__
        return OpenAIError(message, 400, param_from_message(message, fields))
    return OpenAIError(f"Internal server error: {type(exc).__name__}: {exc}", 500)


# Names pydantic gives the members of a union in an error's location ("str" of `str | list[str]`); the other
# member names it uses are not identifiers ("list[str]", "constrained-int", "function-after[...]").
_UNION_MEMBER_NAMES = frozenset({"str", "int", "float", "bool", "bytes", "none", "list", "dict"})


def param_path(loc: Iterable[Any]) -> str | None:
    """OpenAI's name of the field a validation error's location points at: ("body", "messages", 0, "role") ->
    "messages[0].role"; union member names and dict keys that are not identifiers end the path."""
    path = ""
    for part in loc:
        if part == "body" and not path:
            continue
        if isinstance(part, int) and path:
            path += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _UNION_MEMBER_NAMES:
            path += f".{part}" if path else part
        else:
            break
    return path or None


def format_validation_errors(errors: Iterable[dict[str, Any]]) -> tuple[str, str | None]:
    """(message, param) for pydantic/FastAPI validation errors: one "field: problem" clause per error; param is
    the first error's field in OpenAI's notation (`param_path`)."""
    clauses = []
    first_param = None
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        msg = err.get("msg", "invalid value")
        if err.get("type") == "json_invalid":
            msg = f"the request body is not valid JSON ({err.get('ctx', {}).get('error', msg)})"
            loc, where = [], ""
        if first_param is None and loc:
            first_param = param_path(err.get("loc", ()))
        clauses.append(f"{where}: {msg}" if where else msg)
    return "; ".join(clauses) or "invalid request", first_param
