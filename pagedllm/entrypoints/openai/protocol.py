"""Pydantic models of the OpenAI-compatible API: what requests may hold and what responses look like.

Contract: request models validate only types and shapes (a wrong type becomes a 400 through the server's
validation handler); value ranges are checked once, by `SamplingParams` and the `InputProcessor`, so the
server and the offline `LLM` reject the same things with the same messages. Unknown request fields are
accepted and ignored with a warning, as vLLM does. Field names follow OpenAI, plus vLLM's extra sampling
parameters (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, ...). Response models
mirror OpenAI's objects (ids `cmpl-...`/`chatcmpl-...`, `created` in seconds, `usage` token counts); those of the
pooling routes follow vLLM's (OpenAI's embeddings, Jina's and Cohere's rerank; ids `embd-`, `pool-`, `classify-`,
`score-`, `rerank-`).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Integers that reach the engine are msgpack int64 on the way: bound them here so that an absurd value is a 400
# from validation rather than an overflow later.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
# OpenAI's limit on choices per prompt (each one is a request in the engine).
MAX_N = 128


def random_uuid() -> str:
    return uuid.uuid4().hex


def now_s() -> int:
    return int(time.time())


class OpenAIBaseModel(BaseModel):
    # Unknown fields are kept (and reported by the server as ignored) rather than rejected, as in vLLM:
    # clients built for other servers send fields this one does not know.
    model_config = ConfigDict(extra="allow")


# ---- errors, models, usage ------------------------------------------------------------------------------


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class VersionResponse(OpenAIBaseModel):
    version: str


class LoadResponse(OpenAIBaseModel):
    server_load: int  # generation requests in flight


class IsSleepingResponse(OpenAIBaseModel):
    is_sleeping: bool


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt token (None for the first) its top-N and its own entry, by token id
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int = 0  # prompt tokens found in the prefix cache


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None  # with --enable-prompt-tokens-details


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


# ---- sampling fields shared by /v1/completions and /v1/chat/completions ----------------------------------


class SamplingFields(OpenAIBaseModel):
    """Request fields that become `SamplingParams` (None means the OpenAI/vLLM default)."""

    model: str | None = None
    n: Annotated[int, Field(le=MAX_N)] = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling parameters
    prompt_logprobs: Int64 | None = None  # the top-N log-probabilities of each prompt token (not when streaming)
    use_beam_search: bool = False  # beam search of width n (pagedllm/beam_search.py)
    length_penalty: float = 1.0  # beam search: scores are logprob sums over length ** length_penalty
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 = 0
    ignore_eos: bool = False
    stop_token_ids: list[Int64] | None = None
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens "token_id:N" (default: the server flag)
    truncate_prompt_tokens: Annotated[Int64, Field(ge=-1)] | None = None  # keep the prompt's last N tokens (-1: max)
    cache_salt: Annotated[str, Field(min_length=1)] | None = None  # prefix-cache hits only among the same salt
    # tokens a streamed chunk gathers (raised to --stream-interval; the first and last chunks are sent at once)
    stream_interval: Annotated[Int64, Field(ge=1)] | None = None
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None  # SamplingParams.extra_args
    allowed_token_ids: list[Int64] | None = None  # only these ids may be sampled
    bad_words: list[str] | None = None  # words the output may not contain
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: Int64 = 0
    # Structured output: OpenAI's response_format, vLLM's structured_outputs, or the older guided_* names (one of them)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None


# ---- /v1/completions ---------------------------------------------------------------------------------------


# Request examples in the OpenAPI description (`json_schema_extra`): what a reader copies first, and the requests
# a schema fuzzer sends before it invents its own. Short, so that trying one costs little.
_USER_MESSAGE = {"role": "user", "content": "Name a primary color."}
_SYSTEM_MESSAGE = {"role": "system", "content": "Be brief."}  # also keeps the template's long default one out


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
                {"prompt": ["Once upon a", "Hello"], "max_tokens": 3, "logprobs": 2, "echo": True},
                {
                    "prompt": "Once upon a time",
                    "max_tokens": 3,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            ]
        }
    )

    # A string, a list of strings, token ids, or a list of token-id lists: each prompt is one choice set.
    prompt: str | list[str] | list[Int64] | list[list[Int64]]
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool = False
    best_of: Int64 | None = None
    suffix: str | None = None
    add_special_tokens: bool = True
    # vLLM's: each choice also carries its prompt's token ids (once, in a stream's first chunk) and its new tokens'
    return_token_ids: bool = False


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    token_ids: list[int] | None = None  # with return_token_ids
    prompt_logprobs: PromptLogprobs | None = None  # with prompt_logprobs


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ---- /v1/chat/completions ----------------------------------------------------------------------------------


# OpenAI's message roles ("function" is deprecated by OpenAI but still accepted there). Any other role is a 400.
ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessageParam(OpenAIBaseModel):
    """One message of a conversation. Besides these types, OpenAI's per-role rules hold (checked by the chat
    handler, a 400 naming the field, e.g. `messages[0].content`): system, developer and user messages need
    `content`; an assistant message may leave `content` out (or null) only when it has `tool_calls` (or the
    deprecated `function_call`); a tool message needs `content` and `tool_call_id`; a function message needs
    `name` and a `content` key, which may be null."""

    role: ChatRole
    # A string or a list of content parts ({"type": "text", "text": ...}); parts are checked by the template.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # Past turns of a tool-using conversation; they reach the chat template as given.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    function_call: dict[str, Any] | None = None


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "messages": [_SYSTEM_MESSAGE, _USER_MESSAGE],
                    "max_completion_tokens": 4,
                    "logprobs": True,
                    "top_logprobs": 2,
                },
                {"messages": [_SYSTEM_MESSAGE, _USER_MESSAGE], "max_tokens": 3, "n": 2, "stream": True},
            ]
        }
    )

    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: Int64 | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True  # false: at most one call (null: the default)
    # vLLM's chat extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    add_special_tokens: bool = False
    echo: bool = False  # the reply starts with the last message's content when it continues that message
    include_reasoning: bool = True  # false: no reasoning_content (with --reasoning-parser)
    return_token_ids: bool = False  # vLLM's: the prompt's token ids, and each choice's
    # The template's own variables (e.g. Qwen3's enable_thinking), over --default-chat-template-kwargs
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None  # for templates that render retrieved documents (RAG)
    reasoning_effort: str | None = None  # given to the template as `reasoning_effort`, as vLLM does


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    reasoning_content: str | None = None  # the model's thinking, with --reasoning-parser
    # OpenAI's [{"id", "type": "function", "function": {"name", "arguments"}}]
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # with prompt_logprobs (of the prompt all choices share)
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    # pieces of calls: [{"index", "id"?, "type"?, "function": {"name"?, "arguments"?}}]
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids: this chunk's


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids: in the first chunk


# ---- /tokenize, /detokenize ---------------------------------------------------------------------------------


class TokenizeRequest(OpenAIBaseModel):
    """Either {"prompt": str} (completion style) or {"messages": [...]} (chat style, the chat template)."""

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"prompt": "Hello, world!"}, {"messages": [_USER_MESSAGE]}]}
    )

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    # With messages: OpenAI-style function definitions, rendered by the chat template as a chat request's are.
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # with messages, as in a chat request
    documents: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """POST /v1/load_lora_adapter (vLLM's): serve the adapter at `lora_path` as model `lora_name`."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"lora_name": "sql", "lora_path": "/adapters/sql"}]})

    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace an adapter of that name


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """POST /v1/unload_lora_adapter: stop serving adapter `lora_name` (requests using it finish first)."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"lora_name": "sql"}]})

    lora_name: str
    lora_int_id: int | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"tokens": [19556, 28, 905, 17]}]})

    model: str | None = None
    tokens: list[Int64]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


# ---- pooling models: /v1/embeddings, /pooling, /classify, /score, /rerank ------------------------------------


# A string, a list of strings, token ids, or a list of token-id lists: each one is one engine request.
PoolingInput = str | list[str] | list[Int64] | list[list[Int64]]


class PoolingFields(OpenAIBaseModel):
    """What every pooling request may hold (vLLM's names). `truncate_prompt_tokens`: -1 cuts the input to
    max_model_len, k > 0 to k tokens (text: the tokenizer's right truncation; token ids: the last k)."""

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Int64 | None = None
    priority: Int64 = 0


class EmbeddingRequest(PoolingFields):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"input": "The food was delicious."},
                {"input": ["Hello", "A second sentence"], "encoding_format": "base64"},
            ]
        }
    )

    input: PoolingInput
    # "base64": the little-endian float32 bytes of each vector, base64-encoded (the openai client's default).
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int64 | None = None  # Matryoshka models only
    normalize: bool | None = None  # default: the model's (sentence-transformers' Normalize module)
    add_special_tokens: bool = True


