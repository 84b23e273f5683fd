"""`LLM.beam_search` (vLLM's): the sequences, their order and their cumulative log-probabilities are those of a
beam search written here over HF transformers' float32 logits of the same tiny model, with and without a length
penalty, with a beam ending on the end-of-sequence token (a complete sequence, its text without that token unless
asked), and for a batch of prompts at once."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, BeamSearchParams
from tests.model_utils import load_hf_model, make_tiny_model

PROMPTS = [[5, 17, 40, 9], [3, 99, 250, 11, 12, 60, 7]]


@pytest.fixture(scope="module")
def folder(tiny_model_dir) -> str:
    return make_tiny_model(tiny_model_dir, "LlamaForCausalLM", seed=4)


@pytest.fixture(scope="module")
def llm(folder):
    with LLM(folder, engine_client="inproc", kv_cache_memory_bytes="16MiB", max_model_len=256) as engine:
        yield engine


def reference(hf, prompt: list[int], width: int, steps: int, penalty: float, eos: int | None) -> list[tuple]:
    """(tokens, cumulative logprob) of the best `width` sequences, best first: the same search on HF's logits."""

    def score(tokens: list[int], cum: float) -> float:
        n = len(tokens) - (1 if eos is not None and tokens[-1] == eos else 0)
        return cum / n**penalty

    live, done = [(prompt, 0.0)], []
    for _ in range(steps):
        grown = []
        for tokens, cum in live:
            with torch.no_grad():
                logprobs = torch.log_softmax(hf(torch.tensor([tokens])).logits[0, -1].double(), -1)
            top = torch.topk(logprobs, 2 * width)
            for lp, tok in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                (done if tok == eos else grown).append(([*tokens, tok], cum + lp))
        live = sorted(grown, key=lambda b: score(*b), reverse=True)[:width]
    return sorted(done + live, key=lambda b: score(*b), reverse=True)[:width]


@pytest.mark.parametrize("penalty", [1.0, 0.5])
def test_beams_are_an_independent_search_over_hf_logits(llm, folder, penalty) -> None:
    hf = load_hf_model(folder)
    outs = llm.beam_search(
        [{"prompt_token_ids": p} for p in PROMPTS], BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=penalty)
    )
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        want = reference(hf, prompt, 3, 5, penalty, eos=None)  # no end-of-sequence token in this model's top 6
        assert [s.tokens for s in out.sequences] == [tokens for tokens, _ in want]
        for seq, (_, cum) in zip(out.sequences, want, strict=True):
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-4)
            assert seq.finish_reason == "length" and len(seq.logprobs) == 5
            assert seq.text == llm.get_tokenizer().decode(seq.tokens)  # the prompt's text included, as vLLM's


def test_a_beam_ending_on_eos_is_complete(llm, folder, monkeypatch) -> None:
    hf = load_hf_model(folder)
    prompt = PROMPTS[0]
    with torch.no_grad():
        first = int(hf(torch.tensor([prompt])).logits[0, -1].argmax())
    monkeypatch.setattr(llm.input_processor, "eos_token_id", first)  # the most likely next token ends the text
    out = llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=4))[0]
    want = reference(hf, prompt, 2, 4, 1.0, eos=first)
    assert [s.tokens for s in out.sequences] == [tokens for tokens, _ in want]
    ended = [s for s in out.sequences if s.tokens[-1] == first]
    assert ended, "the search kept no beam that ended"
    for seq in ended:
        assert seq.finish_reason == "stop" and seq.text == llm.get_tokenizer().decode(seq.tokens[:-1])
    kept = llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=4, include_stop_str_in_output=True))
    assert any(s.text == llm.get_tokenizer().decode(s.tokens) for s in kept[0].sequences if s.finish_reason == "stop")
    assert all(s.tokens[-1] != first or s.finish_reason == "length"
               for s in llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))[0]
               .sequences)  # fmt: skip


def test_bad_parameters_are_value_errors(llm) -> None:
    for kwargs, match in [
        ({"beam_width": 0, "max_tokens": 3}, "beam_width"),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
        ({"beam_width": 2, "max_tokens": 3, "temperature": -1.0}, "temperature"),
    ]:
        with pytest.raises(ValueError, match=match):
            BeamSearchParams(**kwargs)
    with pytest.raises(ValueError, match="beam_width 11 needs the top 22 .*--max-logprobs 20"):
        llm.beam_search([5, 6], BeamSearchParams(beam_width=11, max_tokens=2))
    assert llm.check_invariants()["in_use"] == 0
