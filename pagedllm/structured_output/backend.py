"""The interface every structured-output backend implements, and what the front end and the engine core share.

Contract.
* A request's constraint is one `StructuredOutputKey`: `(kind, text, whitespace)` with kind one of "json" (a JSON
  schema, as JSON text), "json_object" (any JSON object), "regex", "choice" (a JSON list of strings) or "grammar"
  (Lark, or GBNF/EBNF as llama.cpp writes them); `whitespace` is how JSON may be laid out between its tokens: "any"
  (vLLM's default), "none" (`disable_any_whitespace`: compact JSON) or a regex (`whitespace_pattern`), "" for the
  other kinds. `key_of(params)` derives it from `StructuredOutputsParams`; compiled grammars are cached by it.
* `StructuredOutputBackend.compile(key)` returns a fresh `StructuredOutputGrammar` (raising `ValueError` naming the
  problem when the constraint does not compile). `validate(key)` checks the same without a tokenizer: the front
  end calls it so that a bad schema is a 400 before the request reaches an engine.
* A grammar is a cursor over the request's output tokens: `accept_tokens` advances it (False if a token is not
  allowed: the caller then ends the request), `fill_bitmask(bitmask, row)` writes the tokens allowed next into one
  int32 row of a bitmask (bit `t % 32` of word `t // 32` set = token t allowed), `is_terminated()` says the
  grammar admits no further token (the request is complete), `rollback(n)` undoes the last n tokens.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pagedllm.sampling_params import StructuredOutputsParams

StructuredOutputKey = tuple[str, str, str]

KINDS = ("json", "json_object", "regex", "choice", "grammar")


def key_of(params: StructuredOutputsParams) -> StructuredOutputKey:
    """The (kind, text, whitespace) of a request's constraint (validated by StructuredOutputsParams already)."""
    if params.whitespace_pattern is not None:
        whitespace = params.whitespace_pattern
    else:
        whitespace = "none" if params.disable_any_whitespace else "any"
    if params.json is not None:
        text = params.json if isinstance(params.json, str) else json.dumps(params.json)
        return "json", text, whitespace
    if params.json_object:
        return "json_object", "", whitespace
    if params.regex is not None:
        return "regex", params.regex, ""
    if params.choice is not None:
        return "choice", json.dumps(list(params.choice)), ""
    assert params.grammar is not None
    return "grammar", params.grammar, ""


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row for a vocabulary of `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def allowed_tokens(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a bitmask row allows (for tests and debugging)."""
    bits = np.unpackbits(np.ascontiguousarray(row, dtype=np.int32).view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


class StructuredOutputGrammar:
    """One request's grammar state (see the module docstring)."""

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        raise NotImplementedError

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        raise NotImplementedError

    def is_terminated(self) -> bool:
        raise NotImplementedError

    def rollback(self, num_tokens: int) -> None:
        raise NotImplementedError

    def validate_tokens(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar would accept from its state (which stays as it is)."""
        raise NotImplementedError

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces from its state (the only way on: a key, a closing bracket), as the tokenizer
        would write them; [] when the next token is a choice. A backend that cannot tell returns []."""
        return []


class StructuredOutputBackend:
    """Compiles constraints into grammars for one tokenizer and vocabulary size."""

    vocab_size: int

    def compile(self, key: StructuredOutputKey) -> StructuredOutputGrammar:
        raise NotImplementedError

    def copy(self, grammar: StructuredOutputGrammar) -> StructuredOutputGrammar:
        """A fresh cursor on a compiled grammar (`compile`'s result is kept as a prototype and cached)."""
        raise NotImplementedError

    @staticmethod
    def validate(key: StructuredOutputKey) -> None:
        raise NotImplementedError

    def fill_bitmasks(self, grammars: list[tuple[StructuredOutputGrammar, int]], bitmask: np.ndarray) -> None:
        """Fill row `row` of `bitmask` for each (grammar, row); backends may do it in parallel."""
        for grammar, row in grammars:
            grammar.fill_bitmask(bitmask, row)