class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"embd-{random_uuid()}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now_s)
    model: str
    data: list[EmbeddingResponseData]
    usage: UsageInfo


class PoolingRequest(EmbeddingRequest):
    """/pooling: the model's raw pooled states (task "encode"): one vector, or one per token (pooling type ALL)."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"input": "The food was delicious."}]})


class PoolingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | list[list[float]] | str


class PoolingResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"pool-{random_uuid()}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now_s)
    model: str
    data: list[PoolingResponseData]
    usage: UsageInfo


class ActivationFields(PoolingFields):
    """Classification and scores: `use_activation` (softmax over the classes, sigmoid for one label; default the
    model's); `softmax` and `activation` are vLLM's older names of it."""

    use_activation: bool | None = None
    softmax: bool | None = None
    activation: bool | None = None


class ClassificationRequest(ActivationFields):
    model_config = ConfigDict(json_schema_extra={"examples": [{"input": ["Loved it!", "Not my taste."]}]})

    input: PoolingInput
    add_special_tokens: bool = True


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str | None  # the model's id2label of the likeliest class
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"classify-{random_uuid()}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now_s)
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


class ScoreRequest(ActivationFields):
    """Pairs of texts: one text_1 against each text_2, or text_1[i] against text_2[i]."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"text_1": "What is the capital of France?", "text_2": ["Paris is in France.", "Bread is food."]}
            ]
        }
    )

    text_1: str | list[str]
    text_2: str | list[str]


