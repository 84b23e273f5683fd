"""InputBatch unit tests: rows follow the scheduler's diffs, and the per-step SamplingMetadata sliced from the
persistent rows equals what SamplingMetadata.from_requests builds from the same requests (the reference).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from pagedllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch

CPU = torch.device("cpu")
VOCAB = 32
EOS = 2
GREEDY = SamplingParams(temperature=0.0)


def make_batch(max_reqs: int = 8) -> InputBatch:
    return InputBatch(max_num_reqs=max_reqs, max_model_len=64, block_size=4, device=CPU)


def new(rid: str, prompt: list[int], params: SamplingParams, eos: int | None = EOS) -> NewRequestData:
    return NewRequestData(rid, prompt, params, eos, block_ids=[[len(prompt)]], num_computed_tokens=0)


def diff(
    new_reqs: list[NewRequestData] | None = None,
    resumed: list[str] | None = None,
    finished: set[str] | None = None,
    preempted: set[str] | None = None,
) -> SchedulerOutput:
    """One step's diff: new requests, requests resumed after preemption, and those that left."""
    new_reqs, resumed = new_reqs or [], resumed or []
    cached = CachedRequestData()
    for rid in resumed:
        cached.req_ids.append(rid)
        cached.resumed_from_preemption.append(True)
        cached.new_block_ids.append([[9]])
        cached.num_computed_tokens.append(0)
    counts = {n.req_id: 1 for n in new_reqs} | {r: 1 for r in resumed}
    return SchedulerOutput(new_reqs, cached, counts, len(counts), finished or set(), preempted or set())


def rows_of(batch: InputBatch, req_ids: list[str]) -> np.ndarray:
    return np.array([batch.requests[r].row for r in req_ids], dtype=np.int64)


def reference(
    batch: InputBatch, req_ids: list[str], vocab: int = VOCAB, draft_pos: list[int] | None = None
) -> SamplingMetadata:
    states = [batch.requests[r] for r in req_ids]
    return SamplingMetadata.from_requests(
        [s.sampling_params for s in states],
        [s.prompt_token_ids for s in states],
        [s.output_token_ids for s in states],
        [s.eos_token_id for s in states],
        vocab,
        CPU,
        draft_pos=draft_pos,
    )


def assert_same(got: SamplingMetadata, want: SamplingMetadata) -> None:
    for f in dataclasses.fields(SamplingMetadata):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, torch.Tensor) or isinstance(a, torch.Tensor):
            assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f.name
            assert a.dtype == b.dtype and torch.equal(a, b), (f.name, a, b)
        else:
            assert a == b, (f.name, a, b)


def check(batch: InputBatch, req_ids: list[str], vocab: int = VOCAB) -> SamplingMetadata:
    md = batch.sampling_metadata(rows_of(batch, req_ids), vocab)
    assert_same(md, reference(batch, req_ids, vocab))
    return md


MIXED = {
    "greedy": GREEDY,
    "seeded": SamplingParams(temperature=0.7, top_k=5, logprobs=3, seed=11),
    "nucleus": SamplingParams(top_p=0.9, min_p=0.1, logprobs=1),
    "penalized": SamplingParams(repetition_penalty=1.2, presence_penalty=0.5, min_tokens=2, stop_token_ids=[7]),
    "biased": SamplingParams(temperature=0.0, logit_bias={3: 2.5, 1000: 1.0}, frequency_penalty=0.3),
    "wide_k": SamplingParams(top_k=1000, seed=3),
}
PROMPTS = {"greedy": [1], "seeded": [2, 3, 4], "nucleus": [5], "penalized": [5, 6], "biased": [8, 8, 9], "wide_k": [4]}


def add_mixed(batch: InputBatch) -> None:
    batch.update(diff([new(rid, PROMPTS[rid], p) for rid, p in MIXED.items()]))


