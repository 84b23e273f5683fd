"""POST /tokenize and POST /detokenize (vLLM's extra endpoints), with the engine's own tokenizer.

Contract: /tokenize takes exactly one of {"prompt": str} (special tokens added by default, as a completion
request would) or {"messages": [...]} (the chat template applied, with `tools` if given, no special tokens added
again, as a chat request would) and answers {"count", "max_model_len", "tokens"} — the very ids a generation
request with the same input would run on. /detokenize turns {"tokens": [...]} back into {"prompt": str}; ids outside
the vocabulary are a 400.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.errors import OpenAIError, error_from_exception
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.serving_chat import messages_to_dicts, plan_tools
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("give exactly one of `prompt` or `messages`", 400, "prompt")
        if request.tools is not None and request.messages is None:
            raise OpenAIError("`tools` go with `messages` (the chat template renders them)", 400, "tools")
        if request.tools:
            # The chat route's checks of each tool's shape (a 400 naming tools[i]); tool_choice "none" asks no more.
            plan_tools(ChatCompletionRequest.model_construct(tools=request.tools, tool_choice="none"), False, None)
        self.check_chat_template(request.chat_template)
        processor = self.engine.input_processor
        try:
            if request.messages is not None:
                text = processor.apply_chat_template(
                    messages_to_dicts(request.messages),
                    add_generation_prompt=request.add_generation_prompt,
                    chat_template=request.chat_template,
                    continue_final_message=request.continue_final_message,
                    tools=request.tools or None,
                    documents=request.documents,
                    chat_template_kwargs=self.template_kwargs(request.chat_template_kwargs),
                    content_format=self.options.chat_template_content_format,
                )
                add_special = bool(request.add_special_tokens)
            else:
                text = request.prompt  # type: ignore[assignment]
                add_special = request.add_special_tokens is not False
            ids = processor.tokenize(text, add_special_tokens=add_special)
        except Exception as e:
            err = error_from_exception(e, TokenizeRequest.model_fields)
            if err.status >= 500:
                raise
            raise err from e
        strs = self.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        vocab = self.engine.model_config.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"token id {bad[0]} is out of the vocabulary [0, {vocab})", 400, "tokens")
        try:
            text = self.tokenizer.decode(request.tokens)
        except (ValueError, OverflowError) as e:
            raise OpenAIError(f"cannot decode tokens: {e}", 400, "tokens") from e
        return DetokenizeResponse(prompt=text)
