"""What the completion and chat handlers share: request -> SamplingParams, the context-length rule, model-name
checks, merging several generations into one stream, SSE framing, and aborting on client disconnect.

Contract:
* Everything that can reject a request runs before the first byte of the response (and before anything is
  sent to the engine): model name, SamplingParams, tokenization, context length, `InputProcessor.validate`.
  So a bad request is a 400 JSON error even when it asked to stream, and never reaches the engine core.
* The context rule is vLLM's: prompt + max_tokens must fit in max_model_len (400 otherwise, with vLLM's
  message); a request without max_tokens gets max_model_len - prompt_len, at most the generation config's
  max_new_tokens.
* Sampling values a request leaves unset (temperature, top_p, top_k, min_p, repetition_penalty) come from the
  model's generation config (--generation-config, `ModelConfig.sampling_defaults`), else SamplingParams' defaults.
* A client that goes away aborts its generations: streams through `SSEResponse` (which closes the body
  generator whatever happened), non-streaming requests through `run_until_disconnected`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
import math
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.input_processor import check_chat_template_kwargs
from pagedllm.entrypoints.openai.errors import OpenAIError, error_body, error_from_exception
from pagedllm.entrypoints.openai.protocol import (
    OpenAIBaseModel,
    PromptLogprob,
    PromptLogprobs,
    PromptTokenUsageInfo,
    SamplingFields,
    UsageInfo,
)
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams
from pagedllm.structured_output import GRAMMAR_REFUSED, validate_structured_outputs

logger = logging.getLogger(__name__)

T = TypeVar("T")

# logprobs can be -inf (a token masked by top-k/top-p or a -100 logit bias); JSON has no infinities.
MIN_LOGPROB = -9999.0
MAX_LOGIT_BIAS = 100.0


def clamp_logprob(value: float | None) -> float | None:
    if value is None:
        return None
    if math.isnan(value):
        return MIN_LOGPROB
    return max(float(value), MIN_LOGPROB)


# The thread that renders and tokenizes prompts off the event loop (`OpenAIServing.off_loop`).
_TOKENIZER_THREAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedllm-tokenizer")


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready."""


@dataclass(frozen=True)
class FrontendOptions:
    """The server flags (entrypoints/openai/cli_args.py) the request handlers follow; the defaults are the flags'."""

    trust_request_chat_template: bool = False
    # --default-chat-template-kwargs: template variables a request's chat_template_kwargs may override
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    response_role: str = "assistant"
    force_include_usage: bool = False  # a usage chunk ends every stream, asked for or not
    prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N"
    log_error_stack: bool = False  # an error response's traceback in the log
    chat_template_content_format: str = "auto"  # a message's content as a string or a list of text parts


