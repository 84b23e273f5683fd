"""The OpenAI-compatible HTTP server: `build_app(engine, args)` (FastAPI) and `run_server(args)` (uvicorn).

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /tokenize, POST /detokenize,
GET /health, GET|POST /ping, GET /version, GET /load, GET /metrics, POST /sleep?level=1|2, POST /wake_up,
GET /is_sleeping (sleep mode: engine/core.py), and with --enable-debug-routes
GET /debug/kv_cache. For pooling models (--runner pooling): POST /v1/embeddings, POST /pooling, POST /classify,
POST /score and /v1/score, POST /rerank, /v1/rerank and /v2/rerank (on a generative model, a 400 naming the
runner; a pooling model answers the generation routes a 400 likewise).

Contract:
* Every error is OpenAI's JSON shape (see errors.py): invalid input (including what pydantic rejects) 400,
  missing/wrong API key 401, unknown model 404, over --max-queued-requests 429, engine dead 503; a 500
  only for a bug. A rejected request never reaches the engine and never disturbs others.
* With an API key (--api-key or $PAGEDLLM_API_KEY) every route but /health and /ping wants
  `Authorization: Bearer KEY`.
* /openapi.json describes what each route answers, and only that: every status with its content type and body,
  the statuses that depend on the flags (401, 429) only when they can happen, no 422 (openapi_spec.py).
* /health answers 200 while the engine core lives and 503 once it died. In-flight requests then get an error
  at once (503 JSON, or an SSE error event); a watchdog stops uvicorn ENGINE_DEATH_GRACE_S later and
  `run_server` returns 1.
* SIGINT/SIGTERM stop uvicorn gracefully (open requests get --timeout-graceful-shutdown seconds), then the
  engine-core process is shut down; `run_server` returns 0. No child process outlives the server.
* Router mode (--models, --models-dir; entrypoints/router/server.py builds its app with `make_app`): the same
  model routes, each reading the stack (`ModelStack`: engine and serving objects) of the model its body names;
  /health, /ping and /v1/models are the router's, and a dead engine is restarted rather than ending the server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import secrets
import signal
import socket
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import pagedllm
from pagedllm.config import api_key_from_env, json_object, parse_size, runtime_lora_updating_allowed
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.core_process import CoreProcess
from pagedllm.engine.input_processor import check_chat_template_kwargs
from pagedllm.engine.llm import check_sleep_level
from pagedllm.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
    MessagesResponse,
    anthropic_error_body,
    is_anthropic_path,
)
from pagedllm.entrypoints.anthropic.serving_messages import AnthropicServingMessages
from pagedllm.entrypoints.openai.cli_args import DEFAULT_MAX_REQUEST_BYTES, router_mode
from pagedllm.entrypoints.openai.errors import (
    OpenAIError,
    error_bytes,
    error_from_exception,
    error_response,
    format_validation_errors,
)
from pagedllm.entrypoints.openai.openapi_spec import empty_ok, errors, install_openapi, streamable
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ClassificationRequest,
    ClassificationResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    IsSleepingResponse,
    LoadLoRAAdapterRequest,
    LoadResponse,
    ModelCard,
    ModelList,
    PoolingRequest,
    PoolingResponse,
    RerankRequest,
    RerankResponse,
    ResponsesRequest,
    ResponsesResponse,
    ScoreRequest,
    ScoreResponse,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
    VersionResponse,
    random_uuid,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagedllm.entrypoints.openai.serving_engine import ClientDisconnected, FrontendOptions, OpenAIServing
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.entrypoints.openai.serving_score import OpenAIServingScore
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedllm.lora.request import LoRARequest, parse_lora_modules

logger = logging.getLogger(__name__)

# Requests that run a generation: they count towards /load and --max-queued-requests.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"})
# Routes a load balancer or orchestrator probes without credentials.
AUTH_EXEMPT_PATHS = frozenset({"/health", "/ping"})
WATCHDOG_INTERVAL_S = 0.25
# A refused body is read to its end and dropped, up to this much, before the 413 (see RequestSizeMiddleware).
DRAIN_LIMIT_BYTES = 1 << 30
# After the engine died the server keeps answering (503) this long before it exits, so that health probes see
# the 503 and in-flight requests receive their error responses; well within the 10 s a supervisor expects.
ENGINE_DEATH_GRACE_S = 2.0
# The key of the request's scope under which the router (router/server.py) puts the stack of the request's model.
ROUTED_STACK = "pagedllm.model_stack"


# ---- middlewares (plain ASGI: they must not buffer streams or hide client disconnects) -------------------


def _error_response(path: str, err: OpenAIError) -> JSONResponse:
    """The error in the shape of the API that `path` belongs to: Anthropic's on /v1/messages, else OpenAI's."""
    if is_anthropic_path(path):
        return JSONResponse(anthropic_error_body(err.message, err.status), status_code=err.status)
    return error_response(err)


def route_path(scope: Scope) -> str:
    """The path a request names within the app: without the --root-path prefix, which uvicorn puts in front of it
    (ASGI's `path` includes `root_path`)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


async def send_error(
    scope: Scope,
    send: Send,
    status: int,
    message: str,
    extra_headers: Sequence[tuple[bytes, bytes]] = (),
    param: str | None = None,
) -> None:
    """An error response from a plain ASGI middleware, in the shape of the path's API (OpenAI's or Anthropic's)."""
    if is_anthropic_path(route_path(scope)):
        body = json.dumps(anthropic_error_body(message, status)).encode()
    else:
        body = error_bytes(message, status, param)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": [*headers, *extra_headers]})
    await send({"type": "http.response.body", "body": body})


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in AUTH_EXEMPT_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer":
            ok = secrets.compare_digest(token.strip(), self.api_key)
        else:  # Anthropic's clients send the key as x-api-key
            ok = secrets.compare_digest(headers.get(b"x-api-key", b"").strip(), self.api_key)
        if not ok:
            await send_error(
                scope, send, 401,
                "Incorrect or missing API key: send `Authorization: Bearer <key>` (or `x-api-key: <key>`).",
                [(b"www-authenticate", b"Bearer")],
            )  # fmt: skip
            return
        await self.app(scope, receive, send)


@dataclass
class ServerLoad:
    """Generation requests in flight (from the request's arrival until its response ended)."""

    in_flight: int = 0
    limit: int | None = None


class RequestIdHeaderMiddleware:
    """--enable-request-id-headers: every response carries X-Request-Id, the request's own or a new one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id")
        request_id = given if given else random_uuid().encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class ServerLoadMiddleware:
    def __init__(self, app: ASGIApp, load: ServerLoad) -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        if self.load.limit is not None and self.load.in_flight >= self.load.limit:
            await send_error(
                scope, send, 429, f"The server is busy: {self.load.in_flight} requests are in flight "
                f"(--max-queued-requests {self.load.limit}). Retry later.", [(b"retry-after", b"1")],
            )  # fmt: skip
            return
        self.load.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.in_flight -= 1


class RequestSizeMiddleware:
    """Refuse a request body over `limit` bytes with a 413 before the app sees it: when Content-Length says so
    before anything is kept, else as soon as the received chunks pass the limit. The rest of a refused body is
    read and dropped first (up to DRAIN_LIMIT_BYTES), so that a client still sending it gets the 413 rather than a
    reset connection. A body within the limit is handed to the app as one message."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            # Drained (see _refuse) unless the client waits for a 100 Continue before it sends the body (curl does
            # for large uploads: it then reads the 413 at once) or the body is too large to be worth reading.
            waiting = headers.get(b"expect", b"").lower() == b"100-continue"
            more = not waiting and int(declared) <= DRAIN_LIMIT_BYTES
            await self._refuse(scope, receive, send, int(declared), more=more)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before the body was whole
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            more = bool(message.get("more_body", False))
            if size > self.limit:
                chunks.clear()
                await self._refuse(scope, receive, send, size, more)
                return
            chunks.append(chunk)
            if not more:
                break
        body: bytes | None = b"".join(chunks)
        del chunks

        async def replay() -> Message:
            nonlocal body
            if body is None:
                return await receive()  # after the body: the disconnect, when it comes
            message: Message = {"type": "http.request", "body": body, "more_body": False}
            body = None
            return message

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: int, more: bool) -> None:
        drained = 0
        while more and drained < DRAIN_LIMIT_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return
            drained += len(message.get("body", b""))
            more = bool(message.get("more_body", False))
        await send_error(
            scope, send, 413, f"The request body has {size:,} bytes or more, over the server's limit of "
            f"{self.limit:,} (--max-request-bytes).", [(b"connection", b"close")],
        )  # fmt: skip


