"""InputProcessor: a prompt (text, token ids or a chat) -> validated `EngineCoreRequest`.

All user-input validation happens here, before anything reaches the engine core, so a rejected request
never disturbs those in flight: every problem raises `ValueError` naming the bad value.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pagedllm.config import ModelConfig
from pagedllm.engine.protocol import EngineCoreRequest
from pagedllm.sampling_params import SamplingParams

MAX_LOGPROBS = 20

PromptType = str | list[int] | dict[str, Any]


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
    def __init__(self, model_config: ModelConfig, tokenizer: Any, eos_token_id: int | None) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.vocab_size = model_config.vocab_size
        self.max_model_len = model_config.max_model_len

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; pass chat_template explicitly")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts, got {messages!r:.120}")
        return self.tokenizer.apply_chat_template(
            [_flatten_content(m) for m in messages],
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            tools=tools,
        )

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        add_special_tokens: bool = True,
    ) -> tuple[str | None, EngineCoreRequest]:
        """Tokenize and validate; returns (prompt text if any, the request)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        text, ids = parse_prompt(prompt)
        if ids is None:
            ids = self.tokenize(text, add_special_tokens)  # type: ignore[arg-type]
        self.validate(ids, params)
        req = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=int(priority),
        )
        return text, req

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
            if n is not None and n > MAX_LOGPROBS:
                raise ValueError(f"{name}={n} exceeds the maximum of {MAX_LOGPROBS}")
        for tok in list(params.logit_bias or {}) + list(params.stop_token_ids or []):
            if not 0 <= tok < self.vocab_size:
                raise ValueError(f"token id {tok} in logit_bias/stop_token_ids is out of the vocabulary")
        if params.structured_outputs is not None:
            # The constraint's syntax, checked here without a tokenizer: a bad schema is the caller's error
            # (a 400), found before the request reaches an engine.
            from pagedllm.structured_output import validate_structured_outputs

            validate_structured_outputs(params.structured_outputs)


def _flatten_content(message: dict[str, Any]) -> dict[str, Any]:
    """Content given as a list of {'type': 'text', 'text': ...} parts becomes one string."""
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
        message = {**message, "content": "".join(parts)}
    return message
