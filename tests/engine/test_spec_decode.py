"""Speculative decoding (n-gram) end to end on the default model (SmolLM2 Q4_1 GGUF, run as stored).

* Greedy output is identical with and without speculation, token for token and logprob for logprob, one request at a
  time, over prompts whose answer repeats their input (drafts are proposed and accepted: checked) and prompts whose
  answer does not. That holds because the fused decoder computes each of a request's verified tokens exactly as a
  lone decode step would (checked directly, bit for bit, on the model's own weights and KV cache), and so it does
  the tokens of several requests sharing a step.
* Sampling keeps working: seeded requests are reproducible, `n > 1`, logprobs of every output token, `max_tokens`
  never exceeded, stop strings, and several requests sharing steps with drafts.
* Bad words and allowed ids: drafts that would complete a banned word are rejected there; the plain engine's
  tokens, without the words.
* Structured output: drafts are verified under the grammar (only those it accepts, a mask row per position, the
  grammar advanced by the tokens output): the same JSON, token for token, as without speculation, drafts accepted.
* Prefix caching after rejected drafts: a prompt extending an earlier request's prompt and output hits the cache
  on that output's blocks (drafts verified there, some rejected) and gets the plain engine's tokens and logprobs.
* After all of it the KV cache holds no blocks and its invariants hold.
"""

from __future__ import annotations

import json

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams
from tests.model_utils import check_fused_rows_are_lone_tokens

ENGINE = {"engine_client": "inproc", "kv_cache_memory_bytes": "128MiB", "max_model_len": 1024}
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}