# ---- routes ----------------------------------------------------------------------------------------------


router = APIRouter()  # the routes of both modes (the model-bearing ones read the request's model's stack)
single_router = APIRouter()  # one model: its /health, /ping and /v1/models (router/server.py has the router's)
debug_router = APIRouter()
lora_router = APIRouter()  # with $PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING=1


def _engine(request: Request) -> AsyncLLM:
    return request.app.state.engine


def _stack(request: Request) -> ModelStack:
    """The engine and serving objects of the request's model: the router's pick (ROUTED_STACK in the request's
    scope, see router/server.py), else the one model's."""
    stack = request.scope.get(ROUTED_STACK) or request.app.state.stack
    if stack is None:  # router mode, a body the router could not read a model from (and pydantic accepted)
        raise OpenAIError("`model` is required: it names the model to run.", 400, "model")
    return stack


def _engine_alive(engine: AsyncLLM) -> bool:
    return not engine.dead and engine.errored is None


# Each route declares every status it answers (openapi_spec.py; 401 and 429 are added there, per the flags).


_HEALTH_RESPONSES = {**empty_ok("The engine core is alive."), **errors(503)}


@single_router.get("/health", response_class=Response, responses=_HEALTH_RESPONSES)
async def health(raw_request: Request) -> Response:
    if not _engine_alive(_engine(raw_request)):
        return error_response(OpenAIError("The engine core process died.", 503))
    return Response(status_code=200)


_PING_RESPONSES = {**empty_ok("The engine core is alive."), **errors(503)}


