"""The llguidance backend (PyPI `llguidance`, the default): JSON schema, any JSON object, regex, choice, and Lark or
GBNF/EBNF grammars, compiled against the model's tokenizer; masks are computed in Rust, several rows at a time
in parallel, with the GIL released.

`GuidanceBackend(tokenizer, vocab_size)` wraps the HF fast tokenizer once (about a second for a 49k vocabulary).
`compile` raises `ValueError` with llguidance's message when a constraint does not compile; `validate` does the same
check without a tokenizer (the front end's check). A matcher that reaches an error state while running (a token it
did not allow, which the mask prevents) makes `accept_tokens` return False and logs the error.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import llguidance
import llguidance.hf
import numpy as np

from pagedllm.structured_output.backend import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
    StructuredOutputKey,
    bitmask_words,
)

logger = logging.getLogger(__name__)


def grammar_text(key: StructuredOutputKey) -> str:
    """llguidance's grammar (its JSON form) for a constraint; ValueError when it cannot be converted."""
    kind, text, whitespace = key
    if kind in ("json", "json_object"):
        schema: Any = json.loads(text) if kind == "json" else {"type": "object"}
        if not isinstance(schema, dict | bool):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        options: dict[str, Any] = {}
        if whitespace == "any":
            options["whitespace_flexible"] = True
        elif whitespace == "none":
            options["whitespace_flexible"] = False
        else:
            options["whitespace_pattern"] = whitespace
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except ValueError as e:
            raise ValueError(f"invalid JSON schema: {e}") from None
    if kind == "regex":
        return llguidance.grammar_from("regex", text)
    if kind == "choice":
        return llguidance.grammar_from("choice", text)
    if kind == "grammar":
        # Lark as it is; GBNF/EBNF (llama.cpp's `root ::= ...`) converted to Lark by llguidance.
        fmt = "grammar" if "::=" in text else "lark"
        return llguidance.grammar_from(fmt, text)
    raise ValueError(f"unknown structured output kind {kind!r}")


def _check(grammar: str, tokenizer: llguidance.LLTokenizer | None) -> None:
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error and not error.startswith("WARNING"):
        raise ValueError(error.strip())


class GuidanceGrammar(StructuredOutputGrammar):
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        if self.matcher.consume_tokens(tokens):
            return True
        error = self.matcher.get_error()
        logger.error("request %s: structured output rejected tokens %s: %s", request_id, tokens, error)
        return False

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        target = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def validate_tokens(self, tokens: list[int]) -> int:
        return self.matcher.validate_tokens(tokens)

    def forced_tokens(self) -> list[int]:
        return self.matcher.compute_ff_tokens()


class GuidanceBackend(StructuredOutputBackend):
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self._executor = llguidance.LLExecutor()

    def compile(self, key: StructuredOutputKey) -> GuidanceGrammar:
        grammar = grammar_text(key)
        _check(grammar, self.ll_tokenizer)
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return GuidanceGrammar(matcher)

    @staticmethod
    def validate(key: StructuredOutputKey) -> None:
        try:
            _check(grammar_text(key), None)
        except ValueError:
            raise
        except Exception as e:  # whatever llguidance raises for input it cannot take is the input's fault
            raise ValueError(f"invalid structured output constraint: {e}") from None

    def fill_bitmasks(self, grammars: list[tuple[StructuredOutputGrammar, int]], bitmask: np.ndarray) -> None:
        assert bitmask.dtype == np.int32 and bitmask.flags.c_contiguous
        assert bitmask.shape[1] == bitmask_words(self.vocab_size)
        matchers = [(g.matcher, row) for g, row in grammars]  # type: ignore[attr-defined]
        self._executor.unsafe_compute_mask_ptr(matchers, bitmask.ctypes.data, bitmask.shape[1] * 4, bitmask.shape[0])

    def copy(self, grammar: GuidanceGrammar) -> GuidanceGrammar:
        """A fresh cursor on a compiled grammar (cheap: the compiled tables are shared)."""
        return GuidanceGrammar(grammar.matcher.deep_copy())
