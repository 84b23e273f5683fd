"""The shared benchmark datasets (pagedllm/benchmarks/datasets.py): lengths, determinism, file parsing, errors.

The tiny model's WordLevel tokenizer makes every count hand-checkable (one word, one token); the real SmolLM2
tokenizer (byte-level BPE, from its GGUF) checks the decode -> re-encode -> adjust loop where it matters.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import numpy as np
import pytest

from pagedllm.benchmarks import datasets as ds
from tests.bench.conftest import SHAREGPT_PAIRS


def _ns(**kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    ds.add_dataset_args(parser)
    args = parser.parse_args([])
    for key, value in kw.items():
        setattr(args, key, value)
    return args


# ---- random -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "length, ratio, expected", [(100, 0.0, (100, 100)), (100, 0.5, (50, 150)), (10, 0.25, (7, 13)), (1, 0.9, (1, 2))]
)
def test_length_range_is_vllms(length, ratio, expected):
    assert ds.length_range(length, ratio) == expected


def test_random_exact_lengths_in_range_without_special_tokens(tiny_tokenizer):
    reqs = ds.sample_random(tiny_tokenizer, 40, input_len=20, output_len=10, range_ratio=0.5, seed=3)
    assert len(reqs) == 40
    for r in reqs:
        assert 10 <= r.prompt_len <= 30 and 5 <= r.expected_output_len <= 15
        assert r.prompt_token_ids == ds.encode(tiny_tokenizer, r.prompt)
        assert len(r.prompt_token_ids) == r.prompt_len
        assert min(r.prompt_token_ids) >= 3  # ids 0-2 are <unk> <s> </s>
    # the whole range is used, not a constant
    assert len({r.prompt_len for r in reqs}) > 5 and len({r.expected_output_len for r in reqs}) > 3


def test_random_fixed_lengths_and_seeded(tiny_tokenizer):
    a = ds.sample_random(tiny_tokenizer, 5, input_len=16, output_len=4, seed=1)
    b = ds.sample_random(tiny_tokenizer, 5, input_len=16, output_len=4, seed=1)
    c = ds.sample_random(tiny_tokenizer, 5, input_len=16, output_len=4, seed=2)
    assert [r.prompt_len for r in a] == [16] * 5 and [r.expected_output_len for r in a] == [4] * 5
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in c]


def test_random_prefix_is_shared_and_leaves_the_seeds_prompts_alone(tiny_tokenizer):
    plain = ds.sample_random(tiny_tokenizer, 4, input_len=16, output_len=4, seed=1)
    assert plain == ds.sample_random(tiny_tokenizer, 4, input_len=16, output_len=4, seed=1, prefix_len=0)
    shared = ds.sample_random(tiny_tokenizer, 4, input_len=16, output_len=4, seed=1, prefix_len=24)
    assert [r.prompt_len for r in shared] == [40] * 4
    heads = {tuple(r.prompt_token_ids[:24]) for r in shared}
    assert len(heads) == 1 and len({tuple(r.prompt_token_ids[24:]) for r in shared}) == 4


def test_random_bpe_tokenizer_hits_the_wanted_length():
    """Random ids decoded by a byte-level BPE re-encode to other ids and counts; the adjust loop fixes that."""
    tok = ds.load_tokenizer(None)  # the default model's GGUF
    reqs = ds.sample_random(tok, 30, input_len=64, output_len=8, range_ratio=0.5, seed=0)
    for r in reqs:
        assert 32 <= r.prompt_len <= 96
        assert len(ds.encode(tok, r.prompt)) == r.prompt_len
    # Every prompt has exactly the length drawn for it: the generator draws the input lengths first.
    rng = np.random.default_rng(0)
    drawn = rng.integers(32, 97, size=30).tolist()
    assert [r.prompt_len for r in reqs] == drawn


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5])
def test_random_rejects_bad_range_ratio(tiny_tokenizer, ratio):
    with pytest.raises(ValueError, match=str(ratio)):
        ds.sample_random(tiny_tokenizer, 2, 8, 4, range_ratio=ratio)


def test_random_rejects_bad_lengths(tiny_tokenizer):
    with pytest.raises(ValueError, match="input len must be at least 1, got 0"):
        ds.sample_random(tiny_tokenizer, 2, 0, 4)
    with pytest.raises(ValueError, match="num requests must be at least 1, got -1"):
        ds.sample_random(tiny_tokenizer, -1, 8, 4)


# ---- prefix repetition -----------------------------------------------------------------------------------------


def test_prefix_repetition_shares_prefixes_evenly(tiny_tokenizer):
    reqs = ds.sample_prefix_repetition(
        tiny_tokenizer, 7, prefix_len=12, suffix_len=5, num_prefixes=3, output_len=6, seed=0
    )
    assert len(reqs) == 7
    assert all(r.prompt_len == 17 and len(r.prompt_token_ids) == 17 for r in reqs)
    assert all(r.expected_output_len == 6 for r in reqs)
    prefixes = Counter(tuple(r.prompt_token_ids[:12]) for r in reqs)
    assert sorted(prefixes.values()) == [2, 2, 3]  # 7 requests over 3 prefixes
    assert len({tuple(r.prompt_token_ids[12:]) for r in reqs}) == 7  # every suffix is its own
    # shuffled: the requests of one prefix are not all adjacent
    order = [tuple(r.prompt_token_ids[:12]) for r in reqs]
    assert any(order[i] != order[i + 1] for i in range(6))


def test_prefix_repetition_bpe_prefix_is_shared_in_tokens():
    tok = ds.load_tokenizer(None)
    reqs = ds.sample_prefix_repetition(tok, 6, prefix_len=40, suffix_len=20, num_prefixes=2, output_len=4, seed=1)
    for r in reqs:
        assert abs(r.prompt_len - 60) <= 1
        assert len(ds.encode(tok, r.prompt)) == r.prompt_len
    # The boundary token may merge with the suffix; the rest of each prefix is identical across its requests.
    assert len({tuple(r.prompt_token_ids[:39]) for r in reqs}) == 2


def test_prefix_repetition_errors(tiny_tokenizer):
    with pytest.raises(ValueError, match=r"num_prefixes \(5\) cannot exceed the number of requests \(4\)"):
        ds.sample_prefix_repetition(tiny_tokenizer, 4, 8, 8, 5, 4)
    with pytest.raises(ValueError, match="suffix length must be >= 0, got -1"):
        ds.sample_prefix_repetition(tiny_tokenizer, 4, 8, -1, 2, 4)


# ---- repeat ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 4, 5, 8, 10, 13])
def test_repeat_holds_each_passage_alike_in_a_seeded_order(tiny_tokenizer, n):
    reqs = ds.sample_repeat(tiny_tokenizer, n, seed=3)
    passages = len(ds.REPEAT_PASSAGES)
    counts = Counter(r.prompt for r in reqs)
    assert sum(counts.values()) == n
    assert all(c in (n // passages, n // passages + 1) for c in counts.values()), counts
    assert len(counts) == min(n, passages)
    for r in reqs:  # the completion asks for the passage again, and as many tokens as it has
        kind, passage = next((k, p) for k, p in ds.REPEAT_PASSAGES if f'"{p}"' in r.prompt)
        assert r.prompt.endswith(f'The same {kind} again:\n\n"')
        assert r.prompt_token_ids == ds.encode(tiny_tokenizer, r.prompt) and r.prompt_len == len(r.prompt_token_ids)
        assert r.expected_output_len == len(ds.encode(tiny_tokenizer, passage))
    again = [r.prompt for r in ds.sample_repeat(tiny_tokenizer, n, seed=3)]
    assert again == [r.prompt for r in reqs]


def test_repeat_orders_differ_between_rounds_and_seeds(tiny_tokenizer):
    passages = len(ds.REPEAT_PASSAGES)
    rounds = [r.prompt for r in ds.sample_repeat(tiny_tokenizer, 4 * passages, seed=0)]
    orders = {tuple(rounds[i : i + passages]) for i in range(0, len(rounds), passages)}
    assert len(orders) > 1  # not one order repeated
    other = [r.prompt for r in ds.sample_repeat(tiny_tokenizer, 4 * passages, seed=1)]
    assert other != rounds
    assert [r.expected_output_len for r in ds.sample_repeat(tiny_tokenizer, 3, output_len=7)] == [7, 7, 7]


# ---- sharegpt ----------------------------------------------------------------------------------------------------


def test_sharegpt_first_exchange_and_reply_lengths(tiny_tokenizer, sharegpt_file):
    reqs = ds.sample_sharegpt(tiny_tokenizer, sharegpt_file, 3, seed=0)
    got = sorted((r.prompt, r.prompt_len, r.expected_output_len) for r in reqs)
    want = sorted((p, len(p.split()), len(a.split())) for p, a in SHAREGPT_PAIRS)
    assert got == want  # entries without a human -> gpt pair, or with an empty reply, are skipped


def test_sharegpt_output_len_override_reuse_and_max_model_len(tiny_tokenizer, sharegpt_file):
    reqs = ds.sample_sharegpt(tiny_tokenizer, sharegpt_file, 7, output_len=2, seed=5)
    assert [r.expected_output_len for r in reqs] == [2] * 7
    assert [r.prompt for r in reqs[3:6]] == [r.prompt for r in reqs[:3]]  # 3 usable entries, reused in order
    assert {r.prompt for r in reqs} == {p for p, _ in SHAREGPT_PAIRS}
    # prompt + reply must fit: "t30 t31 t32" (3) + 6 = 9 tokens and "t10 ..." (5) + 3 = 8 do not fit in 7
    short = ds.sample_sharegpt(tiny_tokenizer, sharegpt_file, 2, seed=0, max_model_len=7)
    assert {r.prompt for r in short} == {SHAREGPT_PAIRS[2][0]}


def test_sharegpt_errors(tiny_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="cannot read the ShareGPT dataset .*missing.json"):
        ds.sample_sharegpt(tiny_tokenizer, str(tmp_path / "missing.json"), 2)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        ds.sample_sharegpt(tiny_tokenizer, str(bad), 2)
    useless = tmp_path / "useless.json"
    useless.write_text(json.dumps([{"conversations": [{"from": "gpt", "value": "t5"}]}]))
    with pytest.raises(ValueError, match="has no usable conversation"):
        ds.sample_sharegpt(tiny_tokenizer, str(useless), 2)
    with pytest.raises(ValueError, match="needs --dataset-path"):
        ds.sample_requests(_ns(dataset_name="sharegpt"), tiny_tokenizer, 2, 0)


# ---- dispatch and tokenizer loading ------------------------------------------------------------------------------


def test_sample_requests_dispatches_on_the_flags(tiny_tokenizer, sharegpt_file):
    rand = ds.sample_requests(_ns(random_input_len=9, random_output_len=3), tiny_tokenizer, 4, seed=0)
    assert [(r.prompt_len, r.expected_output_len) for r in rand] == [(9, 3)] * 4
    share = ds.sample_requests(_ns(dataset_name="sharegpt", dataset_path=sharegpt_file), tiny_tokenizer, 3, seed=0)
    assert {r.prompt for r in share} == {p for p, _ in SHAREGPT_PAIRS}
    prefix = ds.sample_requests(
        _ns(
            dataset_name="prefix-repetition",
            prefix_repetition_prefix_len=6,
            prefix_repetition_suffix_len=2,
            prefix_repetition_num_prefixes=2,
            prefix_repetition_output_len=5,
        ),
        tiny_tokenizer,
        4,
        seed=0,
    )
    assert [(r.prompt_len, r.expected_output_len) for r in prefix] == [(8, 5)] * 4


def test_load_tokenizer_paths(tiny_llama, tmp_path):
    from pagedllm.config import default_model_path

    gguf = ds.load_tokenizer(default_model_path())  # a GGUF file works as a tokenizer
    assert gguf.encode("hello world", add_special_tokens=False) == ds.load_tokenizer(None).encode(
        "hello world", add_special_tokens=False
    )
    assert ds.load_tokenizer(tiny_llama).encode("t5 t6", add_special_tokens=False) == [5, 6]
    with pytest.raises(ValueError, match="nowhere.gguf"):
        ds.load_tokenizer(str(tmp_path / "nowhere.gguf"))