@single_router.get("/ping", operation_id="ping_get", response_class=Response, responses=_PING_RESPONSES)
@single_router.post("/ping", operation_id="ping_post", response_class=Response, responses=_PING_RESPONSES)
async def ping(raw_request: Request) -> Response:
    return await health(raw_request)


@router.get("/version", response_model=VersionResponse)
async def version() -> JSONResponse:
    return JSONResponse({"version": pagedllm.__version__})


@router.get("/load", response_model=LoadResponse)
async def load(raw_request: Request) -> JSONResponse:
    return JSONResponse({"server_load": raw_request.app.state.server_load.in_flight})


@router.get("/metrics", response_class=PlainTextResponse, responses={200: {"description": "Prometheus' text format."}})
async def metrics() -> Response:
    """Prometheus text format. Behind the API key like every route but /health and /ping (vLLM leaves it open):
    a scraper sends the key (`authorization: {credentials: KEY}` in Prometheus' scrape config)."""
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


def _model_cards(state: Any) -> list[ModelCard]:
    mc = state.engine.model_config
    cards = [ModelCard(id=name, root=mc.model, max_model_len=mc.max_model_len) for name in state.served_model_names]
    for lora in state.engine.loras.by_id.values():  # adapters: their parent is the base model
        parent = lora.base_model_name or state.served_model_names[0]
        cards.append(ModelCard(id=lora.lora_name, root=lora.lora_path, parent=parent, max_model_len=mc.max_model_len))
    return cards


@single_router.get("/v1/models", response_model=ModelList)
async def show_models(raw_request: Request) -> Response:
    return Response(
        ModelList(data=_model_cards(raw_request.app.state)).model_dump_json(), media_type="application/json"
    )


@single_router.get("/v1/models/{model:path}", response_model=ModelCard, responses=errors(404))
async def retrieve_model(model: str, raw_request: Request) -> Response:
    """OpenAI's model retrieval: the card of `model` (a served name, an adapter's, or a name requests may give the
    base model, such as its path)."""
    state = raw_request.app.state
    cards = _model_cards(state)
    listed = {card.id for card in cards}
    if model not in listed and model in state.stack.serving_chat.served_model_names:  # e.g. the model's path
        return Response(cards[0].model_dump_json(), media_type="application/json")
    return model_card_response(cards, model)


def model_card_response(cards: list[ModelCard], model: str) -> Response:
    """The card named `model`, or OpenAI's 404 for a model that does not exist."""
    for card in cards:
        if card.id == model:
            return Response(card.model_dump_json(), media_type="application/json")
    raise OpenAIError(f"The model `{model}` does not exist.", 404, "model")


@lora_router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=errors(400))
async def load_lora_adapter(request: LoadLoRAAdapterRequest, raw_request: Request) -> Response:
    state = raw_request.app.state
    engine: AsyncLLM = state.engine
    name = request.lora_name
    if not name or not request.lora_path:
        raise OpenAIError("Both 'lora_name' and 'lora_path' must be provided.", 400, "lora_name")
    if name in state.stack.serving_chat.served_model_names:  # its served name, or a path requests may give it
        raise OpenAIError(f"The name {name!r} is the base model's.", 400, "lora_name")
    known = engine.loras.by_name(name)
    if known is not None and not request.load_inplace:
        raise OpenAIError(f"The lora adapter '{name}' has already been loaded.", 400, "lora_name")
    lora = LoRARequest(name, next(state.lora_ids), request.lora_path)
    try:
        await engine.add_lora(lora)
    except ValueError as e:
        raise OpenAIError(str(e), 400, "lora_path") from None
    if known is not None:  # load_inplace: the new one serves from now on, the old one's requests finish
        await engine.remove_lora(known.lora_int_id)
    logger.info("LoRA adapter %r loaded from %s", name, request.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@lora_router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=errors(400, 404))
async def unload_lora_adapter(request: UnloadLoRAAdapterRequest, raw_request: Request) -> Response:
    engine: AsyncLLM = raw_request.app.state.engine
    lora = engine.loras.by_name(request.lora_name)
    if lora is None or (request.lora_int_id is not None and request.lora_int_id != lora.lora_int_id):
        raise OpenAIError(f"The lora adapter '{request.lora_name}' cannot be found.", 404, "lora_name")
    await engine.remove_lora(lora.lora_int_id)
    logger.info("LoRA adapter %r unloaded", request.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")


async def _answer(call: Awaitable[Response]) -> Response:
    """The handler's response, or a 499 when the client went away first (its engine requests were aborted)."""
    try:
        return await call
    except ClientDisconnected:
        return Response(status_code=499)  # nobody is listening


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    responses={**streamable("The completion; with `stream: true`, its chunks."), **errors(400, 404, 503)},
)
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    serving = _stack(raw_request).serving_completion
    _check_generates(serving, request.model)
    return await _answer(serving.create_completion(request, raw_request))


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses={**streamable("The chat completion; with `stream: true`, its chunks."), **errors(400, 404, 503)},
)
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    serving = _stack(raw_request).serving_chat
    _check_generates(serving, request.model)
    return await _answer(serving.create_chat_completion(request, raw_request))