def test_mixed_rows_equal_reference_in_any_order_and_subset() -> None:
    batch = make_batch()
    add_mixed(batch)
    ids = list(MIXED)
    md = check(batch, ids)
    assert not md.all_greedy and not md.all_random and md.max_num_logprobs == 3
    assert md.top_k is not None and md.top_k.tolist() == [VOCAB, 5, VOCAB, VOCAB, VOCAB, VOCAB]
    assert md.logit_bias[4] == {3: 2.5}  # the out-of-range id is dropped
    assert set(md.seeds) == {1, 5}  # seeded random rows only, by position in this step's order
    # The model runner asks for its own order (decodes first) and only the rows that sample.
    check(batch, ["wide_k", "penalized", "greedy", "seeded"])
    check(batch, ["biased", "nucleus"])
    check(batch, ["seeded"])


def test_allowed_ids_and_bad_words_follow_their_rows() -> None:
    batch = make_batch()
    allowed = SamplingParams(temperature=0.0, allowed_token_ids=[4, 9, 1000])
    banned = SamplingParams(temperature=0.0, bad_words_token_ids=[[5], [6, 7]])
    batch.update(diff([new("g", [1], GREEDY), new("a", [2], allowed), new("b", [3], banned)]))
    md = check(batch, ["b", "g", "a"])
    assert md.allowed_token_ids == {2: [4, 9]} and md.bad_words == {0: [[5], [6, 7]]}
    assert not batch.plain[batch.requests["a"].row] and not batch.plain[batch.requests["b"].row]
    batch.update(diff(finished={"a", "b"}))
    batch.update(diff([new("c", [4], GREEDY)]))
    md = check(batch, ["g", "c"])
    assert md.allowed_token_ids == {} and md.bad_words == {}
    assert batch.plain[[batch.requests[r].row for r in "gc"]].all()  # freed rows leave nothing behind


def test_all_greedy_rows_take_the_fast_path() -> None:
    batch = make_batch()
    batch.update(diff([new("a", [1, 2], GREEDY), new("b", [3], GREEDY), new("c", [4], GREEDY, eos=None)]))
    md = check(batch, ["c", "a", "b"])
    assert md.all_greedy and md.no_penalties and md.top_k is None and md.prompt_token_ids is None
    # Seeded greedy requests never draw, and logprobs leave the path plain-greedy otherwise.
    batch.update(diff([new("d", [5], SamplingParams(temperature=0.0, seed=4, logprobs=2))]))
    md = check(batch, ["a", "d"])
    assert md.all_greedy and md.seeds == {} and md.max_num_logprobs == 2


def test_penalty_history_follows_appended_tokens() -> None:
    batch = make_batch()
    add_mixed(batch)
    for rid, toks in {"penalized": [7, 7, 3], "biased": [8], "greedy": [1, 1]}.items():
        for t in toks:
            batch.append_token(batch.requests[rid], t)
    md = check(batch, ["biased", "penalized", "greedy"])
    assert md.output_token_ids == [[8], [7, 7, 3], [1, 1]]
    assert md.prompt_token_ids is not None
    assert md.prompt_token_ids.tolist() == [[8, 8, 9], [5, 6, VOCAB], [1, VOCAB, VOCAB]]
    # The token rows hold prompt + output, where the model runner reads its input ids.
    row = batch.requests["penalized"].row
    assert batch.token_ids[row, :5].tolist() == [5, 6, 7, 7, 3]


def test_min_tokens_forbids_eos_and_stop_ids_until_reached() -> None:
    batch = make_batch()
    batch.update(
        diff(
            [
                new("m", [1], SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5, 99])),
                new("i", [1], SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)),  # nothing forbidden
                new("g", [1], GREEDY),
            ]
        )
    )
    md = check(batch, ["g", "m", "i"])
    assert md.min_tokens == {1: (2, {5, EOS})}  # 99 is outside the vocabulary
    m = batch.requests["m"]
    batch.append_token(m, 4)
    assert check(batch, ["m"]).min_tokens == {0: (2, {5, EOS})}
    batch.append_token(m, 6)
    md = check(batch, ["g", "m", "i"])
    assert md.min_tokens == {} and md.all_greedy
    assert batch.plain[rows_of(batch, ["g", "m", "i"])].all()  # back on the fast path once min_tokens is reached


