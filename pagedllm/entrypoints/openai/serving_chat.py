"""POST /v1/chat/completions: OpenAI's chat API on top of `AsyncLLM.generate` and the model's chat template.

Contract:
* `messages` (system/developer/user/assistant/tool/function, content a string or a list of text parts) must
  follow OpenAI's per-role rules (`check_message`: an unknown role, a user message without content, a tool
  message without tool_call_id, ... are a 400 naming the field, e.g. `messages[0].content`), then go through
  the model's chat template (`add_generation_prompt` default true, `continue_final_message` as in vLLM; a
  request's own `chat_template` only with --trust-request-chat-template); the templated text is tokenized
  without adding special tokens again. A template that rejects the conversation is a 400.
* `max_completion_tokens` (or the older `max_tokens`) defaults to what is left of the context length.
* `logprobs: true` + `top_logprobs: N` return OpenAI's chat format: `content` = [{token, logprob, bytes,
  top_logprobs: [{token, logprob, bytes}] * N}].
* Structured output: `response_format` (json_schema, json_object, text), `structured_outputs` or the `guided_*`
  fields (serving_engine.structured_outputs_of); a constraint that does not parse is a 400 naming the field.
* Tools (`plan_tools`): `tools` reach the chat template. `tool_choice` "none" (the default without tools) leaves
  the output as text; "auto" (the default with tools) needs --enable-auto-tool-choice and --tool-call-parser and
  parses the output with that parser; "required" and a named function are enforced by a JSON-schema constraint
  built from the tools' parameters (a list of {name, parameters}; the function's parameters). A choice that
  returns calls ends with finish_reason "tool_calls"; streamed, each call comes as OpenAI streams it (id, type
  and name first, then pieces of `arguments` that join into the non-streamed string). `parallel_tool_calls:
  false` allows one call at most (`ToolPlan.parallel`): "required" is constrained to a list of one, "auto" returns
  the first call the parser finds (later ones are dropped, streamed too), a named choice is one call anyway. A
  parser whose format uses special tokens (mistral) gets them in the text unless the request sets
  skip_special_tokens.
* Reasoning (--reasoning-parser): the thinking goes to `reasoning_content` (streamed as its own deltas), the rest
  is the content (and what tools are parsed from).
* The reply's role (the message's, and the first streamed delta's) is --response-role ("assistant" by default)
  when a generation prompt opens it, else the last message's, which it continues (vLLM's rule).
* Streaming: first one chunk per choice with `delta.role` (the reply's role), then content deltas (the last
  one of a choice carries its `finish_reason`), then the usage chunk if asked, then `data: [DONE]`.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatMessageParam,
    DeltaMessage,
    UsageInfo,
    now_s,
    random_uuid,
)
from pagedllm.entrypoints.openai.serving_engine import (
    MIN_LOGPROB,
    SSE_DONE,
    ClientDisconnected,
    FrontendOptions,
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
from pagedllm.entrypoints.openai.tool_parsers import (
    FirstCallOnly,
    FunctionCall,
    StreamedToolCallDelta,
    ToolCall,
    ToolParser,
    ToolParserManager,
)
from pagedllm.entrypoints.openai.tool_parsers.abstract import new_tool_call_id
from pagedllm.entrypoints.openai.tool_parsers.required import RequiredToolCallsParser, required_calls_schema
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output import validate_structured_outputs

# Roles whose messages must carry content (OpenAI's rules; see ChatMessageParam).
CONTENT_REQUIRED_ROLES = frozenset({"system", "developer", "user", "tool"})


def check_message(index: int, message: ChatMessageParam) -> None:
    """Raise a 400 naming the field (`messages[i].content`, ...) if `message` breaks OpenAI's per-role rules."""
    where = f"messages[{index}]"
    given = message.model_fields_set
    if message.role in CONTENT_REQUIRED_ROLES and message.content is None:
        if "content" not in given:
            raise OpenAIError(f"Missing required parameter: '{where}.content'.", 400, f"{where}.content")
        raise OpenAIError(
            f"Invalid type for '{where}.content': a {message.role} message needs a string or an array of content "
            "parts, got null.",
            400,
            f"{where}.content",
        )
    if message.role == "assistant" and message.content is None and not (message.tool_calls or message.function_call):
        raise OpenAIError(
            f"Missing required parameter: '{where}.content' (an assistant message needs content unless it has "
            "tool_calls).",
            400,
            f"{where}.content",
        )
    if message.role == "tool" and message.tool_call_id is None:
        raise OpenAIError(f"Missing required parameter: '{where}.tool_call_id'.", 400, f"{where}.tool_call_id")
    if message.role == "function":
        if message.name is None:
            raise OpenAIError(f"Missing required parameter: '{where}.name'.", 400, f"{where}.name")
        if "content" not in given:  # required, but may be null
            raise OpenAIError(f"Missing required parameter: '{where}.content'.", 400, f"{where}.content")