@router.post(
    "/v1/messages",
    response_model=MessagesResponse,
    responses={
        **streamable("The message; with `stream: true`, Anthropic's stream events.", anthropic=True),
        **errors(400, 404, 503, anthropic=True),
    },
)
async def create_message(request: MessagesRequest, raw_request: Request) -> Response:
    """Anthropic's Messages API (what Claude Code and Anthropic's SDKs speak), run as a chat completion."""
    serving = _stack(raw_request).serving_messages
    _check_generates(serving.chat, request.model)
    return await _answer(serving.create_message(request, raw_request))


@router.post(
    "/v1/messages/count_tokens", response_model=CountTokensResponse, responses=errors(400, 404, anthropic=True)
)
async def count_message_tokens(request: CountTokensRequest, raw_request: Request) -> Response:
    """The prompt tokens a Messages request would have (system, messages and tools through the chat template)."""
    return await _stack(raw_request).serving_messages.count_tokens(request)


@router.post(
    "/v1/responses",
    response_model=ResponsesResponse,
    responses={**streamable("The response; with `stream: true`, its `response.*` events."), **errors(400, 404, 503)},
)
async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
    """OpenAI's Responses API, run as a chat completion; kept for previous_response_id unless `store` is false."""
    serving = _stack(raw_request).serving_responses
    _check_generates(serving.chat, request.model)
    return await _answer(serving.create_response(request, raw_request))


@router.get("/v1/responses/{response_id}", response_model=ResponsesResponse, responses=errors(404))
async def retrieve_response(response_id: str, raw_request: Request) -> Response:
    """A stored response (one of the last ones created with `store` true)."""
    state = raw_request.app.state
    stacks = [state.stack] if state.manager is None else state.manager.stacks()
    for stack in stacks:  # the router's models keep their own (while loaded or sleeping)
        if response_id in stack.serving_responses.stored:
            return stack.serving_responses.retrieve(response_id)
    raise OpenAIError(f"Response with id '{response_id}' not found.", 404, "response_id")


def _check_generates(serving: OpenAIServing, model: str | None) -> None:
    """A pooling model generates no text: a 400 naming the runner before anything else (the engine would refuse the
    request too, but a stream would have begun by then), after the model name's 404."""
    serving.check_model(model)
    mc = serving.engine.model_config
    if getattr(mc, "runner", "generate") == "pooling":
        routes = {"embed": "/v1/embeddings", "classify": "/classify", "score": "/score, /rerank", "encode": "/pooling"}
        served = ", ".join(routes[t] for t in mc.pooling_tasks if t in routes)
        raise OpenAIError(
            f"model {mc.served_model_name!r} runs as a pooling model (--runner pooling): it does not generate text; "
            f"use {served} (the tasks it serves: {', '.join(mc.pooling_tasks)})",
            400,
        )


# ---- pooling models --------------------------------------------------------------------------------------

_POOLING_ERRORS = errors(400, 404, 503)


@router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_POOLING_ERRORS)
async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
    """OpenAI's embeddings (vLLM's extras: truncate_prompt_tokens, add_special_tokens, priority, normalize)."""
    return await _answer(_stack(raw_request).serving_embedding.create_embedding(request, raw_request))


@router.post("/pooling", response_model=PoolingResponse, responses=_POOLING_ERRORS)
async def create_pooling(request: PoolingRequest, raw_request: Request) -> Response:
    """The model's pooled states (task "encode"): one vector per input, or one per token with pooling type ALL."""
    return await _answer(_stack(raw_request).serving_embedding.create_pooling(request, raw_request))


@router.post("/classify", response_model=ClassificationResponse, responses=_POOLING_ERRORS)
async def create_classify(request: ClassificationRequest, raw_request: Request) -> Response:
    """Class probabilities of each input, with the model's label of the likeliest class."""
    return await _answer(_stack(raw_request).serving_embedding.create_classify(request, raw_request))


@router.post("/score", operation_id="score", response_model=ScoreResponse, responses=_POOLING_ERRORS)
@router.post("/v1/score", operation_id="score_v1", response_model=ScoreResponse, responses=_POOLING_ERRORS)
async def create_score(request: ScoreRequest, raw_request: Request) -> Response:
    """Scores of text pairs: a cross-encoder's, or the cosine similarity of an embedder's embeddings."""
    return await _answer(_stack(raw_request).serving_score.create_score(request, raw_request))


@router.post("/rerank", operation_id="rerank", response_model=RerankResponse, responses=_POOLING_ERRORS)
@router.post("/v1/rerank", operation_id="rerank_v1", response_model=RerankResponse, responses=_POOLING_ERRORS)
@router.post("/v2/rerank", operation_id="rerank_v2", response_model=RerankResponse, responses=_POOLING_ERRORS)
async def create_rerank(request: RerankRequest, raw_request: Request) -> Response:
    """Jina's and Cohere's rerank: the documents by relevance to the query, best first."""
    return await _answer(_stack(raw_request).serving_score.create_rerank(request, raw_request))