QUOTE = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based ink and a wooden press adapted from those used to make wine. Before his invention, books "
    "in Europe were copied by hand, usually by monks, and a single Bible could take years to finish."
)
REPEATING = [
    "<|im_start|>user\nCopy this text exactly:\n\n" + QUOTE + "<|im_end|>\n<|im_start|>assistant\n",
    'Here is a quote:\n\n"' + QUOTE + '"\n\nThe same quote again:\n\n"',
]
NOT_REPEATING = [
    "The capital of France is",
    "<|im_start|>user\nName three planets and one fact about each.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def plain():
    llm = LLM(**ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def spec():
    llm = LLM(speculative_config=SPEC, **ENGINE)
    yield llm
    llm.shutdown()


def _core(llm: LLM):
    return llm.engine_core.engine_core


def _one_at_a_time(llm: LLM, prompts: list[str], params: SamplingParams):
    return [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]


def test_greedy_output_and_logprobs_identical(plain: LLM, spec: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=80, logprobs=2)
    stats = _core(spec).scheduler.total_spec_stats
    before = stats.num_accepted_tokens
    want = _one_at_a_time(plain, REPEATING + NOT_REPEATING, params)
    got = _one_at_a_time(spec, REPEATING + NOT_REPEATING, params)
    for w, g in zip(want, got):
        assert list(g.token_ids) == list(w.token_ids)
        assert g.text == w.text
        assert g.logprobs == w.logprobs  # the same numbers: every token computed as a lone decode step
    # Not vacuous: drafts were verified and most of them accepted on the repeating prompts.
    assert stats.num_accepted_tokens - before > 40
    assert stats.num_drafts > 0 and sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens


@pytest.mark.parametrize("requests", [[(37, 5)], [(37, 1), (12, 3), (70, 1), (5, 2)]], ids=["one", "several"])
def test_fused_decoder_rows_are_lone_tokens(spec: LLM, requests: list[tuple[int, int]]) -> None:
    """A decode step's tokens through the fused decoder at once: five consecutive tokens of one request (a token and
    its drafts), or the tokens of several requests, each with its own context and block table (some verifying
    drafts). The same hidden states and KV cache contents, bit for bit, as one-token calls one at a time (the
    quantized weights' int8 products, shared weight decoding for several rows, each row's attention over its own
    request's blocks)."""
    check_fused_rows_are_lone_tokens(spec, requests)


def test_sampling_with_drafts(plain: LLM, spec: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A seeded request's t-th token comes from its draw at (seed, t), drafts or not: the same tokens as
    without speculation (and so the same on every run, whatever drafts the policy chose). The policy, which
    weighs drafts against measured step times (slower on a busy machine), is told to propose at every step here,
    so that drafts are verified whatever the machine's load."""
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=48, ignore_eos=True, logprobs=1)
    scheduler = _core(spec).scheduler
    monkeypatch.setattr(scheduler.draft_policy, "num_to_propose", lambda req_id, batch: SPEC["num_speculative_tokens"])
    stats = scheduler.total_spec_stats
    before = stats.num_accepted_tokens
    want = plain.generate([REPEATING[1]], seeded, use_tqdm=False)[0].outputs[0]
    a = spec.generate([REPEATING[1]], seeded, use_tqdm=False)[0].outputs[0]
    assert stats.num_accepted_tokens > before  # sampled tokens were accepted drafts
    assert list(a.token_ids) == list(want.token_ids)
    assert a.logprobs == want.logprobs
    assert len(a.token_ids) == 48  # max_tokens exactly, never more, though a step may accept several tokens
    assert len(a.logprobs) == 48
    for token, entry in zip(a.token_ids, a.logprobs):
        assert token in entry
    many = spec.generate(
        [REPEATING[0]], SamplingParams(temperature=1.0, n=3, max_tokens=30, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(many.outputs) == 3 and all(len(o.token_ids) == 30 for o in many.outputs)


def test_stop_and_max_tokens_with_drafts(plain: LLM, spec: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=60)
    full = _one_at_a_time(plain, REPEATING[:1], greedy)[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 6]
    assert stop.strip()
    for max_tokens in (1, 2, 7):
        out = _one_at_a_time(spec, REPEATING[:1], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
        assert len(out.token_ids) == max_tokens
    stopped = SamplingParams(temperature=0.0, max_tokens=60, stop=[stop], logprobs=1)
    out = _one_at_a_time(spec, REPEATING[:1], stopped)[0]
    assert out.text == full[: full.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    want = _one_at_a_time(plain, REPEATING[:1], stopped)[0]  # the tokens end where the stop string did
    assert list(out.token_ids) == list(want.token_ids) and out.logprobs == want.logprobs


def test_batch_with_drafts_completes_and_frees_blocks(spec: LLM) -> None:
    prompts = REPEATING + NOT_REPEATING
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.7, seed=i, max_tokens=40 + 5 * i) for i in range(4)]
    outs = spec.generate(prompts, params, use_tqdm=False)
    for out, p in zip(outs, params):
        o = out.outputs[0]
        assert 0 < len(o.token_ids) <= p.max_tokens
        assert o.finish_reason in ("stop", "length")
    manager = _core(spec).scheduler.kv_cache_manager
    manager.check_invariants()
    assert manager.num_blocks_in_use() == 0


def test_bad_words_and_allowed_ids_with_drafts(plain: LLM, spec: LLM) -> None:
    """Drafts that would write a banned word are rejected where its last token comes (each position sees the
    drafts before it as output): the plain engine's tokens, without the words; allowed ids likewise."""
    tok = plain.get_tokenizer()
    words = ["Gutenberg", "wooden press"]
    assert len(tok.encode(" wooden press", add_special_tokens=False)) > 1  # banned by its last token, after the rest
    banned = SamplingParams(temperature=0.0, max_tokens=60, bad_words=words)
    stats = _core(spec).scheduler.total_spec_stats
    before = stats.num_drafts
    want = _one_at_a_time(plain, REPEATING[1:], banned)
    got = _one_at_a_time(spec, REPEATING[1:], banned)
    assert [list(g.token_ids) for g in got] == [list(w.token_ids) for w in want]
    assert "the fifteenth century" in got[0].text  # it still copies the quote
    assert not any(w in got[0].text for w in words), got[0].text
    assert stats.num_drafts > before
    allowed = tok.encode(QUOTE, add_special_tokens=False)[:20]
    only = SamplingParams(temperature=0.0, max_tokens=30, allowed_token_ids=allowed)
    got = _one_at_a_time(spec, REPEATING[1:], only)
    assert list(got[0].token_ids) == list(_one_at_a_time(plain, REPEATING[1:], only)[0].token_ids)
    assert set(got[0].token_ids) <= set(allowed)


def test_structured_output_with_drafts(plain: LLM, spec: LLM) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "items": {"type": "array"}},
        "required": ["name", "city", "items"],
    }
    doc = {"name": "Ada Lovelace", "city": "London", "items": ["analytical engine", "notes", "first program"]}
    prompt = "<|im_start|>user\nCopy this JSON exactly:\n" + json.dumps(doc) + "<|im_end|>\n<|im_start|>assistant\n"
    params = SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=schema))
    stats = _core(spec).scheduler.total_spec_stats
    before = stats.num_accepted_tokens
    want = _one_at_a_time(plain, [prompt], params)[0]
    got = _one_at_a_time(spec, [prompt], params)[0]
    assert list(got.token_ids) == list(want.token_ids) and got.finish_reason == want.finish_reason == "stop"
    parsed = json.loads(got.text)
    assert set(parsed) == {"name", "city", "items"}
    assert stats.num_accepted_tokens - before > 10  # the copy was mostly accepted drafts


