"""The HTTP side of the router: `pagedllm serve --models-dir DIR` (or `--models A B ...`).

Contract:
* The app has every route of the one-model server (api_server.py `router`), and these instead of its /health,
  /ping and /v1/models: GET /health and GET|POST /ping answer 200 while the server runs (whatever its models'
  states), with a JSON body naming each model's state (and its engine-core pids, requests in flight, error);
  GET /v1/models lists every model with its `status` (unloaded, loading, loaded, sleeping, failed; and `error`
  when failed); POST /models/load and POST /models/unload `{"model": NAME}` load (or wake, or retry a failed) and
  unload a model, answering once done. With --enable-debug-routes, GET /debug/kv_cache?model=NAME (a loaded model).
* A request on a model route (ROUTED_PATHS) is routed by its body's `model`, before the route runs
  (`ModelRoutingMiddleware`): an unknown name is a 404 naming the models, no `model` a 400; a model that is not
  loaded is loaded first (the request waits, see manager.py); one that failed to load, or does not come up within
  --models-wait-timeout, is a 503 naming the model and why. The request counts as in flight on its model (which
  is then never evicted) until its response, streamed or not, has ended.
* Metrics: each model's series carry its `model_name` (one PrometheusMetrics shared by every model's logger).
* A dead engine does not stop the server (no watchdog exit, unlike one model): see manager.py.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from typing import Any

import msgspec
import zmq.asyncio
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.config import num_threads_default
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.core_process import CoreProcess, SpareCore
from pagedllm.entrypoints.anthropic.protocol import is_anthropic_path
from pagedllm.entrypoints.openai.api_server import (
    ROUTED_STACK,
    ModelStack,
    build_stack,
    debug_kv_cache,
    log_requests,
    make_app,
    model_card_response,
    route_path,
    router,
    send_error,
)
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.openapi_spec import errors
from pagedllm.entrypoints.openai.protocol import ModelCard, ModelList, OpenAIBaseModel
from pagedllm.entrypoints.router.entry import ModelUnavailable, UnknownModel
from pagedllm.entrypoints.router.manager import ModelManager
from pagedllm.entrypoints.router.models import ModelSpec, discover, model_engine_args
from pagedllm.metrics import LoggingStatLogger, PrometheusMetrics, PrometheusStatLogger

# The routes whose request body names the model that serves it.
ROUTED_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
        "/v1/embeddings",
        "/pooling",
        "/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/tokenize",
        "/detokenize",
    }
)
# Routes that use only the model's front end (its tokenizer): they load the model but take no compute turn.
FRONT_END_PATHS = frozenset({"/tokenize", "/detokenize", "/v1/messages/count_tokens"})
# The token-count histograms' buckets without --max-model-len (the models' own limits are known only once loaded).
DEFAULT_BUCKET_LEN = 131072

routed_router = APIRouter()  # router mode: /health, /ping, /v1/models, /models/load, /models/unload
routed_debug_router = APIRouter()


# ---- routing a request to its model ------------------------------------------------------------------------


class _ModelField(msgspec.Struct):
    model: Any = None


_UNREADABLE = object()


def requested_model(body: bytes) -> Any:
    """The `model` of a JSON request body (None when absent); _UNREADABLE when the body is no JSON object or its
    model no string (the route's validation then answers the 400)."""
    try:
        model = msgspec.json.decode(body, type=_ModelField).model
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _UNREADABLE
    return model if model is None or isinstance(model, str) else _UNREADABLE


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body (None when the client left first)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has gone away (the body was read before)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class ModelRoutingMiddleware:
    """Routes the requests of ROUTED_PATHS to their model's stack (see the module docstring)."""

    def __init__(self, app: ASGIApp, manager: ModelManager) -> None:
        self.app = app
        self.manager = manager

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or route_path(scope) not in ROUTED_PATHS:
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        if body is None:
            return
        replay = _replayer(body, receive)
        name = requested_model(body)
        if name is _UNREADABLE:
            await self.app(scope, replay, send)
            return
        if name is None:
            names = ", ".join(self.manager.entries)
            await send_error(scope, send, 400, f"`model` is required: one of {names}.", param="model")
            return
        compute = route_path(scope) not in FRONT_END_PATHS
        try:
            stack = self.manager.try_acquire(name, compute) or await self._wait_for(name, receive, compute)
        except UnknownModel as e:
            await send_error(scope, send, 404, str(e), param="model")
            return
        except ModelUnavailable as e:
            await send_error(scope, send, 503, str(e), param="model")
            return
        if stack is None:  # the client left while its model loaded
            return
        scope[ROUTED_STACK] = stack
        try:
            await self.app(scope, replay, send)
        finally:
            self.manager.release(name)

    async def _wait_for(self, name: str, receive: Receive, compute: bool) -> ModelStack | None:
        """The model's stack once loaded (counted in flight), or None if the client leaves first."""
        acquire = asyncio.ensure_future(self.manager.acquire(name, compute))
        left = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({acquire, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (acquire, left):
                if not task.done():
                    task.cancel()
        return acquire.result() if acquire.done() and not acquire.cancelled() else None


def _replayer(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the body read already, then what `receive` gives."""
    pending: bytes | None = body

    async def replay() -> Message:
        nonlocal pending
        if pending is None:
            return await receive()
        message: Message = {"type": "http.request", "body": pending, "more_body": False}
        pending = None
        return message

    return replay


# ---- routes ---------------------------------------------------------------------------------------------


def _manager(request: Request) -> ModelManager:
    return request.app.state.manager


def _health_body(manager: ModelManager) -> dict[str, Any]:
    return {"status": "ok", "models": {name: manager.describe(e) for name, e in manager.entries.items()}}


_HEALTH = {200: {"description": "The server runs; each model's state (`models`)."}}


@routed_router.get("/health", response_model=dict[str, Any], responses=_HEALTH)
async def health(raw_request: Request) -> JSONResponse:
    return JSONResponse(_health_body(_manager(raw_request)))


@routed_router.get("/ping", operation_id="ping_get", response_model=dict[str, Any], responses=_HEALTH)
@routed_router.post("/ping", operation_id="ping_post", response_model=dict[str, Any], responses=_HEALTH)
async def ping(raw_request: Request) -> JSONResponse:
    return JSONResponse(_health_body(_manager(raw_request)))


def _model_cards(manager: ModelManager) -> list[ModelCard]:
    cards = []
    for entry in manager.entries.values():
        extra = {"status": entry.state.value}
        if entry.error is not None and entry.state.value == "failed":
            extra["error"] = entry.error
        cards.append(ModelCard(id=entry.name, root=entry.spec.path, max_model_len=entry.max_model_len, **extra))
    return cards


@routed_router.get("/v1/models", response_model=ModelList)
async def show_models(raw_request: Request) -> Response:
    """Every model, with its `status` (unloaded, loading, loaded, sleeping, failed) and, when failed, `error`."""
    cards = _model_cards(_manager(raw_request))
    return Response(ModelList(data=cards).model_dump_json(), media_type="application/json")


@routed_router.get("/v1/models/{model:path}", response_model=ModelCard, responses=errors(404))
async def retrieve_model(model: str, raw_request: Request) -> Response:
    """One model's card, with its status, as /v1/models lists it."""
    return model_card_response(_model_cards(_manager(raw_request)), model)


class ModelRequest(OpenAIBaseModel):
    model: str


class ModelStatus(OpenAIBaseModel):
    success: bool = True
    model: str
    status: str


@routed_router.post("/models/load", response_model=ModelStatus, responses=errors(400, 404, 503))
async def load_model(request: ModelRequest, raw_request: Request) -> JSONResponse:
    """Load the model (wake it; try a failed one again) and answer once it is loaded."""
    entry = await _operate(_manager(raw_request).load, request.model)
    return JSONResponse(ModelStatus(model=entry.name, status=entry.state.value).model_dump())


@routed_router.post("/models/unload", response_model=ModelStatus, responses=errors(400, 404, 503))
async def unload_model(request: ModelRequest, raw_request: Request) -> JSONResponse:
    """Stop the model's engine once its requests in flight have ended (a failed model: forget its error)."""
    entry = await _operate(_manager(raw_request).unload, request.model)
    return JSONResponse(ModelStatus(model=entry.name, status=entry.state.value).model_dump())


async def _operate(operation: Callable[[str], Any], name: str) -> Any:
    try:
        return await operation(name)
    except UnknownModel as e:
        raise OpenAIError(str(e), 404, "model") from None
    except ModelUnavailable as e:
        raise OpenAIError(str(e), 503, "model") from None


@routed_debug_router.get("/debug/kv_cache", response_model=dict[str, Any], responses=errors(404, 503))
async def routed_debug_kv_cache(model: str, raw_request: Request) -> JSONResponse:
    """The one-model route's answer for the loaded model `model` (it is not loaded for this)."""
    manager = _manager(raw_request)
    try:
        entry = manager.entry(model)
    except UnknownModel as e:
        raise OpenAIError(str(e), 404, "model") from None
    if not entry.ready:
        raise OpenAIError(f"The model `{model}` is not loaded (it is {entry.state.value}).", 503, "model")
    raw_request.scope[ROUTED_STACK] = entry.stack
    return await debug_kv_cache(raw_request)


# ---- the app ------------------------------------------------------------------------------------------------


def check_router_args(args: argparse.Namespace, base: EngineArgs) -> list[ModelSpec]:
    """The router's models (ValueError naming a flag that does not apply to many models, or a bad model path)."""
    if base.model is not None:
        raise ValueError("MODEL (or --model) and --models/--models-dir are exclusive: one model, or the router's")
    for flag, value in (("--served-model-name", base.served_model_name), ("--tokenizer", base.tokenizer)):
        if value is not None:
            raise ValueError(f"{flag} applies to one model; the router's models are named by their files or folders")
    if getattr(args, "lora_modules", None):
        raise ValueError("--lora-modules applies to one model, not to the router's (--models, --models-dir)")
    return discover(args.models_dir, args.models or ())


class StackBuilder:
    """Starts one model's engine and builds its stack (blocking; the manager runs it in a worker thread, one at a
    time). It keeps a spare engine-core process with its imports made (core_process.py `SpareCore`): a cold load
    hands it the model, saving the ~1.4 s of imports, and a new spare starts once that load is done. `close()` stops
    the spare."""

    def __init__(
        self, args: argparse.Namespace, base: EngineArgs, stats_interval: float, metrics: PrometheusMetrics
    ) -> None:
        self.args, self.base, self.stats_interval, self.metrics = args, base, stats_interval, metrics
        self.spare: SpareCore | None = None
        self.closed = False

    def prepare(self) -> None:
        """Start the spare engine-core process (the server calls it once it runs)."""
        if self.spare is None and not self.closed:
            self.spare = SpareCore()

    def __call__(self, spec: ModelSpec) -> ModelStack:
        args, base = self.args, self.base
        engine_args = model_engine_args(base, spec).for_engine_core()
        spare, self.spare = self.spare, None
        try:
            core = CoreProcess(engine_args, zmq.asyncio.Context(), spare=spare)
            engine = AsyncLLM(engine_args, core=core, log_requests=log_requests(args), max_log_len=args.max_log_len)
        finally:
            if spare is not None:
                spare.close()  # unused (it had died): nothing to stop; used: its CoreProcess owns it
            self.prepare()  # the next load's spare
        try:
            mc = engine.model_config
            max_lora = base.max_loras if base.enable_lora else 0
            engine.stat_loggers.append(
                PrometheusStatLogger(spec.name, mc.max_model_len, num_engines=engine.num_engines, max_lora=max_lora,
                                     metrics=self.metrics)
            )  # fmt: skip
            if not base.disable_log_stats:
                stats = LoggingStatLogger(self.stats_interval, num_engines=engine.num_engines, model_name=spec.name)
                engine.stat_loggers.append(stats)
            return build_stack(engine, args)
        except BaseException:
            engine.shutdown()
            raise

    def close(self) -> None:
        self.closed = True
        spare, self.spare = self.spare, None
        if spare is not None:
            spare.close()


def build_router_app(args: argparse.Namespace, base: EngineArgs, stats_interval: float) -> FastAPI:
    """The router's app (its ModelManager in `app.state.manager`); no engine starts here."""
    specs = check_router_args(args, base)
    metrics = PrometheusMetrics(base.max_model_len or DEFAULT_BUCKET_LEN)
    manager = ModelManager(
        specs,
        StackBuilder(args, base, stats_interval, metrics),
        max_loaded=args.models_max,
        evict=args.models_evict,
        sleep_idle_s=args.sleep_idle_seconds,
        wait_timeout=args.models_wait_timeout,
        max_running=getattr(args, "models_max_running", 1),
        total_threads=base.num_threads or num_threads_default(),
    )
    routers = [router, routed_router]
    if getattr(args, "enable_debug_routes", False):
        routers.append(routed_debug_router)
    app = make_app(args, routers, lambda app: app.add_middleware(ModelRoutingMiddleware, manager=manager))
    app.state.manager = manager
    _declare_routed_errors(app)
    return app


def _declare_routed_errors(app: FastAPI) -> None:
    """In /openapi.json, the 404 and 503 that the routing adds to every model route."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        spec = build()
        paths = spec.get("paths", {})
        for path in ROUTED_PATHS:
            operation = paths.get(path, {}).get("post")
            if operation is None:
                continue
            # Those entries as the generation routes declare them (with the error body of the path's API).
            model = paths["/v1/messages" if is_anthropic_path(path) else "/v1/completions"]["post"]["responses"]
            for status in ("404", "503"):
                operation["responses"].setdefault(status, model[status])
        return spec

    app.openapi = openapi  # type: ignore[method-assign]


__all__ = ["ROUTED_PATHS", "ModelRoutingMiddleware", "build_router_app", "check_router_args", "requested_model"]
