"""End-to-end tests of the offline LLM on the real default model (SmolLM2-135M-Instruct, GGUF).

The reference is HF transformers loading the same GGUF file in the test, generating one prompt at a time
(no padding), greedy. The engine runs the file de-quantized to float32 (`quantization="none"`, the exact path);
tests/engine/test_quantized.py covers the default, which runs it as stored. After every test the KV block pool
holds no block in use.
"""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import default_model_path

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Write a haiku about the sea.",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "List three primary colors and explain why they are called primary:",
    "Once upon a time, in a small village at the foot of a tall mountain, there lived an old clockmaker "
    "who had never once left the valley. Every morning he",
    "Translate to French: I would like a cup of coffee and a croissant, please.",
    "<|im_start|>user\nWhat is 12 times 12? Explain step by step.<|im_end|>\n<|im_start|>assistant\n",
    "The history of the Roman Empire spans more than a thousand years. It began when Augustus became the "
    "first emperor in 27 BC and, in the West, ended in 476 AD when the last emperor was deposed. During "
    "this period the empire",
]


@pytest.fixture(scope="module")
def llm():
    # The default attention backend (the native CPU decode kernel here); the tiny models also check the torch one.
    engine = LLM(kv_cache_memory_bytes="256MiB", max_model_len=2048, quantization="none")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(autouse=True)
def _pool_is_clean(request):
    yield
    if "llm" in request.fixturenames:
        stats = request.getfixturevalue("llm").check_invariants()
        assert stats["in_use"] == 0 and stats["unfinished"] == 0, stats


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int, eos: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="module")
def hf_reference(llm, hf_model):
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    return ids, [hf_greedy(hf_model, p, 32, tok.eos_token_id) for p in ids]


def test_greedy_matches_hf_token_for_token(llm, hf_reference):
    ids, ref = hf_reference
    assert len({len(p) for p in ids}) >= 8, "prompts of different lengths"
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    for prompt_ids, out, expected in zip(ids, outs, ref):
        assert out.prompt_token_ids == prompt_ids
        assert out.outputs[0].token_ids == expected, out.prompt
        assert out.outputs[0].finish_reason == ("stop" if len(expected) < 32 else "length")
        assert out.finished


def test_stress_preemption_chunking_no_prefix_cache(hf_reference):
    """Prefix caching off, 32-token budget (chunked prefill), a KV cache too small for the batch."""
    ids, ref = hf_reference
    engine = LLM(
        enable_prefix_caching=False,
        max_num_batched_tokens=32,
        max_model_len=128,
        num_gpu_blocks_override=16,
        quantization="none",
    )
    try:
        outs = engine.generate(
            [{"prompt_token_ids": p} for p in ids],
            SamplingParams(temperature=0, max_tokens=32),
            use_tqdm=False,
        )
        assert [o.outputs[0].token_ids for o in outs] == ref
        stats = engine.check_invariants()
        assert stats["num_preemptions"] > 0 and stats["in_use"] == 0
    finally:
        engine.shutdown()


def test_prefix_cache_hits_give_same_output(llm, hf_reference):
    ids, ref = hf_reference
    params = SamplingParams(temperature=0, max_tokens=32)
    long_prompts = [{"prompt_token_ids": ids[-1]}, {"prompt_token_ids": ids[5]}]
    first = llm.generate(long_prompts, params, use_tqdm=False)
    again = llm.generate(long_prompts, params, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in again)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    assert again[0].outputs[0].token_ids == ref[-1]


def test_prompt_logprobs_close_to_hf(llm, hf_model):
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPTS[5])
    out = llm.generate(
        {"prompt_token_ids": ids},
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2),
        use_tqdm=False,
    )[0]
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert len(entry) <= 3 and ids[pos] in entry
        assert entry[ids[pos]].logprob == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=2e-3)


def test_sample_logprobs(llm):
    out = llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=4, logprobs=3), use_tqdm=False
    )[0].outputs[0]
    assert len(out.logprobs) == 4
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and entry[tok].rank == 1 and len(entry) == 3
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_seeded_sampling_same_alone_and_in_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=1234)
    alone = llm.generate("Tell me a story about a dragon.", params, use_tqdm=False)[0].outputs[0].text
    others = [SamplingParams(temperature=0.8, max_tokens=30), SamplingParams(temperature=0, max_tokens=10)]
    batch = llm.generate(
        ["Name a fruit.", "Tell me a story about a dragon.", "Count to ten:"],
        [others[0], params, others[1]],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].text == alone


def test_n_returns_n_outputs_sharing_prompt_blocks(llm):
    prompt = PROMPTS[-1]
    out = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=7), use_tqdm=False)
    assert len(out) == 1 and len(out[0].outputs) == 4
    assert sorted(c.index for c in out[0].outputs) == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1
    assert out[0].num_cached_tokens > 0  # children after the first hit the prompt's blocks


