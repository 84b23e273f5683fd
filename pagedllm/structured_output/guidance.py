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
_VALUES = ("enum", "const", "default", "examples")  # values, not schemas


def close_objects(schema: Any) -> Any:
    """A copy of a JSON schema in which every object that lists its `properties` and says nothing of others
    allows no others (`additionalProperties: false`), as vLLM's default backend (xgrammar's strict mode) and
    llama.cpp's schema converter read such a schema; llguidance alone would let the model add keys of its own
    (a 0.5B model wrote `"required": true` into a tool's arguments).

    Only what cannot join another schema's properties is closed. Open stay: an object without `properties` (`{"type":
    "object"}`: any object); one with an explicit `additionalProperties` (true, or a schema) or `patternProperties`;
    one that requires a key it does not list; one beside an allOf/anyOf/oneOf/$ref/if; every part of an `allOf`;
    the branches of an anyOf/oneOf whose node has properties of its own or is itself such a part; and what a `$ref`
    of any of those points to (found by JSON pointer, again for what that target refers to). A branch of a plain
    anyOf (a union of shapes) and the target of a plain `$ref` are closed."""
    merged: set[str] = set()
    for _ in range(64):  # each round may find targets that the last round's open targets refer to
        refs: set[str] = set()
        out = _close(schema, "#", False, merged, refs)
        if refs <= merged:
            return out
        merged |= refs
    return schema  # a chain of references too long to follow: the schema as given


def _pointer(path: str, key: str | int) -> str:
    return f"{path}/{str(key).replace('~', '~0').replace('/', '~1')}"


def _close(node: Any, path: str, part: bool, merged: set[str], refs: set[str]) -> Any:
    """close_objects on `node` at JSON pointer `path`; `part`: it joins other schemas' properties. Adds to `refs`
    the references made where their targets join others."""
    if isinstance(node, list):
        return [_close(item, _pointer(path, i), part, merged, refs) for i, item in enumerate(node)]
    if not isinstance(node, dict):
        return node
    part = part or path in merged
    # what the node's branches and reference join: its own properties, its other compositions, what it joins
    joins = part or "properties" in node or sum(k in node for k in ("allOf", "anyOf", "oneOf", "$ref")) > 1
    if joins and isinstance(node.get("$ref"), str):
        refs.add(node["$ref"])
    out: dict[str, Any] = {}
    for key, value in node.items():
        at = _pointer(path, key)
        if key in _VALUES:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _close(sub, _pointer(at, name), False, merged, refs) for name, sub in value.items()}
        elif key in ("allOf", "anyOf", "oneOf") and isinstance(value, list):
            out[key] = _close(value, at, key == "allOf" or joins, merged, refs)
        else:
            out[key] = _close(value, at, False, merged, refs)
    props, required = node.get("properties"), node.get("required")
    if isinstance(props, dict) and not part and not any(k in node for k in _OPEN_KEYS):
        if not isinstance(required, list) or all(name in props for name in required if isinstance(name, str)):
            out["additionalProperties"] = False
    return out


def grammar_text(key: StructuredOutputKey) -> str:
    """llguidance's grammar (its JSON form) for a constraint; ValueError when it cannot be converted."""
    kind, text, whitespace = key
    if kind in ("json", "json_object"):
        schema: Any = json.loads(text) if kind == "json" else {"type": "object"}
        if not isinstance(schema, dict | bool):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        try:
            schema = close_objects(schema)
        except RecursionError:
            raise ValueError("invalid JSON schema: nested too deeply") from None
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
