"""POST /v1/completions: OpenAI's legacy completions API on top of `AsyncLLM.generate`.

Contract:
* `prompt` is a string, a list of strings, a list of token ids or a list of token-id lists. Each prompt is
  one generation with `n` choices; choice index = prompt_index * n + i. All prompts are validated before
  any is sent to the engine, so a bad one rejects the whole request (400) and nothing runs.
* `max_tokens` defaults to 16 (OpenAI and vLLM), or the generation config's max_new_tokens where smaller; an
  explicit null means "up to the context length" (at most that max_new_tokens). Sampling values a request leaves
  unset come from the generation config (--generation-config; serving_engine.py).
* `logprobs=N` returns OpenAI's legacy format (tokens, token_logprobs, top_logprobs, text_offset); with
  `echo` the prompt text is prepended and, with logprobs, the prompt tokens come first (the first one has
  no logprob). `finish_reason` is the engine's ("stop" or "length"), `stop_reason` the matched stop
  string or stop token id.
* Streaming sends one SSE chunk per choice delta, then (with stream_options.include_usage) a chunk with
  empty choices and the usage, then `data: [DONE]`. An error after the stream started (the engine died)
  is sent as an SSE `{"error": ...}` event before `[DONE]`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncGenerator, Sequence

from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    now_s,
    random_uuid,
)
from pagedllm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    ClientDisconnected,
    OpenAIServing,
    SSEResponse,
    clamp_logprob,
    collect_finals,
    merge_async_iterators,
    raise_if_failed,
    run_until_disconnected,
    sse,
    sse_error,
)
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams


class _Prompt:
    """One prompt of a request: its ids, its text (decoded lazily for token-id prompts) and its params."""

    def __init__(self, text: str | None, ids: list[int], params: SamplingParams) -> None:
        self.text = text
        self.ids = ids
        self.params = params


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        self.warn_ignored_fields(request)
        prompts = await self.off_loop(self._prepare, request)
        self.check_engine()
        request_id = f"cmpl-{random_uuid()}"
        lora = self.lora_request(request.model)
        if request.use_beam_search:
            gens = [
                self.beam_generate(p.text, p.ids, p.params, request, f"{request_id}-{i}", lora)
                for i, p in enumerate(prompts)
            ]
        else:
            gens = [
                self.engine.generate(
                    {"prompt": p.text, "prompt_token_ids": p.ids, "cache_salt": request.cache_salt},
                    p.params,
                    f"{request_id}-{i}",
                    priority=request.priority,
                    lora_request=lora,
                )
                for i, p in enumerate(prompts)
            ]
        if request.stream:
            return SSEResponse(self._stream(request, request_id, prompts, gens))
        try:
            finals = await run_until_disconnected(collect_finals(gens), raw_request)
        except (OpenAIError, ClientDisconnected):
            raise
        except Exception as e:
            raise self.error_for(e, request) from e
        body = self._response(request, request_id, prompts, finals)
        return Response(body.model_dump_json(), media_type="application/json")

    # ---- validation ---------------------------------------------------------------------------------------

    def _prepare(self, request: CompletionRequest) -> list[_Prompt]:
        if request.suffix:
            raise OpenAIError("suffix is not supported", 400, "suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIError("best_of is not supported (only best_of == n)", 400, "best_of")
        if request.stream_options is not None and not request.stream:
            raise OpenAIError("stream_options can only be given when stream is true", 400, "stream_options")
        try:
            prompts = []
            requested = request.max_tokens
            if "max_tokens" not in request.model_fields_set and requested is not None:
                # OpenAI's default of 16, lowered by the generation config's max_new_tokens (as vLLM takes the least)
                requested = min(requested, self.default_sampling_params.get("max_tokens", requested))
            for text, ids in self._parse_prompts(request):
                text, ids = self.truncated(text, ids, request)
                max_tokens = self.resolve_max_tokens(requested, len(ids), "prompt")
                prompt_logprobs = request.logprobs if request.echo and request.logprobs is not None else None
                params = self.sampling_params(request, max_tokens, request.logprobs, prompt_logprobs)
                self.validate_prompt(ids, params)
                prompts.append(_Prompt(text, ids, params))
            return prompts
        except OpenAIError:
            raise
        except Exception as e:
            raise self.error_for(e, request) from e

    def _parse_prompts(self, request: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        prompt = request.prompt
        tokenize = self.engine.input_processor.tokenize
        if isinstance(prompt, str):
            return [(prompt, tokenize(prompt, request.add_special_tokens))]
        if not prompt:
            raise OpenAIError("prompt must not be empty", 400, "prompt")
        if isinstance(prompt[0], str):
            return [(p, tokenize(p, request.add_special_tokens)) for p in prompt]  # type: ignore[arg-type]
        if isinstance(prompt[0], int):
            return [(None, list(prompt))]  # type: ignore[arg-type]
        return [(None, list(p)) for p in prompt]  # type: ignore[union-attr]

    def _prompt_text(self, p: _Prompt) -> str:
        if p.text is None:
            p.text = self.tokenizer.decode(p.ids)
        return p.text

    # ---- results ----------------------------------------------------------------------------------------------

    def _response(
        self, request: CompletionRequest, request_id: str, prompts: list[_Prompt], finals: list[RequestOutput]
    ) -> CompletionResponse:
        choices = []
        completion_tokens = 0
        for pi, (p, out) in enumerate(zip(prompts, finals)):
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                text = c.text
                token_ids: list[int] = list(c.token_ids)
                steps: list[dict[int, Logprob] | None] = list(c.logprobs or [])
                if request.echo:
                    text = self._prompt_text(p) + text
                    token_ids = p.ids + token_ids
                    steps = self._prompt_steps(p, out) + steps
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self.completion_logprobs(
                        token_ids, steps, request.logprobs, 0, self.tokens_as_ids(request)
                    )
                choices.append(
                    CompletionResponseChoice(
                        index=pi * request.n + c.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        prompt_token_ids=p.ids if request.return_token_ids else None,
                        token_ids=list(c.token_ids) if request.return_token_ids else None,
                        prompt_logprobs=self.prompt_logprobs_of(request, out),
                    )
                )
        choices.sort(key=lambda ch: ch.index)
        prompt_tokens = sum(len(p.ids) for p in prompts)
        return CompletionResponse(
            id=request_id,
            model=self.response_model(request.model),
            choices=choices,
            usage=self.usage(prompt_tokens, completion_tokens, sum(out.num_cached_tokens for out in finals)),
        )

    def _prompt_steps(self, p: _Prompt, out: RequestOutput) -> list[dict[int, Logprob] | None]:
        steps = list(out.prompt_logprobs or [])
        return steps + [None] * (len(p.ids) - len(steps))

    def completion_logprobs(
        self,
        token_ids: Sequence[int],
        steps: Sequence[dict[int, Logprob] | None],
        num_top: int,
        initial_offset: int,
        as_ids: bool = False,
    ) -> CompletionLogProbs:
        """OpenAI's legacy logprobs: per token its text, logprob, top-N alternatives and text offset."""
        result = CompletionLogProbs()
        offset = initial_offset
        for i, tid in enumerate(token_ids):
            step = steps[i] if i < len(steps) else None
            lp = step.get(tid) if step is not None else None
            token = self.token_str(tid, lp, as_ids)
            result.tokens.append(token)
            result.text_offset.append(offset)
            offset += len(token)
            if step is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(clamp_logprob(lp.logprob) if lp is not None else None)
            top: dict[str, float] = {}
            for t, entry in sorted(step.items(), key=lambda kv: -kv[1].logprob):
                if t == tid or (entry.rank is not None and entry.rank <= num_top):
                    top.setdefault(self.token_str(t, entry, as_ids), clamp_logprob(entry.logprob))  # type: ignore[arg-type]
            result.top_logprobs.append(top)
        return result

    # ---- streaming ----------------------------------------------------------------------------------------------

    async def _stream(
        self, request: CompletionRequest, request_id: str, prompts: list[_Prompt], gens: list
    ) -> AsyncGenerator[str, None]:
        created = now_s()
        opts = request.stream_options
        include_usage = self.include_usage(request)
        continuous = bool(include_usage and opts and opts.continuous_usage_stats)
        as_ids = self.tokens_as_ids(request)
        cached: dict[int, int] = {}  # prompt index -> its prompt tokens the prefix cache held
        echoed: set[int] = set()
        offsets: dict[int, int] = defaultdict(int)
        num_tokens: dict[int, int] = defaultdict(int)
        merged = merge_async_iterators(*gens)
        try:
            try:
                async for pi, out in merged:
                    raise_if_failed(out)
                    p = prompts[pi]
                    cached[pi] = out.num_cached_tokens
                    for c in out.outputs:
                        idx = pi * request.n + c.index
                        num_tokens[idx] += len(c.token_ids)
                        text = c.text
                        token_ids: list[int] = list(c.token_ids)
                        steps: list[dict[int, Logprob] | None] = list(c.logprobs or [])
                        first = idx not in echoed
                        if request.echo and first:
                            text = self._prompt_text(p) + text
                            token_ids = p.ids + token_ids
                            steps = self._prompt_steps(p, out) + steps
                        carries_ids = (request.logprobs is not None or request.return_token_ids) and token_ids
                        if not text and c.finish_reason is None and not carries_ids:
                            continue  # nothing to say yet (text held back for a possible stop string)
                        logprobs = None
                        if request.logprobs is not None:
                            logprobs = self.completion_logprobs(
                                token_ids, steps, request.logprobs, offsets[idx], as_ids
                            )
                        offsets[idx] += len(text)
                        echoed.add(idx)
                        usage = None
                        if continuous:
                            usage = self.usage(len(p.ids), num_tokens[idx], cached[pi])
                        chunk = CompletionStreamResponse(
                            id=request_id,
                            created=created,
                            model=self.response_model(request.model),
                            choices=[
                                CompletionResponseChoice(
                                    index=idx,
                                    text=text,
                                    logprobs=logprobs,
                                    finish_reason=c.finish_reason,
                                    stop_reason=c.stop_reason,
                                    prompt_token_ids=p.ids if request.return_token_ids and first else None,
                                    token_ids=list(c.token_ids) if request.return_token_ids else None,
                                )
                            ],
                            usage=usage,
                        )
                        yield sse(chunk.model_dump_json(exclude=None if include_usage else {"usage"}))
                if include_usage:
                    prompt_tokens = sum(len(p.ids) for p in prompts)
                    completion_tokens = sum(num_tokens.values())
                    final = CompletionStreamResponse(
                        id=request_id,
                        created=created,
                        model=self.response_model(request.model),
                        choices=[],
                        usage=self.usage(prompt_tokens, completion_tokens, sum(cached.values())),
                    )
                    yield sse(final.model_dump_json())
            except Exception as e:
                yield sse_error(self.error_for(e, request))
            yield SSE_DONE
        finally:
            await merged.aclose()
