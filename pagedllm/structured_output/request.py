"""StructuredOutputRequest: what a constrained request carries in the engine core (kept apart from the manager so
that core/request.py can name it without importing the manager, which names Request)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from pagedllm.structured_output.backend import StructuredOutputGrammar, StructuredOutputKey


@dataclass
class StructuredOutputRequest:
    """A request's constraint: its key, the compile in flight, then its own grammar cursor (or an error)."""

    key: StructuredOutputKey
    future: Future
    deadline: float
    grammar: StructuredOutputGrammar | None = None
    error: str | None = None
    num_accepted: int = 0
    # False while the model is still thinking (a reasoning parser is set): the grammar starts after its end token.
    reasoning_ended: bool = True