def messages_to_dicts(messages: Sequence[ChatMessageParam]) -> list[dict[str, Any]]:
    """Pydantic messages -> the dicts a chat template expects, after OpenAI's per-role checks (`check_message`,
    a 400 naming the field). Content that may be absent (an assistant's tool calls) becomes ""."""
    out = []
    for i, m in enumerate(messages):
        check_message(i, m)
        d = m.model_dump(exclude_none=True)
        d.setdefault("content", "")
        out.append(d)
    return out


@dataclass
class ToolPlan:
    """How a request's tools are handled: `mode` "none" (plain text), "auto" (the model may call them; its output
    goes through the server's tool-call parser), "required" (a JSON list of calls, enforced by a JSON-schema
    constraint) or "named" (the arguments of `name`, enforced by that tool's parameters schema). `tools` are the
    request's (parsers that type values by them get them); `parallel` false (`parallel_tool_calls: false`) allows
    one call at most: the constraint of "required" stops after one, and the parser returns the first call only."""

    mode: str = "none"
    name: str | None = None
    parser_name: str | None = None
    tools: list[dict[str, Any]] | None = None
    parallel: bool = True

    def parser(self, tokenizer: Any) -> ToolParser | None:
        """A new parser of the output (one per choice: it keeps a stream's state); None for "none" and "named"."""
        parser: ToolParser
        if self.mode == "auto":
            assert self.parser_name is not None
            parser = ToolParserManager.get(self.parser_name)(tokenizer, tools=self.tools)
        elif self.mode == "required":
            parser = RequiredToolCallsParser(tokenizer, tools=self.tools)
        else:
            return None
        return parser if self.parallel else FirstCallOnly(parser)

    def needs_special_tokens(self) -> bool:
        """Whether the output must keep special tokens for the parser to read it (mistral's [TOOL_CALLS])."""
        return (
            self.mode == "auto"
            and self.parser_name is not None
            and ToolParserManager.get(self.parser_name).needs_special_tokens
        )


def plan_tools(request: ChatCompletionRequest, auto_enabled: bool, parser_name: str | None) -> ToolPlan:
    """Validate `tools` and `tool_choice` (OpenAI's rules; a 400 naming the field) and say how to serve them
    (`parallel_tool_calls` read when the request has it: the Responses API has it too)."""
    tools = request.tools or []
    parallel = getattr(request, "parallel_tool_calls", True) is not False
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            tool.get("type", "function") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not fn["name"]
        ):
            raise OpenAIError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}",
                400,
                f"tools[{i}]",
            )
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise OpenAIError(f"tools[{i}].function.parameters must be a JSON schema object", 400, f"tools[{i}]")
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise OpenAIError("tool_choice needs tools", 400, "tool_choice")
    if choice == "none":
        return ToolPlan()
    if choice == "auto":
        if not auto_enabled or parser_name is None:
            raise OpenAIError(
                'tool_choice "auto" needs the server started with --enable-auto-tool-choice and --tool-call-parser',
                400,
                "tool_choice",
            )
        return ToolPlan("auto", parser_name=parser_name, tools=tools, parallel=parallel)
    if choice == "required":
        return ToolPlan("required", tools=tools, parallel=parallel)
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
            raise OpenAIError(f"tool_choice names the function {name!r}, which is not in tools", 400, "tool_choice")
        return ToolPlan("named", name=name, tools=tools, parallel=parallel)
    raise OpenAIError(
        f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": {{"name": ...}}}}, '
        f"got {choice!r}",
        400,
        "tool_choice",
    )


def tool_constraint(request: ChatCompletionRequest, plan: ToolPlan) -> StructuredOutputsParams | None:
    """The JSON-schema constraint that enforces `required` and named tool choices (compact JSON)."""
    tools = request.tools or []
    if plan.mode == "required":
        schema = required_calls_schema(tools, max_calls=None if plan.parallel else 1)
    elif plan.mode == "named":
        fn = next(t["function"] for t in tools if t["function"]["name"] == plan.name)
        schema = fn.get("parameters") or {"type": "object"}
    else:
        return None
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def _call_dict(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": call.function.arguments},
    }