class OpenAIServing:
    """Base of the completion and chat handlers: one engine, one served model."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str], options: FrontendOptions | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = int(engine.model_config.max_model_len)
        self.served_model_names = served_model_names
        self.options = options or FrontendOptions()
        # --generation-config: the values a request that leaves them unset takes (ModelConfig.sampling_defaults).
        self.default_sampling_params: dict[str, Any] = dict(getattr(engine.model_config, "sampling_defaults", {}))

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` (rendering, tokenization: CPU work that grows with the input) in the front end's
        worker thread, so that the event loop keeps serving other requests, /health and streams meanwhile. One
        thread: requests are tokenized one at a time, in order, as on the loop, and the tokenizer is never used by
        two threads at once."""
        return await asyncio.get_running_loop().run_in_executor(_TOKENIZER_THREAD, functools.partial(fn, *args))

    # ---- checks -------------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        """404 unless `model` is a served name of the base model or a loaded LoRA adapter's."""
        if model is not None and model not in self.served_model_names and self.engine.loras.by_name(model) is None:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, "model")

    def response_model(self, model: str | None) -> str:
        """The `model` a response names: the request's (a served name or an adapter's), else the base model's."""
        return model or self.model_name

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model)."""
        if model is None or model in self.served_model_names:
            return None
        return self.engine.loras.by_name(model)

    def check_engine(self) -> None:
        if self.engine.dead or self.engine.errored is not None:
            raise OpenAIError("The engine is not available: the engine core process died.", 503)

    def check_chat_template(self, chat_template: str | None) -> None:
        # A template is code (sandboxed Jinja, but it can still loop for long): only the operator may allow it.
        if chat_template is not None and not self.options.trust_request_chat_template:
            raise OpenAIError(
                "chat_template in a request is not allowed; start the server with --trust-request-chat-template",
                400,
                "chat_template",
            )

    def template_kwargs(self, request_kwargs: dict[str, Any] | None, **fields: Any) -> dict[str, Any]:
        """The chat template's extra variables for a request: --default-chat-template-kwargs, then the request
        fields in `fields` that are set (e.g. reasoning_effort), then its chat_template_kwargs (vLLM's order); a
        malformed or reserved key is a 400 naming chat_template_kwargs."""
        try:
            given = check_chat_template_kwargs(request_kwargs)
        except ValueError as e:
            raise OpenAIError(str(e), 400, "chat_template_kwargs") from None
        set_fields = {k: v for k, v in fields.items() if v is not None}
        return {**self.options.default_chat_template_kwargs, **set_fields, **given}

    def warn_ignored_fields(self, request: OpenAIBaseModel) -> None:
        if request.model_extra:
            logger.warning("ignoring unsupported request fields: %s", sorted(request.model_extra))

    def context_error(self, prompt_len: int, max_tokens: int | None, what: str) -> OpenAIError | None:
        """vLLM's context-length rule; `what` names the prompt ("messages" or "prompt")."""
        if max_tokens is None:
            if prompt_len >= self.max_model_len:
                return OpenAIError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                    f"{prompt_len} tokens in the {what}, which leaves no room for the completion. Please reduce "
                    f"the length of the {what}.",
                    400,
                    what,
                )
            return None
        if prompt_len + max_tokens > self.max_model_len:
            return OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the {what}, {max_tokens} in the completion). "
                f"Please reduce the length of the {what} or completion.",
                400,
                "max_tokens" if prompt_len < self.max_model_len else what,
            )
        return None

    def truncated(self, text: str | None, ids: list[int], request: SamplingFields) -> tuple[str | None, list[int]]:
        """The prompt as the request's truncate_prompt_tokens keeps it (InputProcessor.truncate_prompt), before the
        context is checked."""
        if request.truncate_prompt_tokens is None:
            return text, ids
        return self.engine.input_processor.truncate_prompt(text, ids, request.truncate_prompt_tokens)

    def resolve_max_tokens(self, requested: int | None, prompt_len: int, what: str) -> int:
        """The request's max_tokens, checked against the context; unset (None): what is left of the context, at
        most the generation config's max_new_tokens (as vLLM)."""
        if requested is not None and requested < 1:
            raise OpenAIError(f"max_tokens must be at least 1, got {requested}", 400, "max_tokens")
        err = self.context_error(prompt_len, requested, what)
        if err is not None:
            raise err
        if requested is not None:
            return requested
        rest = self.max_model_len - prompt_len
        return min(rest, self.default_sampling_params.get("max_tokens", rest))

    # ---- request -> SamplingParams ------------------------------------------------------------------------

    async def beam_generate(
        self,
        prompt_text: str | None,
        ids: list[int],
        params: SamplingParams,
        request: SamplingFields,
        request_id: str,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """vLLM's `use_beam_search`: a beam search of width `n` over `params.max_tokens` tokens at `params`'
        temperature; yields one finished RequestOutput whose outputs are the beams, best first (their text and token
        ids the generated ones). Each step's one-token requests run together; leaving early aborts them."""
        from pagedllm.beam_search import BeamSearch

        beam = BeamSearchParams(
            beam_width=request.n,
            max_tokens=params.max_tokens or 1,
            ignore_eos=request.ignore_eos,
            temperature=params.temperature,
            length_penalty=request.length_penalty,
            include_stop_str_in_output=request.include_stop_str_in_output,
        )
        mc = self.engine.model_config
        search = BeamSearch(
            [ids], beam, self.engine.input_processor.eos_token_ids, self.max_model_len, mc.max_logprobs, lora_request
        )
        step_params = search.step_params()
        step = 0
        while batch := search.pending():
            gens = [
                self.engine.generate(
                    {"prompt_token_ids": tokens, "cache_salt": getattr(request, "cache_salt", None)},
                    step_params,
                    f"{request_id}-beam{step}-{j}",
                    priority=request.priority,
                    lora_request=lora_request,
                )
                for j, tokens in enumerate(batch)
            ]
            finals = await collect_finals(gens)
            search.advance([out.outputs[0].logprobs[0] for out in finals])
            step += 1
        best = search.results(self.tokenizer.decode, [len(ids)])[0].sequences
        outputs = [
            CompletionOutput(
                index=k,
                text=b.text or "",
                token_ids=b.tokens[len(ids) :],
                cumulative_logprob=b.cum_logprob,
                logprobs=b.logprobs,
                finish_reason=b.finish_reason,
                stop_reason=b.stop_reason,
            )
            for k, b in enumerate(best)
        ]
        yield RequestOutput(request_id, prompt_text, ids, None, outputs, True)

    @staticmethod
    def prompt_logprobs_of(request: SamplingFields, out: RequestOutput) -> PromptLogprobs | None:
        """vLLM's `prompt_logprobs` of a response, when the request asked for them."""
        if request.prompt_logprobs is None:
            return None
        top = request.prompt_logprobs  # the engine may have computed more, for echo's logprobs
        steps: PromptLogprobs = []
        for pos, step in enumerate(out.prompt_logprobs or []):
            if step is None:
                steps.append(None)
                continue
            own = out.prompt_token_ids[pos]
            steps.append(
                {
                    str(tid): PromptLogprob(
                        logprob=clamp_logprob(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token
                    )
                    for tid, lp in step.items()
                    if tid == own or (lp.rank is not None and lp.rank <= top)
                }
            )
        return steps

    def sampling_params(
        self,
        request: SamplingFields,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Raises ValueError naming the bad field (turned into a 400 by the caller)."""
        bias = None
        if request.logit_bias:
            try:
                bias = {
                    int(k): max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(v))) for k, v in request.logit_bias.items()
                }
            except ValueError:
                raise ValueError(
                    f"logit_bias keys must be token ids (integers as strings), got {list(request.logit_bias)!r:.100}"
                ) from None
        if request.use_beam_search:
            max_logprobs = self.engine.input_processor.max_logprobs
            if 2 * request.n > max_logprobs:
                raise ValueError(
                    f"use_beam_search: a width n of {request.n} needs the top {2 * request.n} log-probabilities of "
                    f"each step, above --max-logprobs {max_logprobs}"
                )
            if request.prompt_logprobs is not None:
                raise ValueError("prompt_logprobs is not available with use_beam_search")
            if structured_outputs_of(request) is not None:
                raise ValueError("use_beam_search cannot follow a structured output constraint (response_format, ...)")
            if request.allowed_token_ids is not None or request.bad_words:
                raise ValueError("use_beam_search ranks the raw log-probabilities: allowed_token_ids and bad_words "
                                 "do not apply to it")  # fmt: skip
        if request.prompt_logprobs is not None:
            if request.stream:
                raise ValueError("prompt_logprobs is not available when stream is true")
            prompt_logprobs = max(request.prompt_logprobs, prompt_logprobs or 0)
        defaults = self.default_sampling_params  # --generation-config's, for what the request leaves unset
        top_k = _or(request.top_k, defaults.get("top_k", -1))
        if top_k == 0:
            top_k = -1  # vLLM: 0 also means "no top-k"
        return SamplingParams(
            n=request.n,
            presence_penalty=_or(request.presence_penalty, 0.0),
            frequency_penalty=_or(request.frequency_penalty, 0.0),
            repetition_penalty=_or(request.repetition_penalty, defaults.get("repetition_penalty", 1.0)),
            temperature=_or(request.temperature, defaults.get("temperature", 1.0)),
            top_p=_or(request.top_p, defaults.get("top_p", 1.0)),
            top_k=top_k,
            min_p=_or(request.min_p, defaults.get("min_p", 0.0)),
            seed=request.seed,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            logit_bias=bias,
            truncate_prompt_tokens=request.truncate_prompt_tokens,
            allowed_token_ids=request.allowed_token_ids,
            bad_words=request.bad_words or None,
            structured_outputs=structured_outputs_of(request),
            output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
            stream_interval=request.stream_interval,
            extra_args=request.vllm_xargs,
        )

    def validate_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The engine's own input checks, run before anything is sent (a multi-prompt request is all or none)."""
        self.engine.input_processor.validate(prompt_ids, params)

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
        """A response's usage; with --enable-prompt-tokens-details, the prompt tokens the prefix cache held."""
        details = PromptTokenUsageInfo(cached_tokens=cached_tokens) if self.options.prompt_tokens_details else None
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=details,
        )

    def include_usage(self, request: SamplingFields) -> bool:
        """Whether a stream ends with a usage chunk: stream_options.include_usage, or --enable-force-include-usage."""
        opts = request.stream_options
        return bool(opts and opts.include_usage) or self.options.force_include_usage

    def tokens_as_ids(self, request: SamplingFields) -> bool:
        """Whether logprobs name tokens "token_id:N": the request's return_tokens_as_token_ids, else the flag's."""
        given = request.return_tokens_as_token_ids
        return self.options.return_tokens_as_token_ids if given is None else given

    def token_str(self, token_id: int, lp: Logprob | None = None, as_id: bool = False) -> str:
        """A token as logprobs name it: its text, or "token_id:N" (`as_id`: text that JSON may not carry whole)."""
        if as_id:
            return f"token_id:{token_id}"
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id])

    def error_for(self, exc: BaseException, request: SamplingFields) -> OpenAIError:
        err = error_from_exception(exc, type(request).model_fields)
        if err.status >= 500 and err.status != 503:
            logger.error("request failed", exc_info=exc)
        elif self.options.log_error_stack:  # --log-error-stack: every error answered, with its traceback
            logger.error("%d: %s", err.status, err.message, exc_info=exc)
            err.stack_logged = True  # the server's error handler need not log it again
        return err