def test_stop_strings_and_stop_token_ids(llm):
    base = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[
        0
    ].outputs[0]
    assert "Paris" in base.text
    cut = llm.generate(
        "The capital of France is",
        SamplingParams(temperature=0, max_tokens=16, stop=["Paris"]),
        use_tqdm=False,
    )[0].outputs[0]
    assert cut.text == base.text[: base.text.index("Paris")]
    assert cut.finish_reason == "stop" and cut.stop_reason == "Paris"
    kept = llm.generate(
        "The capital of France is",
        SamplingParams(temperature=0, max_tokens=16, stop="Paris", include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text.endswith("Paris")
    tok_stop = base.token_ids[2]
    by_id = llm.generate(
        "The capital of France is",
        SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[tok_stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert by_id.token_ids == base.token_ids[:3] and by_id.stop_reason == tok_stop


def test_chat_template_and_eos(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=64),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids[-1] == llm.get_tokenizer().eos_token_id
    assert "<|im_end|>" not in out.outputs[0].text
    assert out.prompt.startswith("<|im_start|>")
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.finished_time


def test_chat_template_kwargs_are_template_variables(llm):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}{% if enable_thinking is false %} /no{% endif %}"
    msgs = [{"role": "user", "content": "Hi"}]
    params = SamplingParams(temperature=0, max_tokens=1)
    outs = llm.chat([msgs, msgs], params, use_tqdm=False, chat_template=template)
    assert outs[0].prompt == "Hi"
    kwargs = {"enable_thinking": False}
    off = llm.chat(msgs, params, use_tqdm=False, chat_template=template, chat_template_kwargs=kwargs)
    assert off[0].prompt == "Hi /no"
    with pytest.raises(ValueError, match="'tools'"):
        llm.chat(msgs, params, use_tqdm=False, chat_template_kwargs={"tools": []})


def test_bad_words_and_allowed_token_ids(llm):
    prompt = "The capital of France is"
    greedy = SamplingParams(temperature=0, max_tokens=8)
    assert "Paris" in llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].text
    # the word is banned where it opens the text and after a space (the tokenizer's two forms of it)
    assert llm.input_processor.bad_words_token_ids(["Paris"]) == [
        llm.get_tokenizer().encode(w, add_special_tokens=False) for w in ("Paris", " Paris")
    ]
    banned = greedy.clone(bad_words=["Paris"])
    assert "Paris" not in llm.generate(prompt, banned, use_tqdm=False)[0].outputs[0].text
    allowed = llm.get_tokenizer().encode(" a big city in the north", add_special_tokens=False)
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=12, allowed_token_ids=allowed)
    out = llm.generate(prompt, sampled, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 12 and set(out.token_ids) <= set(allowed)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(prompt, SamplingParams(allowed_token_ids=[10**7]), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    # a step with nothing left to sample is refused up front
    eos = llm.get_tokenizer().eos_token_id
    with pytest.raises(ValueError, match="every allowed id ends the request"):
        llm.generate(prompt, SamplingParams(allowed_token_ids=[eos], min_tokens=2), use_tqdm=False)
    one = llm.get_tokenizer().encode(" Paris", add_special_tokens=False)
    with pytest.raises(ValueError, match="every allowed id is a bad word"):
        llm.generate(prompt, SamplingParams(allowed_token_ids=one, bad_words=[" Paris"]), use_tqdm=False)


def test_truncate_prompt_tokens_keeps_the_end(llm):
    prompt = "one two three four five six seven eight nine ten"
    ids = llm.get_tokenizer().encode(prompt)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=4), use_tqdm=False)
    assert out[0].prompt_token_ids == ids[-4:] and out[0].prompt is None
    same = llm.generate({"prompt_token_ids": ids[-4:]}, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert out[0].outputs[0].token_ids == same[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


def test_enqueue_then_wait_for_completion(llm):
    params = SamplingParams(temperature=0, max_tokens=5)
    prompts = ["The capital of France is", "One, two, three,"]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    ids = llm.enqueue(prompts, params, use_tqdm=False)
    chat_ids = llm.enqueue_chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False)
    assert len(set(ids + chat_ids)) == 3
    # a generate call meanwhile runs the queued requests too, and leaves their outputs for wait_for_completion
    other = llm.generate("Hello", params, use_tqdm=False)
    assert len(other) == 1 and other[0].prompt == "Hello"
    outs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outs] == ids + chat_ids
    assert [o.outputs[0].token_ids for o in outs[:2]] == want
    assert outs[2].prompt.startswith("<|im_start|>")
    assert llm.wait_for_completion(use_tqdm=False) == []
    llm.enqueue("Hi", params, use_tqdm=False)
    with pytest.raises(TypeError, match="expected"):
        llm.wait_for_completion(int, use_tqdm=False)
    [kept] = llm.wait_for_completion(use_tqdm=False)  # a wrong type asked for loses nothing
    assert kept.prompt == "Hi" and kept.finished


def test_min_tokens_and_ignore_eos(llm):
    msgs = [{"role": "user", "content": "Say OK."}]
    short = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "stop"
    longer = llm.chat(
        msgs,
        SamplingParams(temperature=0, max_tokens=40, min_tokens=len(short.token_ids) + 3),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(longer.token_ids) >= len(short.token_ids) + 3
    forced = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    assert len(forced.outputs[0].token_ids) == 20 and forced.outputs[0].finish_reason == "length"


def test_priority_argument(llm):
    outs = llm.generate(
        ["a", "b", "c"], SamplingParams(temperature=0, max_tokens=3), priority=[2, 0, 1], use_tqdm=False
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3, 3]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"stream_interval": 0}, "stream_interval must be an integer of at least 1, got 0"),
        ({"stream_interval": 2.5}, "stream_interval"),
        ({"extra_args": ["a"]}, "extra_args must be a dict"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts_do_not_disturb_the_engine(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [100] * 3000}, SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate({"prompt_token_ids": [10**6]}, use_tqdm=False)
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_unknown_model_and_architecture(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model=str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        LLM(model=str(tmp_path))
