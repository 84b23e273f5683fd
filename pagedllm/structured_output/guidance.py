"""The llguidance backend (PyPI `llguidance`, the default): JSON schema, any JSON object, regex, choice, and Lark or
GBNF/EBNF grammars, compiled against the model's tokenizer; masks are computed in Rust, several rows at a time
in parallel, with the GIL released. An object schema that lists its properties allows no others unless it says so
(`close_objects`: vLLM's and llama.cpp's reading).

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


# a sibling that says something of other keys, or may bring properties of its own (which additionalProperties,
# counting only the node's own `properties`, would refuse)
_OPEN_KEYS = (
    "additionalProperties",
    "unevaluatedProperties",
    "patternProperties",
    "allOf",
    "anyOf",
    "oneOf",
    "$ref",
    "if",
    "dependentSchemas",
    "dependencies",
)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_objects(node: Any, in_all_of: bool = False) -> Any:
    """A copy of a JSON schema in which every object that lists its `properties` and says nothing of others
    allows no others (`additionalProperties: false`), as vLLM's default backend (xgrammar's strict mode) and
    llama.cpp's schema converter read such a schema; llguidance alone would let the model add keys of its own
    (a 0.5B model wrote `"required": true` into a tool's arguments). An object without `properties` stays open
    (`{"type": "object"}`: any object), and so do the parts of an `allOf`, where closing each part would refuse the
    other parts' properties, and an object beside an allOf/anyOf/oneOf/$ref/if, for the same reason. An explicit
    `additionalProperties` (true, or a schema) is kept."""
    if isinstance(node, list):
        return [close_objects(item, in_all_of) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: close_objects(sub) for name, sub in value.items()}
        elif key == "allOf" and isinstance(value, list):
            out[key] = [close_objects(sub, in_all_of=True) for sub in value]
        elif key in ("enum", "const", "default", "examples"):
            out[key] = value  # values, not schemas
        else:
            out[key] = close_objects(value)
    if isinstance(node.get("properties"), dict) and not in_all_of and not any(k in node for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def grammar_text(key: StructuredOutputKey) -> str:
    """llguidance's grammar (its JSON form) for a constraint; ValueError when it cannot be converted."""
    kind, text, whitespace = key
    if kind in ("json", "json_object"):
        schema: Any = json.loads(text) if kind == "json" else {"type": "object"}
        if not isinstance(schema, dict | bool):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        schema = close_objects(schema)
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
