"""Incremental detokenization and stop strings for one sequence.

Contract (the output processor relies on exactly this):

* One `IncrementalDetokenizer(tokenizer, prompt_token_ids, params)` per generated sequence. Every batch
  of newly sampled ids goes through `update(new_token_ids, stop_terminated)`, in order; the text to report
  comes from `get_next_output_text(finished, delta)`.
* `output_token_ids` holds every id given to `update`, including a terminating eos/stop token and any
  ids after a matched stop string in the same batch (token ids are never truncated, only text is).
* `output_text` only grows, except once: when a stop string matches, it is truncated before the stop string
  (or right after it with `include_stop_str_in_output`) and `update` returns that stop string. The caller
  must then finish the sequence (finish reason "stop", stop reason = that string).
* Stop-string search covers the text added by this `update` plus the last `len(stop) - 1` characters
  before it, so a stop string split across updates is found. With several stop strings, the match that
  ends first wins (the one a character-by-character check would have hit first); on a tie, the one that
  starts first. A stop string must end in text produced after the first `min_tokens` generated tokens.
* `stop_terminated=True` means the last id of `new_token_ids` is the eos or a `stop_token_ids` token: it
  is not decoded at all unless `include_stop_str_in_output` (vLLM semantics). Stop strings are still
  searched in the text of the other ids of the batch; if one matches, the eos text is never added.
* No U+FFFD for an incomplete character: the bytes of a partial UTF-8 character (byte-level BPE, or
  SentencePiece byte fallback) stay inside the decoder until the character completes. If generation ends
  first they are dropped, so the final text can differ from `tokenizer.decode(ids)` only by that trailing
  U+FFFD.
* Hold-back: while not finished, `get_next_output_text` withholds the last `max(len(stop)) - 1` characters
  (a stop string may be starting there) unless `include_stop_str_in_output`; once finished it returns
  everything. `delta=True` returns only text not returned by an earlier delta call.
* `params.detokenize=False`: ids are tracked, `output_text` stays "" and stop strings never match.

Fast tokenizers (those with a `tokenizers` backend) decode with `tokenizers.decoders.DecodeStream`; other
tokenizers use the classic prefix/read offset method over `convert_ids_to_tokens` /
`convert_tokens_to_string`. Both start from a few prompt tokens of context, because how a token decodes
can depend on the one before it (SentencePiece drops the leading space of the first token of a text).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    AnyTokenizer = PreTrainedTokenizerBase | Tokenizer

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as decoding context: enough for every decoder we know of (they look one token back).
_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes, so at most 4 byte tokens: bounds the searches for a char boundary.
_MAX_CHAR_TOKENS = 4

T = TypeVar("T")


def _context_start(seq: Sequence[T], to_text: Callable[[Sequence[T]], str]) -> int:
    """Index where a context window of about `_CONTEXT_TOKENS` items ending at `seq`'s end may start.

    The window is moved back (a few items at most) so that it does not start in the middle of a
    character: a window starting with a continuation byte decodes to a leading U+FFFD.
    """
    start = max(0, len(seq) - _CONTEXT_TOKENS)
    for s in range(start, max(-1, start - _MAX_CHAR_TOKENS - 1), -1):
        if not to_text(seq[s:]).startswith(_REPLACEMENT_CHAR):
            return s
    return start  # genuinely invalid bytes: any start is as good as another


def _complete_len(seq: Sequence[T], to_text: Callable[[Sequence[T]], str]) -> int:
    """Length of the longest prefix of `seq` whose text does not end in an incomplete character."""
    for k in range(len(seq), max(-1, len(seq) - _MAX_CHAR_TOKENS - 1), -1):
        if k == 0 or not to_text(seq[:k]).endswith(_REPLACEMENT_CHAR):
            return k
    return len(seq)  # more trailing U+FFFD than one character can explain: invalid bytes, not pending


class _Decoder(Protocol):
    def step(self, token_id: int) -> str:
        """Text that `token_id` completes ("" while a character is still incomplete)."""
        ...


class _StreamDecoder:
    """Fast-tokenizer path: `tokenizers.decoders.DecodeStream` with prompt context."""

    def __init__(
        self,
        backend: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
    ) -> None:
        self._backend = backend
        self._skip = skip_special_tokens
        # Recent ids (prompt tail, then generated), to rebuild the stream if it ever fails.
        self._history: list[int] = list(prompt_token_ids[-(_CONTEXT_TOKENS + _MAX_CHAR_TOKENS) :])
        self._stream = self._new_stream(self._history)
        # spaces_between_special_tokens=False: decoders that join tokens with spaces (WordPiece, ...) would
        # put one between two added tokens; emit an added token's raw content after another added token.
        # Byte-level decoders never add such spaces, and skipped special tokens have no text at all.
        self._added: dict[int, str] = {}
        if not spaces_between_special_tokens and not skip_special_tokens:
            self._added = {tid: tok.content for tid, tok in backend.get_added_tokens_decoder().items()}
        # A special token ending the prompt counts: no separator between it and a special first output.
        self._last_was_added = bool(prompt_token_ids) and prompt_token_ids[-1] in self._added

    def _to_text(self, ids: Sequence[int]) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=self._skip)

    def _new_stream(self, context: Sequence[int]) -> DecodeStream:
        """A stream whose state already holds `context`, so its text is never emitted again."""
        context = list(context[_context_start(context, self._to_text) :])
        k = _complete_len(context, self._to_text)
        # DecodeStream(ids=...) treats the decoded ids as already emitted, but only if their text is
        # complete: with a trailing partial character it would re-emit all of it with the next token. So
        # prefill the complete part, then step the bytes of the unfinished character (each step returns
        # None): the rest of that character comes out with the first generated token, as in generation.
        stream = DecodeStream(ids=context[:k], skip_special_tokens=self._skip)
        for tid in context[k:]:
            stream.step(self._backend, tid)
        return stream

    def step(self, token_id: int) -> str:
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception:
            # DecodeStream raises "Invalid prefix encountered" when a decoder's text for the longer window
            # does not extend the shorter one's (seen with odd byte sequences; vLLM issue 17448), and its
            # state is then unusable. Rebuild it from recent context and retry once.
            self._stream = self._new_stream(self._history)
            text = self._stream.step(self._backend, token_id)
        self._history.append(token_id)
        if len(self._history) > 4 * _CONTEXT_TOKENS:
            del self._history[: -2 * _CONTEXT_TOKENS]
        if self._added:
            content = self._added.get(token_id)
            if content is not None and self._last_was_added:
                text = content
            self._last_was_added = content is not None
        return text or ""


class _OffsetDecoder:
    """Slow-tokenizer path: decode a short token window and emit what it adds beyond the read offset.

    `_tokens[_prefix_offset:_read_offset]` is already-emitted context; the text of
    `_tokens[_prefix_offset:]` minus the context's text is new, unless it ends in U+FFFD (an incomplete
    character: wait for more tokens, never emit the replacement character).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
    ) -> None:
        self._tokenizer = tokenizer
        # all_special_ids is a computed property on some tokenizers: look it up once, not per token.
        self._skip_ids: frozenset[int] = frozenset(tokenizer.all_special_ids if skip_special_tokens else ())
        # spaces_between_special_tokens=False: no separator between two consecutive added tokens, as on the
        # fast path: the token list is converted in segments split exactly there, and the segments glued.
        self._added_tokens: frozenset[str] = frozenset()
        if not spaces_between_special_tokens and not skip_special_tokens:
            self._added_tokens = frozenset(tokenizer.get_added_vocab())
        tail = [t for t in prompt_token_ids[-(_CONTEXT_TOKENS + _MAX_CHAR_TOKENS) :] if t not in self._skip_ids]
        tokens = list(tokenizer.convert_ids_to_tokens(tail))
        self._tokens: list[str] = tokens[_context_start(tokens, self._to_string) :]
        self._prefix_offset = 0
        # Bytes of a character the prompt leaves unfinished count as unread: they come out (completed)
        # with the first generated token instead of being lost or shown as U+FFFD.
        self._read_offset = _complete_len(self._tokens, self._to_string)

    def _to_string(self, tokens: Sequence[str]) -> str:
        if not tokens:
            return ""
        if not self._added_tokens:
            return self._tokenizer.convert_tokens_to_string(list(tokens))
        parts: list[str] = []
        segment: list[str] = [tokens[0]]
        for prev, tok in zip(tokens, tokens[1:]):
            if prev in self._added_tokens and tok in self._added_tokens:
                parts.append(self._tokenizer.convert_tokens_to_string(segment))
                segment = []
            segment.append(tok)
        parts.append(self._tokenizer.convert_tokens_to_string(segment))
        return "".join(parts)

    def step(self, token_id: int) -> str:
        if token_id in self._skip_ids:
            return ""  # a skipped special token has no text and must not disturb the window
        self._tokens.extend(self._tokenizer.convert_ids_to_tokens([token_id]))
        prefix_text = self._to_string(self._tokens[self._prefix_offset : self._read_offset])
        full_text = self._to_string(self._tokens[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""
        new_text = full_text[len(prefix_text) :]
        # The tokens just emitted become the context of the next step; older ones are not needed.
        del self._tokens[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        return new_text


def _make_decoder(tokenizer: AnyTokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> _Decoder:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and isinstance(tokenizer, Tokenizer):
        backend = tokenizer
    if isinstance(backend, Tokenizer):
        return _StreamDecoder(
            backend, prompt_token_ids, params.skip_special_tokens, params.spaces_between_special_tokens
        )
    return _OffsetDecoder(tokenizer, prompt_token_ids, params.skip_special_tokens, params.spaces_between_special_tokens)


class IncrementalDetokenizer:
    """Token ids in, text and stop-string detection out, for one sequence (see the module docstring)."""

    def __init__(self, tokenizer: AnyTokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.output_text: str = ""
        self.output_token_ids: list[int] = []
        self._decoder: _Decoder | None = None
        self._stop: list[str] = []
        if params.detokenize:
            self._decoder = _make_decoder(tokenizer, prompt_token_ids, params)
            self._stop = list(params.stop or [])
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        # Characters that may be the start of a stop string must not be reported yet: once reported they
        # could not be taken back if the stop string completes (and is cut) in a later update.
        self._hold_back = 0
        if self._stop and not self._include_stop:
            self._hold_back = max(len(s) for s in self._stop) - 1
        self._delta_offset = 0  # characters of output_text already returned by delta calls

    @classmethod
    def from_params(
        cls, tokenizer: AnyTokenizer, prompt_token_ids: list[int], params: SamplingParams
    ) -> IncrementalDetokenizer:
        """Same as the constructor (kept for call sites that prefer a factory)."""
        return cls(tokenizer, prompt_token_ids, params)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Append `new_token_ids`; return the stop string that matched (text then truncated), else None.

        `stop_terminated=True`: the last id is an eos/stop token whose text is only added with
        `include_stop_str_in_output` (and only if no stop string matched first).
        """
        if not new_token_ids:
            return None
        if self._decoder is None:
            self.output_token_ids.extend(new_token_ids)
            return None
        text_ids = new_token_ids[:-1] if stop_terminated else new_token_ids
        # Text before this offset was searched already (or is protected by min_tokens).
        search_from = len(self.output_text)
        for tid in text_ids:
            self.output_token_ids.append(tid)
            self.output_text += self._decoder.step(tid)
            if len(self.output_token_ids) <= self._min_tokens:
                search_from = len(self.output_text)
        stop_str = self._find_stop_string(search_from)
        if stop_terminated:
            eos_id = new_token_ids[-1]
            self.output_token_ids.append(eos_id)
            if stop_str is None and self._include_stop:
                self.output_text += self._decoder.step(eos_id)
        return stop_str

    def _find_stop_string(self, search_from: int) -> str | None:
        """Find a stop string ending after `search_from`, truncate the text at it and return it."""
        if not self._stop or len(self.output_text) <= search_from:
            return None
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self._stop:
            # Starting len(stop) - 1 characters back finds a stop string straddling the old/new boundary;
            # anything ending at or before search_from was searched by an earlier update.
            start = self.output_text.find(stop, max(0, search_from - len(stop) + 1))
            if start != -1:
                candidate = (start + len(stop), start, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        if best is None:
            return None
        end, start, stop = best
        self.output_text = self.output_text[: end if self._include_stop else start]
        return stop

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to report now: all of it (or, with `delta`, what is new) minus the hold-back if unfinished."""
        end = len(self.output_text)
        if not finished:
            end = max(0, end - self._hold_back)
        if not delta:
            return self.output_text[:end]
        if end <= self._delta_offset:
            return ""
        text = self.output_text[self._delta_offset : end]
        self._delta_offset = end
        return text
