"""Structured output in the engine core: grammars compiled off the step, and the bitmask of each step.

Contract (the seeds' step: schedule -> execute_model -> grammar bitmask -> sample_tokens(grammar_output)).
* `StructuredOutputManager.grammar_init(request)` starts compiling the request's constraint on a background thread
  (llguidance releases the GIL) and gives the request a `StructuredOutputRequest`. The scheduler keeps such a
  request out of its waiting queue (status WAITING_FOR_FSM) until `ready(request)` says its grammar is compiled;
  the batch keeps running meanwhile. A constraint that does not compile, or is not compiled within
  `compile_timeout_s` (30 s; $PAGEDLLM_GRAMMAR_COMPILE_TIMEOUT), leaves the request with an `error` instead: the
  scheduler finishes it alone, with finish reason "error".
* Compiled grammars are cached by their `StructuredOutputKey` (kind, text, whitespace; up to `CACHE_SIZE`, least
  recently used first out); each request gets its own cursor on the compiled one.
* `grammar_bitmask(requests, drafts)`: one int32 row per request that samples under a grammar this step, in the
  given order (the scheduler's), filled in parallel; None when there is none. A request verifying draft tokens
  (speculative decoding) has a row for each position: the grammar advanced through the drafts before it (then
  rolled back), its rows one after the other under its repeated id. `validate_drafts` says how many of a request's
  drafts its grammar would accept: only those are verified. The worker sets the logits of disallowed
  tokens to -inf before sampling, and the scheduler advances each grammar with the sampled tokens
  (`accept_tokens`); a grammar that admits nothing more finishes its request (finish reason "stop").
* With a reasoning parser (--reasoning-parser), a request's grammar starts when its thinking ends: at once if the
  prompt closed it, else with the tokens after the end token in the output; until then its rows are not masked.
* The tokenizer and the backend are loaded on the first constrained request, not at start-up: engines that never
  see one pay nothing.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedllm.config import grammar_compile_timeout
from pagedllm.reasoning import ReasoningParser
from pagedllm.structured_output.backend import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
    StructuredOutputKey,
    bitmask_words,
    key_of,
)
from pagedllm.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    from pagedllm.config import ModelConfig
    from pagedllm.core.request import Request

logger = logging.getLogger(__name__)

CACHE_SIZE = 256
# The start of the reason of a request finished because its compiled grammar refused a token (a bug, not bad input).
GRAMMAR_REFUSED = "the structured output grammar refused a sampled token"


@dataclass
class GrammarOutput:
    """The step's grammar constraint for the worker: `bitmask` (int32 rows of `num_words` words, as bytes) row i
    for request `req_ids[i]`."""

    req_ids: list[str]
    bitmask: bytes
    num_words: int

    def as_array(self) -> np.ndarray:
        return np.frombuffer(self.bitmask, dtype=np.int32).reshape(len(self.req_ids), self.num_words)


class StructuredOutputManager:
    def __init__(
        self, model_config: ModelConfig, compile_timeout_s: float | None = None, reasoning_parser: str | None = None
    ) -> None:
        self.model_config = model_config
        self.reasoning_parser_name = reasoning_parser
        self.reasoner: ReasoningParser | None = None
        self.compile_timeout_s = grammar_compile_timeout() if compile_timeout_s is None else compile_timeout_s
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[StructuredOutputKey, Future] = OrderedDict()
        self._bitmask = np.zeros((0, 0), dtype=np.int32)
        # Time spent filling bitmasks (the engine core's share of structured output in each step).
        self.mask_seconds = 0.0
        self.mask_steps = 0
        self.mask_rows = 0

    # ---- compiling -------------------------------------------------------------------------------

    def backend(self) -> StructuredOutputBackend:
        """The backend, built on first use (loads the tokenizer)."""
        with self._backend_lock:
            if self._backend is None:
                from pagedllm.structured_output.guidance import GuidanceBackend
                from pagedllm.tokenizer import get_tokenizer

                start = time.perf_counter()
                tokenizer = get_tokenizer(self.model_config)
                if self.reasoning_parser_name is not None:
                    self.reasoner = ReasoningParser.for_tokenizer(self.reasoning_parser_name, tokenizer)
                self._backend = GuidanceBackend(tokenizer, self.model_config.vocab_size)
                logger.info("structured output: llguidance ready in %.2f s", time.perf_counter() - start)
            return self._backend

    def _compile(self, key: StructuredOutputKey) -> StructuredOutputGrammar:
        start = time.perf_counter()
        grammar = self.backend().compile(key)
        logger.debug("grammar %s compiled in %.3f s", key[0], time.perf_counter() - start)
        return grammar

    def grammar_init(self, request: Request) -> None:
        """Start compiling the request's constraint (or take the cached one) and attach it to the request."""
        params = request.sampling_params.structured_outputs
        assert params is not None
        key = key_of(params)
        future = self._cache.get(key)
        if future is None or (future.done() and future.exception() is not None):
            future = self._pool.submit(self._compile, key)
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        request.structured_output = StructuredOutputRequest(key, future, time.monotonic() + self.compile_timeout_s)

    def ready(self, request: Request) -> bool:
        """True once the request's grammar is compiled (its cursor is then attached) or has failed (`error` set)."""
        so = request.structured_output
        assert so is not None
        if so.grammar is not None or so.error is not None:
            return True
        if not so.future.done():
            if time.monotonic() > so.deadline:
                so.error = f"the grammar was not compiled within {self.compile_timeout_s:g} s"
                return True
            return False
        try:
            so.grammar = self.backend().copy(so.future.result())
        except Exception as e:  # a constraint the front end's check let through, or a backend failure
            so.error = f"structured output could not be compiled: {e}"
            return True
        if self.reasoner is not None:
            so.reasoning_ended = self.reasoner.is_reasoning_end(request.prompt_token_ids)
        return True

    def wait_for_any(self, requests: list[Request], timeout: float) -> None:
        """Block up to `timeout` seconds until one of these requests' compiles is done (the engine has nothing else
        to do)."""
        pending = [r.structured_output.future for r in requests if r.structured_output is not None]
        if pending:
            from concurrent.futures import FIRST_COMPLETED, wait

            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    # ---- each step -------------------------------------------------------------------------------

    def grammar_bitmask(
        self, requests: list[Request], drafts: dict[str, list[int]] | None = None
    ) -> GrammarOutput | None:
        """The allowed-token rows of `requests` (each samples under its grammar this step), in their order: one
        row, or one per position of the request's drafts and one after them."""
        if not requests:
            return None
        start = time.perf_counter()
        backend = self.backend()
        words = bitmask_words(backend.vocab_size)
        drafts = drafts or {}
        num_rows = len(requests) + sum(len(drafts.get(r.request_id, ())) for r in requests)
        if self._bitmask.shape[0] < num_rows or self._bitmask.shape[1] != words:
            self._bitmask = np.zeros((max(num_rows, 16), words), dtype=np.int32)
        bitmask = self._bitmask[:num_rows]
        grammars: list[tuple[StructuredOutputGrammar, int]] = []
        req_ids: list[str] = []
        for req in requests:
            so = req.structured_output
            assert so is not None and so.grammar is not None
            row = len(req_ids)
            d = drafts.get(req.request_id, [])
            req_ids += [req.request_id] * (len(d) + 1)
            if not d:
                grammars.append((so.grammar, row))
                continue
            # Position j's row: the grammar after the first j drafts (validated: it accepts them), then back.
            so.grammar.fill_bitmask(bitmask, row)
            for j, token in enumerate(d):
                accepted = so.grammar.accept_tokens(req.request_id, [token])
                assert accepted, "a validated draft was refused"
                so.grammar.fill_bitmask(bitmask, row + j + 1)
            so.grammar.rollback(len(d))
        if grammars:
            backend.fill_bitmasks(grammars, bitmask)
        out = GrammarOutput(req_ids, bitmask.tobytes(), words)
        self.mask_seconds += time.perf_counter() - start
        self.mask_steps += 1
        self.mask_rows += num_rows
        return out

    def validate_drafts(self, request: Request, drafts: list[int]) -> int:
        """How many of the request's drafts, in order, its grammar accepts from where it is."""
        so = request.structured_output
        assert so is not None and so.grammar is not None and so.reasoning_ended
        grammar = so.grammar
        if grammar.is_terminated():
            return 0
        # Valid tokens, up to and including one that completes the grammar (nothing can follow it: not even the
        # end of sequence a complete grammar would also accept instead).
        valid = grammar.validate_tokens(drafts)
        used = 0
        while used < valid:
            grammar.accept_tokens(request.request_id, [drafts[used]])
            used += 1
            if grammar.is_terminated():
                break
        grammar.rollback(used)
        return used

    def forced_drafts(self, request: Request, limit: int) -> list[int]:
        """Up to `limit` tokens the request's grammar forces next (drafts that the step after verifies: under the
        grammar's mask they are all but certain to be accepted), [] when its next token is a choice."""
        so = request.structured_output
        if limit <= 0 or so is None or so.grammar is None or not so.reasoning_ended or so.grammar.is_terminated():
            return []
        return so.grammar.forced_tokens()[:limit]

    def stats(self) -> dict[str, float]:
        """Bitmask time so far: total seconds, steps and rows (for `pagedllm bench structured`)."""
        return {"mask_seconds": self.mask_seconds, "mask_steps": self.mask_steps, "mask_rows": self.mask_rows}

    def accept_tokens(self, request: Request, tokens: list[int]) -> bool:
        """Advance the request's grammar (while it is still thinking, only look for the end of the thinking: the
        tokens after it are the grammar's first); False if the grammar refused a token."""
        so = request.structured_output
        assert so is not None and so.grammar is not None
        if not so.reasoning_ended:
            assert self.reasoner is not None
            if self.reasoner.end_token_id not in tokens:
                return True
            so.reasoning_ended = True
            tokens = tokens[tokens.index(self.reasoner.end_token_id) + 1 :]
            if not tokens:
                return True
        ok = so.grammar.accept_tokens(request.request_id, tokens)
        if ok:
            so.num_accepted += len(tokens)
        return ok

    def is_terminated(self, request: Request) -> bool:
        so = request.structured_output
        return so is not None and so.grammar is not None and so.reasoning_ended and so.grammar.is_terminated()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def validate_structured_outputs(params: Any) -> None:
    """The front end's check of a request's constraint, without a tokenizer: ValueError naming the problem. A
    constraint that passed is remembered (the server checks it where it names the field, then the engine's input
    check runs again; clients also repeat the same schema)."""
    _validate_key(key_of(params))


@functools.lru_cache(maxsize=CACHE_SIZE)
def _validate_key(key: StructuredOutputKey) -> None:
    from pagedllm.structured_output.guidance import GuidanceBackend

    GuidanceBackend.validate(key)


__all__ = [
    "GRAMMAR_REFUSED",
    "GrammarOutput",
    "StructuredOutputManager",
    "StructuredOutputRequest",
    "validate_structured_outputs",
]