async def collect_finals(gens: Sequence[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """The last output of each generator, in their order (raise_if_failed on every output)."""
    finals: list[RequestOutput | None] = [None] * len(gens)
    async for i, out in merge_async_iterators(*gens):
        raise_if_failed(out)
        finals[i] = out
    assert all(f is not None for f in finals)
    return finals  # type: ignore[return-value]


def raise_if_failed(out: RequestOutput) -> None:
    """A request the engine could not serve (finish reason "error") fails with the engine's reason (an error event
    once a stream has started): a 400 when its grammar did not compile there, or not in time (the issue's rule:
    the request's constraint is at fault), a 500 when a compiled grammar refused a sampled token (a fault here)."""
    for c in out.outputs:
        if c.finish_reason == "error":
            reason = str(c.stop_reason or "the request failed in the engine")
            raise OpenAIError(reason, 500 if reason.startswith(GRAMMAR_REFUSED) else 400)


# Backends a request may name in `guided_decoding_backend` (vLLM's names): pagedllm runs llguidance.
GUIDED_BACKENDS = ("auto", "guidance", "llguidance")


def structured_outputs_of(request: SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint, from whichever of its fields gives one: `response_format` (OpenAI:
    json_schema, json_object; text is none), `structured_outputs` (vLLM) or `guided_json` / `guided_regex` /
    `guided_choice` / `guided_grammar` (vLLM's older names). Two at once, an unknown response_format type or
    structured_outputs key, or a backend other than llguidance is a ValueError naming the field (a 400)."""
    found: list[tuple[str, dict[str, Any]]] = []
    fmt = request.response_format
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict | bool):
                raise ValueError("response_format.json_schema must be an object with a `schema` object")
            # No schema given: any JSON object (OpenAI requires one; vLLM accepts its absence the same way).
            schema = spec.get("schema")
            found.append(("response_format", {"json": schema} if schema is not None else {"json_object": True}))
        elif kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind != "text":
            raise ValueError(f"response_format type must be text, json_object or json_schema, got {kind!r}")
    if request.structured_outputs is not None:
        found.append(("structured_outputs", dict(request.structured_outputs)))
    guided = {
        "json": request.guided_json,
        "regex": request.guided_regex,
        "choice": request.guided_choice,
        "grammar": request.guided_grammar,
    }
    for key, value in guided.items():
        if value is not None:
            found.append((f"guided_{key}", {key: value}))
    backend = request.guided_decoding_backend
    if backend is not None and backend not in GUIDED_BACKENDS:
        raise ValueError(
            f"guided_decoding_backend must be one of {', '.join(GUIDED_BACKENDS)} (pagedllm runs llguidance), "
            f"got {backend!r}"
        )
    if not found:
        if request.guided_whitespace_pattern is not None:
            raise ValueError("guided_whitespace_pattern needs a JSON constraint (guided_json or response_format)")
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise ValueError(f"{found[0][0]}: give one output constraint, got {names}")
    name, spec = found[0]
    if request.guided_whitespace_pattern is not None:
        spec.setdefault("whitespace_pattern", request.guided_whitespace_pattern)
    known = set(StructuredOutputsParams.__struct_fields__)
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ValueError(f"{name}: unknown or unsupported keys {unknown} (supported: {sorted(known)})")
    try:
        params = StructuredOutputsParams(**spec)
        # The constraint's syntax, checked here too so that the error names the field that gave it.
        validate_structured_outputs(params)
    except (ValueError, TypeError) as e:  # TypeError: a value of the wrong type
        raise ValueError(f"{name}: {e}") from None
    return params


def _or(value: T | None, default: T) -> T:
    return default if value is None else value


# ---- streams ------------------------------------------------------------------------------------------------


async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncGenerator[tuple[int, T], None]:
    """Yield (index of the iterator, item) from several async iterators as items arrive.

    Closing (or cancelling) the merged generator closes every unfinished source, so each source's own
    clean-up runs (for `AsyncLLM.generate`: the request is aborted in the engine).
    """
    if len(iterators) == 1:
        it = iterators[0]
        try:
            async for item in it:
                yield 0, item
        finally:
            await _aclose(it)
        return
    loop = asyncio.get_running_loop()
    pending: dict[asyncio.Task, tuple[int, AsyncIterator[T]]] = {}

    def start(i: int, it: AsyncIterator[T]) -> None:
        task = loop.create_task(anext(it))  # type: ignore[arg-type]
        task.add_done_callback(_retrieve)
        pending[task] = (i, it)

    try:
        for i, it in enumerate(iterators):
            start(i, it)
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i, it = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                start(i, it)
                yield i, item
    finally:
        for task, (_, it) in pending.items():
            if task.done():
                await _aclose(it)  # the source is suspended at a yield: close it
            else:
                task.cancel()  # the source is running: the cancellation reaches its own clean-up


def _retrieve(task: asyncio.Task) -> None:
    # A source that failed after the merge was closed must not log "exception was never retrieved".
    if not task.cancelled():
        task.exception()


async def _aclose(it: AsyncIterator[Any]) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


def sse(data: str) -> str:
    return f"data: {data}\n\n"


def sse_event(name: str, payload: dict[str, Any]) -> str:
    """A named server-sent event (Anthropic's and the Responses API's streams): `event: NAME` and its JSON."""
    return f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def sse_error(err: OpenAIError) -> str:
    return sse(json.dumps(error_body(err.message, err.status, err.param, err.err_type)))


SSE_DONE = "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """A server-sent-events response whose body generator is always closed when the response ends.

    Starlette cancels the sending task when the client disconnects; the body generator may then be left
    suspended at a `yield`. Closing it here runs its `finally` at once, which aborts the engine requests
    (and frees their KV blocks) instead of waiting for the garbage collector.
    """

    def __init__(self, content: AsyncGenerator[str, None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await _aclose(self.body_iterator)


# ---- non-streaming requests vs. disconnects -------------------------------------------------------------------


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client has closed the connection (the request body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnected(work: Awaitable[T], request: Request) -> T:
    """Await `work`, but cancel it (aborting its generations) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientDisconnected()
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        with contextlib.suppress(BaseException):
            await task