class ScoreResponseData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"score-{random_uuid()}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now_s)
    model: str
    data: list[ScoreResponseData]
    usage: UsageInfo


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankRequest(ActivationFields):
    """Jina's and Cohere's rerank: the documents ranked by relevance to the query. A document is a string or
    Cohere's {"text": ...}; `top_n` 0 (or absent, or at least the number of documents) returns them all."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"query": "What is the capital of France?", "documents": ["Paris is in France.", "Bread is food."]},
                {"query": "capital", "documents": [{"text": "Paris"}, {"text": "bread"}], "top_n": 1},
            ]
        }
    )

    query: str
    documents: list[str | RerankDocument]
    top_n: Int64 | None = None
    return_documents: bool = True


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument | None = None  # left out with return_documents false
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class RerankResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"rerank-{random_uuid()}")
    model: str
    usage: RerankUsage
    results: list[RerankResult]


# ---- /v1/responses ----------------------------------------------------------------------------------------------


class ResponsesRequest(OpenAIBaseModel):
    """OpenAI's Responses API request (serving_responses.py maps it onto a chat request)."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"input": "Name a primary color.", "instructions": "Be brief.", "max_output_tokens": 4},
                {"input": [_USER_MESSAGE], "max_output_tokens": 3, "stream": True, "temperature": 0},
            ]
        }
    )

    model: str | None = None
    # A string (one user message) or items: messages, function_call and function_call_output items
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[Int64, Field(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None  # vLLM's extra
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # {"format": {"type": "text" | "json_object" | "json_schema", "name"?, "schema"?}}
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None  # {"effort": ...}: the chat template's `reasoning_effort`
    cache_salt: Annotated[str, Field(min_length=1)] | None = None  # vLLM's, as in a chat request
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None  # vLLM's, as in a chat request
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra, as in a chat request
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    priority: Int64 = 0


class ResponsesResponse(OpenAIBaseModel):
    """A response object (the documented shape; serving_responses.py builds it as a dict)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    # {"type": "message", ...}, {"type": "function_call", "call_id", "name", "arguments", ...}, {"type": "reasoning"}
    output: list[dict[str, Any]]
    incomplete_details: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