@router.post("/tokenize", response_model=TokenizeResponse, responses=errors(400, 404))
async def tokenize(request: TokenizeRequest, raw_request: Request) -> Response:
    serving = _stack(raw_request).serving_tokenization
    result = await serving.off_loop(serving.tokenize, request)
    return Response(result.model_dump_json(exclude_none=True), media_type="application/json")


@router.post("/detokenize", response_model=DetokenizeResponse, responses=errors(400, 404))
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> Response:
    result = _stack(raw_request).serving_tokenization.detokenize(request)
    return Response(result.model_dump_json(), media_type="application/json")


@single_router.post("/sleep", response_class=Response, responses={**empty_ok("The model sleeps."), **errors(400, 503)})
async def sleep(raw_request: Request, level: str = "1") -> Response:
    """Sleep mode (vLLM's route): level 1 frees the KV cache and sets the weights aside for a fast wake-up, level 2
    frees everything but the config. Requests in flight finish first; later ones get a 503 (or wake the model,
    with --sleep-auto-wake)."""
    engine = _engine(raw_request)
    try:
        value = check_sleep_level(int(level))
    except ValueError:
        return error_response(OpenAIError(f"level must be 1 or 2, got {level!r}", 400, "level"))
    if not _engine_alive(engine):
        return error_response(OpenAIError("The engine core process died.", 503))
    await engine.sleep(value)
    return Response(status_code=200)


@single_router.post("/wake_up", response_class=Response, responses={**empty_ok("The model is awake."), **errors(503)})
async def wake_up(raw_request: Request) -> Response:
    engine = _engine(raw_request)
    if not _engine_alive(engine):
        return error_response(OpenAIError("The engine core process died.", 503))
    await engine.wake_up()
    return Response(status_code=200)


@single_router.get("/is_sleeping", response_model=IsSleepingResponse)
async def is_sleeping(raw_request: Request) -> JSONResponse:
    return JSONResponse({"is_sleeping": await _engine(raw_request).is_sleeping()})


@debug_router.get("/debug/kv_cache", response_model=dict[str, Any], responses=errors(503))
async def debug_kv_cache(raw_request: Request) -> JSONResponse:
    """Block-pool counts from the engine cores (`check_invariants`, summed over data-parallel engines, each one's
    under "engines"), the cores' pids (`core_pid`: the first engine's) and the front end's view."""
    engine = _stack(raw_request).engine
    stats = dict(await engine.check_invariants())
    ready = getattr(engine.engine_core, "ready", None) or []
    stats["core_pids"] = [msg.pid for msg in ready]
    stats["core_pid"] = stats["core_pids"][0] if stats["core_pids"] else None
    stats["front_end_unfinished"] = engine.get_num_unfinished_requests()
    stats["server_load"] = raw_request.app.state.server_load.in_flight
    return JSONResponse(stats)


# ---- the app ---------------------------------------------------------------------------------------------