def test_finished_rows_are_reused_without_leftovers() -> None:
    batch = make_batch(max_reqs=2)
    batch.update(diff([new("a", [1, 2, 3], MIXED["penalized"]), new("b", [4], MIXED["seeded"])]))
    row_b = batch.requests["b"].row
    batch.append_token(batch.requests["b"], 9)
    batch.update(diff([new("c", [6], GREEDY)], finished={"b"}))
    assert "b" not in batch.requests and batch.requests["c"].row == row_b
    md = check(batch, ["a", "c"])
    assert md.seeds == {} and md.output_token_ids == [[], []] and md.logit_bias == [None, None]
    assert md.prompt_token_ids is not None and md.prompt_token_ids.tolist() == [[1, 2, 3], [6, VOCAB, VOCAB]]
    batch.update(diff([new("d", [7], MIXED["biased"])], finished={"a"}))
    md = check(batch, ["d", "c"])
    assert md.min_tokens == {} and md.logit_bias == [{3: 2.5}, None]


def test_preempted_request_keeps_its_state_and_seed() -> None:
    batch = make_batch(max_reqs=2)
    add = [new("s", [1, 2], SamplingParams(seed=5, min_tokens=4, frequency_penalty=0.1)), new("g", [3], GREEDY)]
    batch.update(diff(add))
    s = batch.requests["s"]
    batch.append_token(s, 10)
    s.num_prompt_logprobs_done = 1
    batch.update(diff(preempted={"s"}))
    assert s.row == -1 and "s" in batch.requests
    assert batch.seeds == {} and batch.min_tokens == {}  # the free row keeps nothing of s
    # A new request takes the freed row; s comes back later on another row, with its history.
    batch.update(diff([new("n", [4], GREEDY)]))
    batch.update(diff(resumed=["s"], finished={"g"}))
    assert s.row >= 0 and s.output_token_ids == [10]
    assert s.num_prompt_logprobs_done == 1  # a recompute of the prompt reports no prompt logprob twice
    assert batch.token_ids[s.row, :3].tolist() == [1, 2, 10]
    md = check(batch, ["n", "s"])
    # Its next token is its second draw: the draw index counts the token it output before the preemption.
    assert md.seeds == {1: (5, 1)} and md.min_tokens == {1: (4, {EOS})} and md.output_token_ids[1] == [10]


def test_empty_selection() -> None:
    batch = make_batch()
    add_mixed(batch)
    check(batch, [])


def test_draft_positions_offset_seeded_draws() -> None:
    """A step verifying drafts: a seeded row's draw index is the request's output length plus the row's position
    among its request's rows, so each verified position draws as plain decoding would there."""
    batch = make_batch()
    seeded = SamplingParams(temperature=1.0, seed=9)
    batch.update(diff([new("s", [1, 2], seeded), new("u", [3], SamplingParams()), new("g", [4], GREEDY)]))
    s = batch.requests["s"]
    batch.append_token(s, 5)
    batch.append_token(s, 6)
    rows = rows_of(batch, ["s", "u", "g"])
    assert batch.sampling_metadata(rows, VOCAB).seeds == {0: (9, 2)}
    md = batch.sampling_metadata(np.repeat(rows, [3, 2, 1]), VOCAB, np.array([0, 1, 2, 0, 1, 0]))
    assert md.seeds == {0: (9, 2), 1: (9, 3), 2: (9, 4)}  # the unseeded and greedy requests draw no seeded U
    assert_same(md, reference(batch, ["s"] * 3 + ["u"] * 2 + ["g"], draft_pos=[0, 1, 2, 0, 1, 0]))
