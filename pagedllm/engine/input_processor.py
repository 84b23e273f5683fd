"""InputProcessor: a prompt (text, token ids or a chat) -> validated `EngineCoreRequest`.

Pooling requests (a PoolingParams) are checked against the model's pooling tasks and truncated here too.
All user-input validation happens here, before anything reaches the engine core, so a rejected request
never disturbs those in flight: every problem raises `ValueError` naming the bad value.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Sequence
from typing import Any

from pagedllm.config import ModelConfig
from pagedllm.engine.protocol import EngineCoreRequest
from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

PromptType = str | list[int] | dict[str, Any]
# Tokens a cut inside a word can add to a text's head (its last word split in pieces): a head over the context by
# more than this means the whole text is too.
PREFIX_CUT_MARGIN = 16

# A pooling request's sampling settings: a placeholder (it samples nothing) that reports only its end.
_POOLING_PLACEHOLDER = SamplingParams(max_tokens=1, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
_TASK_WORDS = {
    "embed": "embedding generation",
    "encode": "pooling",
    "classify": "classification",
    "score": "scoring",
}


def parse_prompt(prompt: Any) -> tuple[str | None, list[int] | None]:
    """(text, token ids): exactly one is set. Accepts a string, a list of ints, or vLLM-style dicts."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), _token_list(prompt["prompt_token_ids"])
        if "prompt" in prompt and isinstance(prompt["prompt"], str):
            return prompt["prompt"], None
        raise ValueError(f"prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
    if isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray):
        return None, _token_list(prompt)
    raise ValueError(f"unsupported prompt type {type(prompt).__name__}: {prompt!r:.80}")


def _token_list(ids: Any) -> list[int]:
    out = list(ids)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in out):
        raise ValueError(f"prompt_token_ids must be a list of ints, got {out!r:.80}")
    return out