def _delta_dict(piece: StreamedToolCallDelta) -> dict[str, Any]:
    out: dict[str, Any] = {"index": piece.index}
    function: dict[str, Any] = {}
    if piece.id is not None:
        out["id"], out["type"] = piece.id, "function"
        function["name"] = piece.name
    if piece.arguments is not None:
        function["arguments"] = piece.arguments
    out["function"] = function
    return out


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self,
        engine: Any,
        served_model_names: list[str],
        options: FrontendOptions | None = None,
    ) -> None:
        super().__init__(engine, served_model_names, options)

    def get_chat_request_role(self, request: ChatCompletionRequest) -> str:
        """The role of the reply (vLLM's rule): --response-role when a generation prompt opens a new message, else
        that of the last message, which the reply continues."""
        if request.add_generation_prompt and not request.continue_final_message:
            return self.options.response_role  # --response-role
        return request.messages[-1].role

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        run = await self.start(request, f"chatcmpl-{random_uuid()}")
        if request.stream:
            return SSEResponse(self._stream(request, run))
        final = await self.collect(run, request, raw_request)
        body = self._response(request, run.request_id, run.prompt_tokens, final, run.plan)
        return Response(body.model_dump_json(), media_type="application/json")

    async def start(self, request: ChatCompletionRequest, request_id: str) -> ChatRun:
        """Check and render the request and hand it to the engine (every rejection happens here, before a byte is
        sent). The chat-shaped front of the other APIs too (Anthropic's Messages, OpenAI's Responses)."""
        self.check_model(request.model)
        self.warn_ignored_fields(request)
        plan = plan_tools(request, self.options.enable_auto_tool_choice, self.options.tool_call_parser)
        text, ids, params = await self.off_loop(self._prepare, request, plan)
        self.check_engine()
        lora = self.lora_request(request.model)
        if getattr(request, "use_beam_search", False):
            gen = self.beam_generate(text, ids, params, request, request_id, lora)
        else:
            prompt = {"prompt": text, "prompt_token_ids": ids, "cache_salt": request.cache_salt}
            gen = self.engine.generate(prompt, params, request_id, priority=request.priority, lora_request=lora)
        return ChatRun(request_id, len(ids), gen, plan, ids)

    async def collect(self, run: ChatRun, request: ChatCompletionRequest, raw_request: Request) -> RequestOutput:
        """The final output of a non-streamed run (aborted if the client goes away)."""
        try:
            return (await run_until_disconnected(collect_finals([run.gen]), raw_request))[0]
        except (OpenAIError, ClientDisconnected):
            raise
        except Exception as e:
            raise self.error_for(e, request) from e

    def message(self, plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[ChatMessage, str | None]:
        """The assistant message of a finished choice and its finish reason (see `_message`)."""
        return self._message(plan, text, finish_reason)

    def choice_stream(self, plan: ToolPlan) -> ChoiceStream:
        return ChoiceStream(plan, self.tokenizer, getattr(self.engine, "reasoning_parser", None))

    # ---- validation ------------------------------------------------------------------------------------------

    def _prepare(self, request: ChatCompletionRequest, plan: ToolPlan) -> tuple[str, list[int], SamplingParams]:
        if request.stream_options is not None and not request.stream:
            raise OpenAIError("stream_options can only be given when stream is true", 400, "stream_options")
        self.check_chat_template(request.chat_template)
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true", 400, "top_logprobs")
        max_logprobs = self.engine.input_processor.max_logprobs  # --max-logprobs
        if request.top_logprobs is not None and not 0 <= request.top_logprobs <= max_logprobs:
            raise OpenAIError(
                f"top_logprobs must be between 0 and {max_logprobs} (--max-logprobs), got {request.top_logprobs}",
                400,
                "top_logprobs",
            )
        try:
            text, ids = self.truncated(*self.render(request), request)
            requested = request.max_completion_tokens
            if requested is None:
                requested = request.max_tokens
            max_tokens = self.resolve_max_tokens(requested, len(ids), "messages")
            logprobs = (request.top_logprobs or 0) if request.logprobs else None
            params = self.sampling_params(request, max_tokens, logprobs)
            constraint = tool_constraint(request, plan)
            if constraint is not None and request.use_beam_search:
                raise OpenAIError(
                    f"tool_choice {request.tool_choice!r} constrains the output: use_beam_search cannot follow it",
                    400,
                    "tool_choice",
                )
            if constraint is not None:
                if params.structured_outputs is not None:
                    raise OpenAIError(
                        f"tool_choice {request.tool_choice!r} constrains the output itself: it cannot be combined "
                        "with response_format, structured_outputs or guided_*",
                        400,
                        "tool_choice",
                    )
                try:
                    validate_structured_outputs(constraint)
                except ValueError as e:
                    raise OpenAIError(f"tools: the parameters schema does not compile: {e}", 400, "tools") from None
                params = params.clone(structured_outputs=constraint)
            # a tool parser's markers are kept unless the request says otherwise; a reasoning parser's always
            # (gpt-oss's channels: without them its thinking would be content)
            if getattr(getattr(self.engine, "reasoning_parser", None), "needs_special_tokens", False):
                params = params.clone(skip_special_tokens=False)
            elif plan.needs_special_tokens() and "skip_special_tokens" not in request.model_fields_set:
                params = params.clone(skip_special_tokens=False)
            self.validate_prompt(ids, params)
        except OpenAIError:
            raise
        except Exception as e:
            raise self.error_for(e, request) from e
        return text, ids, params

    def render(self, request: ChatCompletionRequest) -> tuple[str, list[int]]:
        """The prompt of a chat request: its messages through the chat template, and its token ids."""
        text = self.engine.input_processor.apply_chat_template(
            messages_to_dicts(request.messages),
            add_generation_prompt=request.add_generation_prompt,
            chat_template=request.chat_template,
            continue_final_message=request.continue_final_message,
            tools=request.tools or None,
            documents=request.documents,
            chat_template_kwargs=self.template_kwargs(
                request.chat_template_kwargs, reasoning_effort=request.reasoning_effort
            ),
            content_format=self.options.chat_template_content_format,
        )
        return text, self.engine.input_processor.tokenize(text, add_special_tokens=request.add_special_tokens)

    # ---- results ----------------------------------------------------------------------------------------------

    def _message(self, plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[ChatMessage, str | None]:
        """The assistant message of a finished choice: its thinking apart (with a reasoning parser), and its tool
        calls (finish reason "tool_calls" then)."""
        reasoner = getattr(self.engine, "reasoning_parser", None)
        if reasoner is None:
            return self._content_message(plan, text, finish_reason)
        reasoning, content = reasoner.extract_reasoning(text)
        message, finish_reason = self._content_message(plan, content or "", finish_reason)
        message.reasoning_content = reasoning
        if message.content == "" and reasoning is not None:
            message.content = None
        return message, finish_reason

    def _content_message(self, plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[ChatMessage, str | None]:
        if plan.mode == "none":
            return ChatMessage(role="assistant", content=text), finish_reason
        if plan.mode == "named":
            assert plan.name is not None
            call = ToolCall(FunctionCall(plan.name, text))
            reason = "tool_calls" if finish_reason == "stop" else finish_reason
            return ChatMessage(role="assistant", content=None, tool_calls=[_call_dict(call)]), reason
        parser = plan.parser(self.tokenizer)
        assert parser is not None
        try:
            extracted = parser.extract_tool_calls(text)
        except (ValueError, KeyError, TypeError):  # an output cut short (length) is not a list of calls
            return ChatMessage(role="assistant", content=text), finish_reason
        if not extracted.tools_called:
            return ChatMessage(role="assistant", content=extracted.content), finish_reason
        reason = "tool_calls" if finish_reason == "stop" else finish_reason
        calls = [_call_dict(c) for c in extracted.tool_calls]
        return ChatMessage(role="assistant", content=extracted.content, tool_calls=calls), reason

    def _response(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        prompt_tokens: int,
        final: RequestOutput,
        plan: ToolPlan,
    ) -> ChatCompletionResponse:
        choices = []
        completion_tokens = 0
        for c in sorted(final.outputs, key=lambda c: c.index):
            completion_tokens += len(c.token_ids)
            logprobs = None
            if request.logprobs:
                logprobs = self.chat_logprobs(
                    c.token_ids, c.logprobs or [], request.top_logprobs or 0, self.tokens_as_ids(request)
                )
            message, finish_reason = self._message(plan, c.text, c.finish_reason)
            message.role = self.get_chat_request_role(request)
            if not request.include_reasoning:
                message.reasoning_content = None
            echo = self.echo_text(request)
            if echo:
                message.content = echo + (message.content or "")
            choices.append(
                ChatCompletionResponseChoice(
                    index=c.index,
                    message=message,
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                    token_ids=list(c.token_ids) if request.return_token_ids else None,
                )
            )
        return ChatCompletionResponse(
            id=request_id,
            model=self.response_model(request.model),
            choices=choices,
            usage=self.usage(prompt_tokens, completion_tokens, final.num_cached_tokens),
            prompt_logprobs=self.prompt_logprobs_of(request, final),
            prompt_token_ids=list(final.prompt_token_ids) if request.return_token_ids else None,
        )

    def echo_text(self, request: ChatCompletionRequest) -> str:
        """vLLM's chat `echo`: the last message's content (its text), when the reply continues that message (its
        role is the reply's); else nothing."""
        if not request.echo or not request.messages:
            return ""
        last = request.messages[-1]
        if last.role != self.get_chat_request_role(request):
            return ""
        content = last.content
        if isinstance(content, list):
            return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        return content or ""

    def chat_logprobs(
        self, token_ids: Sequence[int], steps: Sequence[dict[int, Logprob]], num_top: int, as_ids: bool = False
    ) -> ChatCompletionLogProbs:
        content = []
        for tid, step in zip(token_ids, steps):
            lp = step.get(tid)
            token = self.token_str(tid, lp, as_ids)
            ranked = sorted(
                (e for e in step.items() if e[1].rank is not None and e[1].rank <= num_top),
                key=lambda kv: kv[1].rank,  # type: ignore[arg-type,return-value]
            )[:num_top]
            top = []
            for t, entry in ranked:
                s = self.token_str(t, entry, as_ids)
                top.append(ChatCompletionLogProb(token=s, logprob=clamp_logprob(entry.logprob), bytes=_utf8(s)))
            content.append(
                ChatCompletionLogProbsContent(
                    token=token,
                    logprob=clamp_logprob(lp.logprob) if lp is not None else MIN_LOGPROB,
                    bytes=_utf8(token),
                    top_logprobs=top,
                )
            )
        return ChatCompletionLogProbs(content=content)

    # ---- streaming ----------------------------------------------------------------------------------------------

    def _chunk(
        self,
        request_id: str,
        model: str,
        created: int,
        choice: ChatCompletionResponseStreamChoice | None,
        usage: UsageInfo | None,
        include_usage: bool,
        prompt_token_ids: list[int] | None = None,
    ) -> str:
        chunk = ChatCompletionStreamResponse(
            id=request_id,
            created=created,
            model=model,
            choices=[choice] if choice is not None else [],
            usage=usage,
            prompt_token_ids=prompt_token_ids,
        )
        data = chunk.model_dump(mode="json", exclude=None if include_usage else {"usage"})
        if prompt_token_ids is None:
            del data["prompt_token_ids"]  # vLLM's return_token_ids only: not a null in every chunk otherwise
        for ch in data["choices"]:
            # A delta names only what it carries: the role once, then content.
            ch["delta"] = {k: v for k, v in ch["delta"].items() if v is not None}
            if ch["token_ids"] is None:
                del ch["token_ids"]
        return sse(json.dumps(data, ensure_ascii=False, separators=(",", ":")))

    async def _stream(self, request: ChatCompletionRequest, run: ChatRun) -> AsyncGenerator[str, None]:
        request_id, prompt_tokens, plan = run.request_id, run.prompt_tokens, run.plan
        created = now_s()
        model = self.response_model(request.model)
        streams: dict[int, ChoiceStream] = {}
        opts = request.stream_options
        include_usage = self.include_usage(request)
        continuous = bool(include_usage and opts and opts.continuous_usage_stats)
        num_tokens: dict[int, int] = defaultdict(int)
        cached_tokens = 0
        as_ids = self.tokens_as_ids(request)

        def usage_for(index: int) -> UsageInfo | None:
            return self.usage(prompt_tokens, num_tokens[index], cached_tokens) if continuous else None

        merged = merge_async_iterators(run.gen)
        try:
            try:
                reply_role = self.get_chat_request_role(request)
                echo = self.echo_text(request)
                for i in range(request.n):
                    role = ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(role=reply_role, content=""))
                    prompt_ids = run.prompt_ids if request.return_token_ids and i == 0 else None
                    yield self._chunk(request_id, model, created, role, usage_for(i), include_usage, prompt_ids)
                    if echo:
                        said = ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(content=echo))
                        yield self._chunk(request_id, model, created, said, usage_for(i), include_usage)
                async for _, out in merged:
                    raise_if_failed(out)
                    cached_tokens = out.num_cached_tokens
                    for c in out.outputs:
                        num_tokens[c.index] += len(c.token_ids)
                        want_logprobs = request.logprobs and bool(c.token_ids)
                        cstream = streams.get(c.index)
                        if cstream is None:
                            cstream = streams[c.index] = self.choice_stream(plan)
                        reasoning, content, tool_calls, finish_reason = cstream.step(c.text, c.finish_reason)
                        if not request.include_reasoning:
                            reasoning = None
                        if not (content or reasoning or tool_calls) and finish_reason is None and not want_logprobs:
                            continue  # nothing to say yet (text held back for a possible stop string)
                        logprobs = None
                        if request.logprobs:
                            logprobs = self.chat_logprobs(
                                c.token_ids, c.logprobs or [], request.top_logprobs or 0, as_ids
                            )
                        choice = ChatCompletionResponseStreamChoice(
                            index=c.index,
                            delta=DeltaMessage(content=content, reasoning_content=reasoning, tool_calls=tool_calls),
                            logprobs=logprobs,
                            finish_reason=finish_reason,
                            stop_reason=c.stop_reason,
                            token_ids=list(c.token_ids) if request.return_token_ids else None,
                        )
                        yield self._chunk(request_id, model, created, choice, usage_for(c.index), include_usage)
                if include_usage:
                    usage = self.usage(prompt_tokens, sum(num_tokens.values()), cached_tokens)
                    yield self._chunk(request_id, model, created, None, usage, True)
            except Exception as e:
                yield sse_error(self.error_for(e, request))
            yield SSE_DONE
        finally:
            await merged.aclose()


@dataclass
class ChatRun:
    """A chat request handed to the engine: its outputs (`gen`), prompt length and tool plan."""

    request_id: str
    prompt_tokens: int
    gen: AsyncIterator[RequestOutput]
    plan: ToolPlan
    prompt_ids: list[int]


class ChoiceStream:
    """One streamed choice: its text deltas in; its reasoning, content and tool-call pieces (OpenAI's delta dicts)
    out, with the finish reason ("tool_calls" once a call was made). What every streaming API renders."""

    def __init__(self, plan: ToolPlan, tokenizer: Any, reasoner: Any = None) -> None:
        self.reasoning = reasoner.stream() if reasoner is not None else None
        self.tools = _ToolStream(plan, tokenizer) if plan.mode != "none" else None

    def step(
        self, text: str, finish_reason: str | None
    ) -> tuple[str | None, str | None, list[dict[str, Any]] | None, str | None]:
        content: str | None = text
        reasoning: str | None = None
        tool_calls = None
        if self.reasoning is not None:
            reasoning, content = self.reasoning.step(text)
            if finish_reason is not None:
                more_reasoning, more_content = self.reasoning.finish()
                reasoning = (reasoning or "") + (more_reasoning or "") or None
                content = (content or "") + (more_content or "") or None
        if self.tools is not None:
            content, tool_calls, finish_reason = self.tools.step(content or "", finish_reason)
        return reasoning, content, tool_calls, finish_reason


class _ToolStream:
    """One streamed choice under a tool plan: its text in, content and tool-call pieces out."""

    def __init__(self, plan: ToolPlan, tokenizer: Any) -> None:
        self.plan = plan
        self.parser = plan.parser(tokenizer)
        self.called = False
        self.named_started = False

    def step(self, text: str, finish_reason: str | None) -> tuple[str | None, list[dict[str, Any]] | None, str | None]:
        pieces: list[StreamedToolCallDelta] = []
        content: str | None = None
        if self.parser is None:  # named: the text is the arguments of the one call
            if not self.named_started and (text or finish_reason is not None):
                self.named_started = True
                pieces.append(StreamedToolCallDelta(0, new_tool_call_id(), self.plan.name, ""))
            if text:
                pieces.append(StreamedToolCallDelta(0, arguments=text))
        else:
            delta = self.parser.extract_tool_calls_streaming(text)
            if finish_reason is not None:
                end = self.parser.finish()
                delta.content = (delta.content or "") + (end.content or "") or None
                delta.tool_calls += end.tool_calls
            content, pieces = delta.content, delta.tool_calls
        self.called = self.called or bool(pieces)
        if finish_reason == "stop" and self.called:
            finish_reason = "tool_calls"
        return content, [_delta_dict(p) for p in pieces] or None, finish_reason


def _utf8(s: str) -> list[int]:
    return list(s.encode("utf-8", errors="replace"))