def _log_error_stack(request: Request, err: OpenAIError, exc: BaseException) -> None:
    """--log-error-stack: an error answered, with the traceback behind it (once: `error_for` may have logged it)."""
    if getattr(request.app.state.args, "log_error_stack", False) and not getattr(exc, "stack_logged", False):
        logger.error("%d on %s: %s", err.status, request.url.path, err.message, exc_info=exc)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        _log_error_stack(request, exc, exc)
        return _error_response(route_path(request.scope), exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = format_validation_errors(exc.errors())
        return _error_response(route_path(request.scope), OpenAIError(message, 400, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = _error_response(route_path(request.scope), OpenAIError(str(exc.detail), exc.status_code))
        for k, v in (exc.headers or {}).items():
            response.headers[k] = v
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        err = error_from_exception(exc)
        if err.status == 500:
            logger.error("unhandled error on %s", request.url.path, exc_info=exc)
        else:
            _log_error_stack(request, err, exc)
        return _error_response(route_path(request.scope), err)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    # From our routers, not app.openapi(): building the schema here delayed the first 200 on /health by 0.2-0.7 s
    # (it is built on the first GET /openapi.json instead); app.routes wraps included routers (FastAPI >= 0.16x).
    logger.info("Available routes are:")
    methods: dict[str, set[str]] = {}
    for route in (r for rt in app.state.routers for r in rt.routes if isinstance(r, APIRoute)):
        methods.setdefault(route.path, set()).update(route.methods)
    for path, ms in methods.items():
        logger.info("Route: %s, Methods: %s", path, ", ".join(sorted(ms)))
    try:
        await load_lora_modules(app)  # --lora-modules: a bad one stops the server before it listens
    except ValueError:
        app.state.exit_code = 1
        raise
    manager = app.state.manager
    if manager is not None:
        manager.start()
    watchdog = asyncio.create_task(_watchdog(app), name="engine-watchdog")
    try:
        yield
    finally:
        watchdog.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watchdog
        if manager is not None:  # the router's engines stop with the server
            await manager.shutdown()


async def load_lora_modules(app: FastAPI) -> None:
    """Load the one-model app's --lora-modules (ValueError naming a bad one, or one named like the base model)."""
    for lora in app.state.lora_modules:
        if app.state.stack is not None and lora.lora_name in app.state.stack.serving_chat.served_model_names:
            raise ValueError(f"--lora-modules: the name {lora.lora_name!r} is the base model's")
        await app.state.engine.add_lora(lora)
        logger.info("LoRA adapter %r served (from %s)", lora.lora_name, lora.lora_path)


async def _watchdog(app: FastAPI) -> None:
    """Announce readiness once uvicorn listens; if the engine core dies, make uvicorn exit with status 1 (not in
    router mode: there the router restarts a dead engine on its next request)."""
    state = app.state
    announced = False
    while True:
        server = getattr(state, "server", None)
        if not announced and server is not None and server.started:
            announced = True
            logger.info("pagedllm server ready at %s", getattr(state, "base_url", "?"))
        if state.manager is None and not _engine_alive(state.engine):
            logger.error("the engine core process died: the server exits in %.0f s", ENGINE_DEATH_GRACE_S)
            state.exit_code = 1
            await asyncio.sleep(ENGINE_DEATH_GRACE_S)
            if server is not None:
                server.should_exit = True
            return
        await asyncio.sleep(WATCHDOG_INTERVAL_S)


@dataclass
class ModelStack:
    """One model's engine and the serving objects of its routes (in router mode, one per model)."""

    engine: AsyncLLM
    serving_completion: OpenAIServingCompletion
    serving_chat: OpenAIServingChat
    serving_messages: AnthropicServingMessages
    serving_responses: OpenAIServingResponses
    serving_tokenization: OpenAIServingTokenization
    serving_embedding: OpenAIServingEmbedding
    serving_score: OpenAIServingScore


def request_names(engine: AsyncLLM, args: argparse.Namespace) -> list[str]:
    """The names a request's `model` may give the base model of a one-model server: its served names first (those
    /v1/models lists: listed_names); unless --served-model-name chose them, also the model as the command line gave
    it and its absolute path (`root` in /v1/models), which is what vLLM and llama.cpp's server call a model, so that
    a client written for either finds it."""
    names = listed_names(engine, args)
    if getattr(args, "served_model_name", None) is None:
        given = getattr(args, "model_tag", None) or getattr(args, "model", None)
        for alias in (given, engine.model_config.model):
            if isinstance(alias, str) and alias and alias not in names:
                names.append(alias)
    return names


def listed_names(engine: AsyncLLM, args: argparse.Namespace) -> list[str]:
    """The base model's names in /v1/models: its served name, then --served-model-name's further names."""
    names = [engine.model_config.served_model_name]
    for name in getattr(args, "served_model_name_rest", None) or []:
        if name not in names:
            names.append(name)
    return names


def build_stack(engine: AsyncLLM, args: argparse.Namespace, names: list[str] | None = None) -> ModelStack:
    """The serving objects of `engine`'s model, configured by the server flags `args`; `names` (default: the served
    name alone) are the names its requests may give it."""
    names = names or [engine.model_config.served_model_name]
    options = frontend_options(args)
    chat = OpenAIServingChat(engine, names, options)
    return ModelStack(
        engine=engine,
        serving_completion=OpenAIServingCompletion(engine, names, options),
        serving_chat=chat,
        serving_messages=AnthropicServingMessages(chat),
        serving_responses=OpenAIServingResponses(chat),
        serving_tokenization=OpenAIServingTokenization(engine, names, options),
        serving_embedding=OpenAIServingEmbedding(engine, names, options),
        serving_score=OpenAIServingScore(engine, names, options),
    )


def frontend_options(args: argparse.Namespace) -> FrontendOptions:
    """The request handlers' options from the server flags (a Namespace built in Python may lack some)."""

    def flag(name: str, default: Any = False) -> Any:
        return getattr(args, name, default)

    return FrontendOptions(
        trust_request_chat_template=bool(flag("trust_request_chat_template")),
        default_chat_template_kwargs=default_chat_template_kwargs(args),
        enable_auto_tool_choice=bool(flag("enable_auto_tool_choice")),
        tool_call_parser=flag("tool_call_parser", None),
        response_role=flag("response_role", "assistant"),
        force_include_usage=bool(flag("enable_force_include_usage")),
        prompt_tokens_details=bool(flag("enable_prompt_tokens_details")),
        return_tokens_as_token_ids=bool(flag("return_tokens_as_token_ids")),
        log_error_stack=bool(flag("log_error_stack")),
        chat_template_content_format=flag("chat_template_content_format", "auto"),
    )


def build_app(engine: AsyncLLM, args: argparse.Namespace) -> FastAPI:
    """The FastAPI app serving `engine`. `args` holds the server flags of `cli_args.add_server_args`."""
    routers = [router, single_router]
    if getattr(args, "enable_debug_routes", False):
        routers.append(debug_router)
    if runtime_lora_updating_allowed():
        routers.append(lora_router)
    app = make_app(args, routers)
    state = app.state
    state.engine = engine
    state.stack = build_stack(engine, args, request_names(engine, args))
    state.served_model_names = listed_names(engine, args)
    state.lora_modules = parse_lora_modules(getattr(args, "lora_modules", None))
    state.lora_ids = itertools.count(len(state.lora_modules) + 1)  # ids of adapters loaded at run time
    return app


def make_app(
    args: argparse.Namespace,
    routers: list[APIRouter],
    inner_middleware: Callable[[FastAPI], None] | None = None,
) -> FastAPI:
    """The app of either mode, without its model(s): `routers`, the error handlers and the middlewares (those that
    `inner_middleware` adds run after the others, just before the routes)."""
    docs: dict[str, Any] = {}
    if getattr(args, "disable_fastapi_docs", False):
        docs = {"openapi_url": None, "docs_url": None, "redoc_url": None}
    app = FastAPI(title="pagedllm", version=pagedllm.__version__, lifespan=_lifespan, **docs)
    state = app.state
    state.args = args
    state.routers = routers
    state.exit_code = 0
    state.manager = None  # router mode: the ModelManager
    state.stack = None
    state.lora_modules = []
    state.server_load = ServerLoad(limit=getattr(args, "max_queued_requests", None))
    for included in routers:
        app.include_router(included)
    _install_error_handlers(app)
    if inner_middleware is not None:
        inner_middleware(app)
    app.add_middleware(ServerLoadMiddleware, load=state.server_load)
    max_request_bytes = parse_size(getattr(args, "max_request_bytes", DEFAULT_MAX_REQUEST_BYTES))
    app.add_middleware(RequestSizeMiddleware, limit=max_request_bytes)
    api_key = getattr(args, "api_key", None)
    install_openapi(app, bool(api_key), state.server_load.limit is not None, GENERATION_PATHS)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    if getattr(args, "enable_request_id_headers", False):
        app.add_middleware(RequestIdHeaderMiddleware)
    origins = getattr(args, "allowed_origins", None)
    if origins:  # added last, so it runs first: a preflight is answered, and a 401 carries the CORS headers
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_credentials=bool(getattr(args, "allow_credentials", False)),
            allow_methods=getattr(args, "allowed_methods", ["*"]),
            allow_headers=getattr(args, "allowed_headers", ["*"]),
        )
    return app


# ---- running it ------------------------------------------------------------------------------------------


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # As uvicorn's, except that the signal is not raised again after the graceful shutdown: the process
        # then exits with run_server's status (0 after SIGINT/SIGTERM, 1 after the engine died).
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


def _listen(args: argparse.Namespace) -> tuple[socket.socket, str]:
    """The listening socket of the server flags, and where it listens: `host:port` (the port the OS chose for 0),
    or `unix:PATH` with --uds (vLLM's: host and port are then ignored; a socket file left by an earlier run is
    replaced, any other file is an error)."""
    path = getattr(args, "uds", None)
    if not path:
        sock = _bind(args.host, args.port)
        host, port = sock.getsockname()[:2]
        return sock, f"{f'[{host}]' if ':' in host else host}:{port}"
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise ValueError(f"--uds {path}: the file exists and is not a socket")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {path}: {e.strerror or e}") from None
    return sock, f"unix:{path}"


def _bind(host: str, port: int) -> socket.socket:
    """Bind the listening socket before the (slow) engine start: a taken port fails at once. Its protocol is named
    (IPPROTO_TCP), so that asyncio sets TCP_NODELAY on every connection it accepts (it does only for sockets whose
    `proto` says TCP): without it, a response written in two parts (headers, then body) waited for the client's
    delayed ACK, 40 ms, on every request of a kept-alive connection after its first few."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def log_requests(args: argparse.Namespace) -> bool:
    """--enable-log-requests, unless --disable-log-requests (vLLM's older flag, which wins) is given too."""
    return bool(getattr(args, "enable_log_requests", False)) and not getattr(args, "disable_log_requests", False)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_server(
    args: argparse.Namespace,
    engine_args: EngineArgs | None = None,
    core: CoreProcess | None = None,
    router_app: Callable[[argparse.Namespace, EngineArgs, float], FastAPI] | None = None,
) -> int:
    """Start the engine, serve until SIGINT/SIGTERM (0) or until the engine dies (1); returns the exit status.
    `core`: an engine-core process already started from `engine_args` (the CLI starts it before importing this
    module); it is stopped here if the server fails before the engine takes it over. `router_app` (router mode,
    --models or --models-dir: router/server.py's `build_router_app`): the app of the model router, built from the
    flags, the engine arguments every model shares and the stats interval; no engine starts here then, each
    model's starts on its first request."""
    engine = None
    manager = None
    sock = None
    previous = None
    try:
        if engine_args is None:
            engine_args = EngineArgs.from_cli_args(args)
        check_server_args(args, engine_args)
        if router_mode(args) and router_app is None:
            raise ValueError("--models and --models-dir need the router: run_server(..., router_app=build_router_app)")
        sock, where = _listen(args)
        # Outside uvicorn's own signal handling (the engine start, the shutdown), SIGTERM interrupts like Ctrl-C,
        # so that the engine-core child is terminated by its client rather than left behind.
        previous = signal.signal(signal.SIGTERM, _interrupt)
        from pagedllm.metrics import stats_log_interval

        stats_interval = stats_log_interval()  # a bad $PAGEDLLM_STATS_LOG_INTERVAL fails before the model loads
        if router_app is not None:
            app = router_app(args, engine_args, stats_interval)
            manager = app.state.manager
            logger.info("router: %d models on %s, each started on its first request", len(manager.entries), where)
        else:
            logger.info("starting the engine for the API server on %s", where)
            engine = start_engine(args, engine_args, core, stats_interval)
            core = None  # the engine owns it now
            app = build_app(engine, args)
        return _serve(app, args, sock, where)
    except KeyboardInterrupt:
        logger.info("interrupted")
        return 0
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        _stop(engine, manager, core, sock)
        if sock is not None and getattr(args, "uds", None):
            with contextlib.suppress(OSError):
                os.unlink(args.uds)  # the socket file goes with the server


def _stop(engine: AsyncLLM | None, manager: Any, core: CoreProcess | None, sock: socket.socket | None) -> None:
    """What run_server started and still runs."""
    if engine is not None:
        engine.shutdown()
        logger.info("pagedllm server stopped: engine shut down")
    if manager is not None:
        manager.close()  # what the app's shutdown did not stop (nothing, after a clean stop)
        logger.info("pagedllm server stopped: every model's engine shut down")
    if core is not None:
        core.close()
    if sock is not None:
        sock.close()


def check_server_args(args: argparse.Namespace, engine_args: EngineArgs) -> None:
    """ValueError naming a bad server flag, before any model loads."""
    if not getattr(args, "api_key", None):
        args.api_key = api_key_from_env()  # $PAGEDLLM_API_KEY, read in config.py
    if parse_size(args.max_request_bytes) < 1:  # a ValueError naming a malformed size, before the model loads
        raise ValueError(f"--max-request-bytes must be positive, got {args.max_request_bytes!r}")
    if args.max_queued_requests is not None and args.max_queued_requests < 1:
        raise ValueError(f"--max-queued-requests must be at least 1, got {args.max_queued_requests}")
    if args.tool_call_parser is not None:
        from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager

        ToolParserManager.get(args.tool_call_parser)  # a ValueError naming the choices
    if getattr(args, "lora_modules", None):
        if not engine_args.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        parse_lora_modules(args.lora_modules)  # a ValueError naming a malformed entry, before the model loads
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (e.g. hermes)")
    if getattr(args, "ssl_keyfile", None) and not getattr(args, "ssl_certfile", None):
        raise ValueError("--ssl-keyfile needs --ssl-certfile (the certificate that goes with the key)")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be at least 0, got {args.max_log_len}")
    default_chat_template_kwargs(args)  # a ValueError naming a malformed --default-chat-template-kwargs


def default_chat_template_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """--default-chat-template-kwargs as a dict (JSON object text on the command line; a dict when built in
    Python), its keys checked as a request's chat_template_kwargs are."""
    value = json_object(getattr(args, "default_chat_template_kwargs", None), "--default-chat-template-kwargs")
    try:
        return check_chat_template_kwargs(value)
    except ValueError as e:
        raise ValueError(f"--default-chat-template-kwargs: {e}") from None


def start_engine(
    args: argparse.Namespace, engine_args: EngineArgs, core: CoreProcess | None, stats_interval: float
) -> AsyncLLM:
    """The one model's engine with its stat loggers (`core`: its process, if started already)."""
    from pagedllm.metrics import LoggingStatLogger, PrometheusStatLogger

    engine_start = time.perf_counter()
    engine = AsyncLLM(
        engine_args,
        core=core,
        log_requests=log_requests(args),
        max_log_len=args.max_log_len,
        sleep_auto_wake=args.sleep_auto_wake,
    )
    logger.info("startup: engine %.2f s (model config, tokenizer, engine core)", time.perf_counter() - engine_start)
    mc = engine.model_config
    engine.stat_loggers += [
        PrometheusStatLogger(
            mc.served_model_name,
            mc.max_model_len,
            num_engines=engine.num_engines,
            max_lora=engine_args.max_loras if engine_args.enable_lora else 0,
        ),
    ]
    if not engine_args.disable_log_stats:
        engine.stat_loggers.append(LoggingStatLogger(stats_interval, num_engines=engine.num_engines))
    return engine


def _serve(app: FastAPI, args: argparse.Namespace, sock: socket.socket, where: str) -> int:
    """Serve `app` on `sock` (listening at `where`) with uvicorn until it stops; the exit status."""
    scheme = "https" if getattr(args, "ssl_certfile", None) else "http"
    app.state.base_url = f"{where} ({scheme})" if where.startswith("unix:") else f"{scheme}://{where}"
    config = uvicorn.Config(
        app,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_graceful_shutdown=args.timeout_graceful_shutdown,
        timeout_keep_alive=5,
        root_path=getattr(args, "root_path", None) or "",
        ssl_keyfile=getattr(args, "ssl_keyfile", None),
        ssl_certfile=getattr(args, "ssl_certfile", None),
        ssl_ca_certs=getattr(args, "ssl_ca_certs", None),
        ssl_cert_reqs=getattr(args, "ssl_cert_reqs", 0),
    )
    server = _Server(config)
    app.state.server = server
    asyncio.run(server.serve(sockets=[sock]))
    return int(app.state.exit_code)


__all__ = ["ModelStack", "build_app", "build_stack", "make_app", "run_server"]