class InputProcessor:
    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Any,
        eos_token_id: int | None,
        lora_enabled: bool = False,
        end_token_ids: list[int] | None = None,
    ) -> None:
        self.model_config = model_config
        self.lora_enabled = lora_enabled  # --enable-lora: requests may name an adapter
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        # More tokens that end a request unless it ignores eos (tokenizer.end_token_ids), added to its stop tokens
        # as vLLM adds its generation config's: a stop there reports the token id as its stop_reason.
        self.end_token_ids = list(end_token_ids or ())
        self.vocab_size = model_config.vocab_size
        self.max_model_len = model_config.max_model_len
        self.max_logprobs = model_config.max_logprobs  # --max-logprobs

    @property
    def eos_token_ids(self) -> list[int]:
        """Every token that ends a sequence (beam search's): the eos and the model's other end tokens."""
        return ([] if self.eos_token_id is None else [self.eos_token_id]) + self.end_token_ids

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text`'s token ids. A text of more than `max_prompt_chars` characters is first tokenized in part, its
        first `max_prompt_chars`: when those alone overflow the context (with a margin for the cut), it is a
        ValueError without tokenizing the rest (megabytes take seconds and memory for nothing); else (a tokenizer
        that drops much of it, e.g. BERT's whitespace) the whole text is tokenized."""
        limit = self.max_prompt_chars
        if len(text) > limit:
            head = self.tokenizer.encode(text[:limit], add_special_tokens=False)
            if len(head) > self.max_model_len + PREFIX_CUT_MARGIN:
                raise ValueError(
                    f"the prompt has {len(text):,} characters, and its first {limit:,} alone are {len(head):,} "
                    f"tokens: more than this model's context of {self.max_model_len} tokens. Please reduce the "
                    "length of the prompt."
                )
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token of the vocabulary in characters of its stored form, which is never shorter than the
        text it stands for (a byte-level token has a character per byte, `<0x0A>` six for one)."""
        try:
            vocab = self.tokenizer.get_vocab()
        except (AttributeError, NotImplementedError):
            vocab = None
        return max(16, max(map(len, vocab), default=0)) if vocab else 1024

    @property
    def max_prompt_chars(self) -> int:
        """The characters that `max_model_len` tokens of the longest kind would take, doubled: a prompt longer than
        this is checked on its head before it is tokenized whole (`tokenize`)."""
        return 2 * self.max_model_len * self.max_token_chars

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        content_format: str = "auto",
    ) -> str:
        """The prompt text of `messages` through the chat template (`chat_template` instead of the model's own).
        `documents` and each `chat_template_kwargs` entry become the template's variables, as in vLLM (e.g. Qwen3's
        `enable_thinking`); a key that names one of the renderer's own arguments is a ValueError. `content_format`
        (vLLM's --chat-template-content-format): a message's content reaches the template as one string ("string",
        and "auto") or as a list of {"type": "text", "text"} parts ("openai")."""
        if content_format not in CONTENT_FORMATS:
            raise ValueError(f"content_format must be one of {', '.join(CONTENT_FORMATS)}, got {content_format!r}")
        extra = check_chat_template_kwargs(chat_template_kwargs)
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                "this model has no chat template (a base model's file carries none): give one (`--chat-template` "
                "when serving, `chat_template=` offline), or send plain prompts (/v1/completions, LLM.generate)"
            )
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts, got {messages!r:.120}")
        flat = [_flatten_content(m, content_format == "openai") for m in messages]
        try:
            return self.tokenizer.apply_chat_template(
                flat,
                tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
                tools=tools,
                documents=documents,
                **extra,
            )
        except (TypeError, KeyError, AttributeError, IndexError) as e:  # the template's own code failed on them
            hint = " (--chat-template-content-format openai gives content as a list of parts)"
            raise ValueError(
                f"the chat template could not render these messages: {type(e).__name__}: {e}"
                + (hint if content_format == "openai" else "")
            ) from e

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        add_special_tokens: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> tuple[str | None, EngineCoreRequest]:
        """Tokenize and validate; returns (prompt text if any, the request). A PoolingParams makes a pooling request
        (`process_pooling`). `lora_request`: the adapter it runs with (--enable-lora)."""
        if lora_request is not None:
            self.verify_lora(lora_request)
            if isinstance(params, PoolingParams):
                raise ValueError("lora_request: pooling requests run on the base model only")
        if isinstance(params, PoolingParams):
            return self.process_pooling(request_id, prompt, params, arrival_time, priority, add_special_tokens)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if self.model_config.runner == "pooling":
            raise ValueError(
                f"model {self.model_config.served_model_name!r} runs as a pooling model (--runner pooling): it does "
                "not generate text; use embeddings, classification or scores"
            )
        text, ids = parse_prompt(prompt)
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {salt!r:.80}")
        if ids is None:
            ids = self.tokenize(text, add_special_tokens)  # type: ignore[arg-type]
        if params.truncate_prompt_tokens is not None:
            text, ids = self.truncate_prompt(text, ids, params.truncate_prompt_tokens)
        if params.bad_words and params.bad_words_token_ids is None:
            params = params.clone(bad_words_token_ids=self.bad_words_token_ids(params.bad_words))
        if self.end_token_ids and not params.ignore_eos:
            stops = params.stop_token_ids or []
            more = [t for t in self.end_token_ids if t not in stops]
            if more:
                params = params.clone(stop_token_ids=[*stops, *more])
        self.validate(ids, params)  # also the bad words' ids: an added token may lie past the model's vocabulary
        req = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=int(priority),
            lora_request=lora_request,
            cache_salt=salt,
        )
        return text, req

    def truncate_prompt(self, text: str | None, ids: list[int], keep: int) -> tuple[str | None, list[int]]:
        """The prompt's last `keep` tokens (-1: the last max_model_len), as vLLM's truncate_prompt_tokens: a prompt
        longer than the context keeps its end, where the question usually is. The text goes once tokens are
        dropped (it no longer says what the ids say)."""
        keep = self.max_model_len if keep == -1 else keep
        return (text, ids) if len(ids) <= keep else (None, ids[-keep:])

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """The token sequences of `bad_words`: each word as it would open the text and, where that differs, as it
        would follow a space. (vLLM keeps the second form only when it has as many tokens as the first: a word that
        is two tokens alone and one after a space, " Gutenberg" in SmolLM2's vocabulary, would get through.)"""
        seqs: list[list[int]] = []
        for word in words:
            bare = word.lstrip()
            first = list(self.tokenizer.encode(bare, add_special_tokens=False))
            if not first:
                continue
            seqs.append(first)
            spaced = list(self.tokenizer.encode(" " + bare, add_special_tokens=False))
            if spaced and spaced != first:
                seqs.append(spaced)
        return seqs

    def verify_lora(self, lora_request: object) -> None:
        """ValueError unless `lora_request` is a LoRARequest and this engine serves adapters."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if not self.lora_enabled:
            raise ValueError(f"lora_request {lora_request.lora_name!r}: this engine was started without --enable-lora")

    def process_pooling(
        self,
        request_id: str,
        prompt: PromptType,
        params: PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        add_special_tokens: bool = True,
    ) -> tuple[str | None, EngineCoreRequest]:
        """A pooling request: `params.task` checked against what the model serves, unset fields from its pooler
        config; the prompt tokenized (lower-cased first where the sentence-transformers folder says so) and cut by
        `truncate_prompt_tokens` (text: the tokenizer's right truncation, special tokens kept; token ids: the last k,
        as vLLM), else refused when longer than max_model_len."""
        mc = self.model_config
        params = self.verify_pooling(params)
        text, ids = parse_prompt(prompt)
        limit = params.truncate_prompt_tokens
        if limit == -1:
            limit = self.max_model_len
        if limit is not None and limit > self.max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens value ({limit}) is greater than max_model_len ({self.max_model_len}). "
                "Please, select a smaller truncation size."
            )
        if ids is None:
            assert text is not None
            source = text.lower() if mc.do_lower_case else text
            if limit is None:
                ids = self.tokenize(source, add_special_tokens)
            else:
                enc = self.tokenizer(source, add_special_tokens=add_special_tokens, truncation=True, max_length=limit)
                ids = list(enc["input_ids"])
        elif limit is not None:
            ids = ids[-limit:]
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(ids)} tokens in the input for {_TASK_WORDS[params.task]}. Please reduce the length of the "
                "input, or set truncate_prompt_tokens."
            )
        self.validate(ids, _POOLING_PLACEHOLDER)
        req = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling_params=_POOLING_PLACEHOLDER,
            eos_token_id=None,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=int(priority),
            pooling_params=params,
        )
        return text, req

    def verify_pooling(self, params: PoolingParams) -> PoolingParams:
        """`params` for this model: a task it serves (ValueError naming the runner otherwise), defaults filled."""
        mc = self.model_config
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
        if mc.runner != "pooling":
            raise ValueError(
                f"model {mc.served_model_name!r} runs as a generative model (--runner generate): it does not serve "
                f"{params.task or 'pooling'} requests; start it with --runner pooling (a causal LM: --convert embed)"
            )
        task = params.task or mc.pooling_tasks[0]
        if task not in mc.pooling_tasks:
            raise ValueError(
                f"model {mc.served_model_name!r} (--runner pooling) does not serve the {task} task; it serves "
                f"{', '.join(mc.pooling_tasks)}"
            )
        return params.verify(task, mc.pooler_config, mc.served_model_name)

    def encode_pair(self, text_1: str, text_2: str, truncate: int | None = None) -> tuple[list[int], int | None]:
        """A cross-encoder's input for a pair: the tokenizer's pair encoding ([CLS] a [SEP] b [SEP] for BERT) and the
        position where token type 1 starts (None: the tokenizer gives one type, e.g. XLM-RoBERTa), truncated
        longest-first to `truncate` (or max_model_len)."""
        mc = self.model_config
        if mc.do_lower_case:
            text_1, text_2 = text_1.lower(), text_2.lower()
        limit = self.max_model_len if truncate in (None, -1) else truncate
        enc = self.tokenizer(text_1, text_2, truncation=True, max_length=limit)
        ids = list(enc["input_ids"])
        types = enc.get("token_type_ids")
        split = types.index(1) if types and 1 in types else None
        return ids, split

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt length {len(ids)} exceeds max_model_len {self.max_model_len}")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of the vocabulary [0, {self.vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name)
            if n is not None and n > self.max_logprobs:
                raise ValueError(f"{name}={n} exceeds the maximum of {self.max_logprobs} (--max-logprobs)")
        for name in ("logit_bias", "stop_token_ids", "allowed_token_ids"):
            for tok in getattr(params, name) or ():
                if not 0 <= tok < self.vocab_size:
                    raise ValueError(f"token id {tok} in {name} is out of the vocabulary [0, {self.vocab_size})")
        for seq in params.bad_words_token_ids or ():
            if not all(0 <= tok < self.vocab_size for tok in seq):
                raise ValueError(f"bad_words_token_ids {seq!r:.80} has a token id out of the vocabulary")
        if params.allowed_token_ids:
            # Every step must leave some id to sample: not all of them banned outright (one-token bad words), nor,
            # before min_tokens, all of them ends the request may not take yet.
            allowed = set(params.allowed_token_ids)
            banned = {seq[0] for seq in params.bad_words_token_ids or () if len(seq) == 1}
            if allowed <= banned:
                raise ValueError("allowed_token_ids: every allowed id is a bad word (bad_words)")
            ends = set(params.stop_token_ids or ())
            if self.eos_token_id is not None and not params.ignore_eos:
                ends.add(self.eos_token_id)
            if params.min_tokens > 0 and allowed <= ends:
                raise ValueError("allowed_token_ids: every allowed id ends the request, which min_tokens forbids")
        if params.structured_outputs is not None:
            # The constraint's syntax, checked here without a tokenizer: a bad schema is the caller's error
            # (a 400), found before the request reaches an engine.
            from pagedllm.structured_output import validate_structured_outputs

            validate_structured_outputs(params.structured_outputs)


# The renderer's own arguments (transformers' apply_chat_template): a template variable may not take their names.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    (
        "conversation messages tools documents chat_template add_generation_prompt continue_final_message tokenize "
        "sanitize_control_tokens padding truncation max_length return_tensors return_dict return_assistant_tokens_mask "
        "tokenizer_kwargs"
    ).split()
)


def check_chat_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """`chat_template_kwargs` as the template's extra variables: a dict of string keys, none of them an argument the
    renderer takes itself (those have their own request fields); a ValueError naming the key otherwise."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"chat_template_kwargs must be an object of template variables, got {kwargs!r:.120}")
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise ValueError(
            f"chat_template_kwargs may not set {reserved[0]!r}: it is the renderer's own argument (use its own "
            "field where there is one)"
        )
    return dict(kwargs)


CONTENT_FORMATS = ("auto", "string", "openai")


def _flatten_content(message: dict[str, Any], as_parts: bool = False) -> dict[str, Any]:
    """Content given as a list of {'type': 'text', 'text': ...} parts becomes one string (`as_parts`: content
    becomes such a list, a string its one part); tool calls' arguments given as JSON text become objects."""
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(part.get("text", ""))
            elif isinstance(part, str):
                parts.append(part)
            else:
                raise ValueError(f"unsupported message content part {part!r:.80} (only text is supported)")
        content = [{"type": "text", "text": p} for p in parts] if as_parts else "".join(parts)
        message = {**message, "content": content}
    elif as_parts and isinstance(content, str):
        message = {**message, "content": [{"type": "text", "text": content}]}
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls:  # as vLLM: templates get a call's arguments as an object, not JSON text
        message = {**message, "tool_calls": [_arguments_as_object(c) for c in calls]}
    return message


def _arguments_as_object(call: Any) -> Any:
    """A tool call whose `function.arguments` is JSON text of an object, with that object instead (templates write
    it with `tojson`: JSON text would be quoted a second time, and models copy what they see)."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    if not arguments.strip():  # as vLLM: no arguments are an empty object
        return {**call, "function": {**function, "arguments": {}}}
    try:
        value = json.loads(arguments)
    except ValueError:
        return call
    if not isinstance(value, dict):
        return call
    return {**call, "function": {**function, "arguments": value}}