def test_prefix_cache_after_rejected_drafts(plain: LLM, spec: LLM) -> None:
    """Blocks are cached only with the keys of their own tokens: a later prompt that extends an earlier request's
    prompt and output (drafts kept and rejected in it) hits the prefix cache on as many blocks as with the plain
    engine (those its accepted drafts filled too), and gets the plain engine's tokens and logprobs bit for bit (the
    plain engine's cache built the same way, by decoding). A block cached while it still held a rejected draft's
    keys would change them."""
    first = SamplingParams(temperature=0.0, max_tokens=60)
    stats = _core(spec).scheduler.total_spec_stats
    for llm in (plain, spec):
        assert llm.reset_prefix_cache()
    drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    earlier = {
        name: llm.generate([REPEATING[0]], first, use_tqdm=False)[0] for name, llm in {"p": plain, "s": spec}.items()
    }
    assert stats.num_draft_tokens - drafted > stats.num_accepted_tokens - accepted > 0  # drafts kept and rejected
    assert list(earlier["p"].outputs[0].token_ids) == list(earlier["s"].outputs[0].token_ids)
    tail = list(earlier["s"].prompt_token_ids) + list(earlier["s"].outputs[0].token_ids)
    extended = {"prompt_token_ids": tail + list(range(1000, 1007))}
    later = SamplingParams(temperature=0.0, max_tokens=24, logprobs=3, ignore_eos=True)
    want = plain.generate([extended], later, use_tqdm=False)[0]
    got = spec.generate([extended], later, use_tqdm=False)[0]
    block = _core(spec).scheduler.kv_cache_manager.block_size
    assert got.num_cached_tokens == want.num_cached_tokens >= (len(tail) - 1) // block * block
    assert list(got.outputs[0].token_ids) == list(want.outputs[0].token_ids)
    assert got.outputs[0].logprobs == want.outputs[0].logprobs


def test_preemption_and_chunked_prefill_with_drafts() -> None:
    """A KV cache too small for the batch (preemptions) and a budget that chunks the prompts, with drafts: every
    request ends with its tokens, the blocks all come back, and the pool's invariants hold."""
    llm = LLM(
        speculative_config=SPEC,
        engine_client="inproc",
        num_gpu_blocks_override=14,
        max_num_batched_tokens=48,
        max_model_len=160,
    )
    try:
        prompts = REPEATING * 2
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        scheduler = _core(llm).scheduler
        assert scheduler.total_preemptions > 0 and scheduler.total_spec_stats.num_drafts > 0
        assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
        scheduler.kv_cache_manager.check_invariants()
        assert scheduler.kv_cache_manager.num_blocks_in_use() == 0
    finally:
        llm.shutdown()
