"""SamplingParams: the user's decoding knobs, validated once at construction.

Field names and defaults follow vLLM's `SamplingParams`. It is a msgspec Struct so that it crosses the
engine-core process boundary inside `EngineCoreRequest` as msgpack, never as pickle. Every invalid value
raises `ValueError` naming the field and the value.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import msgspec

_GREEDY_EPS = 1e-5


class RequestOutputKind(enum.IntEnum):
    """How a request's outputs are reported: whole text so far, only what is new, or only the end."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A constraint on the output (vLLM's `StructuredOutputsParams`): exactly one of `json` (a JSON schema, as a
    dict or JSON text), `regex`, `choice` (the output is one of these strings), `grammar` (Lark, or GBNF/EBNF as
    llama.cpp writes them) or `json_object` (any JSON object). `disable_any_whitespace` makes JSON compact;
    `whitespace_pattern` gives the regex of the whitespace JSON may have between its tokens."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        # Types checked here: a Struct built in Python is not type-checked, and the engine core decodes strictly.
        for name, types in (
            ("json", (str, dict)),
            ("regex", (str,)),
            ("choice", (list,)),
            ("grammar", (str,)),
            ("json_object", (bool,)),
            ("whitespace_pattern", (str,)),
        ):
            value = getattr(self, name)
            if value is not None and not isinstance(value, types):
                raise ValueError(f"structured_outputs.{name} has the wrong type: {type(value).__name__}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be true or false")
        given = [
            name
            for name in ("json", "regex", "choice", "grammar", "json_object")
            if getattr(self, name) not in (None, False)
        ]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must give exactly one of json, regex, choice, grammar or json_object, got "
                + (", ".join(given) if given else "none")
            )
        import json as _json

        if isinstance(self.json, str):
            try:
                _json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        elif isinstance(self.json, dict):
            # As JSON sees it (keys as strings): the engine core decodes it strictly.
            try:
                self.json = _json.loads(_json.dumps(self.json))
            except (TypeError, ValueError) as e:
                raise ValueError(f"structured_outputs.json is not a JSON object: {e}") from None
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a list of non-empty strings, got {self.choice!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not value:
                raise ValueError(f"structured_outputs.{name} must not be empty")


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Sampling parameters for one request (vLLM-compatible names and defaults)."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    # Only these ids may be sampled (vLLM's allowed_token_ids)
    allowed_token_ids: list[int] | None = None
    # Words the output may not contain (vLLM's bad_words): each banned by its last token where the tokens before
    # it end the output. The engine fills bad_words_token_ids from them with the model's tokenizer.
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # Keep only the last N prompt tokens (-1: the last max_model_len), as vLLM's truncate_prompt_tokens
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # A streamed request's chunks gather this many generated tokens (raised to the server's --stream-interval; the
    # first and the last are sent at once)
    stream_interval: int | None = None
    # Parameters for extensions (vLLM's extra_args; the server's vllm_xargs): carried with the request, unused here
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError) as e:
                raise ValueError(f"logit_bias must map token ids to floats, got {self.logit_bias!r}") from e
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise ValueError(f"structured_outputs: {e}") from None
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputsParams or a dict, got {self.structured_outputs!r:.80}"
            )
        self._validate()
        if self.temperature < _GREEDY_EPS:
            # Greedy: the filters are meaningless, normalise them so the sampler takes its fast path.
            self.top_p = 1.0
            self.top_k = -1
            self.min_p = 0.0

    def _validate(self) -> None:
        def bad(name: str, value: Any, rule: str) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {value!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "at least 1")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", self.repetition_penalty, "greater than 0")
        if not self.temperature >= 0.0:
            raise bad("temperature", self.temperature, "non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if self.top_k < -1 or self.top_k == 0:
            raise bad("top_k", self.top_k, "-1 (disabled) or at least 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "at least 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"at most max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", self.logprobs, "non-negative")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise bad("prompt_logprobs", self.prompt_logprobs, "non-negative")
        if any(not s for s in self.stop):  # type: ignore[union-attr]
            raise bad("stop", self.stop, "a list of non-empty strings")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "an integer")
        if self.truncate_prompt_tokens is not None and (
            not isinstance(self.truncate_prompt_tokens, int) or self.truncate_prompt_tokens < -1
            or self.truncate_prompt_tokens == 0
        ):  # fmt: skip
            raise bad("truncate_prompt_tokens", self.truncate_prompt_tokens, "-1 (the context) or at least 1")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or not all(isinstance(t, int) for t in self.allowed_token_ids)
        ):
            raise bad("allowed_token_ids", self.allowed_token_ids, "a non-empty list of token ids")
        if self.stream_interval is not None and (
            isinstance(self.stream_interval, bool)
            or not isinstance(self.stream_interval, int)
            or self.stream_interval < 1
        ):
            raise bad("stream_interval", self.stream_interval, "an integer of at least 1")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise bad("extra_args", self.extra_args, "a dict")
        if self.bad_words is not None and not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise bad("bad_words", self.bad_words, "a list of non-blank strings")
        if self.bad_words_token_ids is not None and not all(
            seq and all(isinstance(t, int) for t in seq) for seq in self.bad_words_token_ids
        ):
            raise bad("bad_words_token_ids", self.bad_words_token_ids, "a list of non-empty token id lists")

    @property
    def greedy(self) -> bool:
        """True when the request samples the argmax."""
        return self.temperature < _GREEDY_EPS

    def clone(self, **changes: Any) -> SamplingParams:
        """A copy with some fields replaced (validated again)."""
        return msgspec.structs.replace(self, **changes)


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
