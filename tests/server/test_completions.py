"""POST /v1/completions through the official openai client against a real `pagedllm serve`."""

from __future__ import annotations

import json

import openai
import pytest

PROMPT = "The capital of France is"


def greedy(client, model, prompt=PROMPT, **kw):
    kw.setdefault("max_tokens", 12)
    return client.completions.create(model=model, prompt=prompt, temperature=0, **kw)


def test_completion_shape_and_usage(server, client, model_name):
    resp = greedy(client, model_name, max_tokens=8, extra_body={"ignore_eos": True})
    assert resp.id.startswith("cmpl-") and len(resp.id) == len("cmpl-") + 32
    assert resp.object == "text_completion"
    assert resp.model == model_name
    assert isinstance(resp.created, int)
    [choice] = resp.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    status, tok = server.request("POST", "/tokenize", {"prompt": PROMPT})
    assert status == 200
    assert resp.usage.prompt_tokens == tok["count"]
    assert resp.usage.completion_tokens == 8
    assert resp.usage.total_tokens == tok["count"] + 8


def test_default_max_tokens_is_16(client, model_name):
    resp = client.completions.create(model=model_name, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 16
    assert resp.choices[0].finish_reason == "length"


def test_max_tokens_null_means_rest_of_context(server, model_name):
    # A ~1000-token prompt: "up to the context length" is then a short generation.
    prompt = " ".join(["apple"] * 1000)
    status, body = server.request(
        "POST",
        "/v1/completions",
        {"model": model_name, "prompt": prompt, "max_tokens": None, "temperature": 0, "ignore_eos": True},
    )
    assert status == 200, body
    usage = body["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 1024
    assert body["choices"][0]["finish_reason"] == "length"


def test_stream_matches_non_stream_and_include_usage(client, model_name):
    full = greedy(client, model_name)
    chunks = list(
        client.completions.create(
            model=model_name,
            prompt=PROMPT,
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *content, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in content)
    assert "".join(c.choices[0].text for c in content) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in content][-1] == full.choices[0].finish_reason
    assert all(c.id == last.id for c in chunks) and last.id.startswith("cmpl-")


def first_token(client, model, prompt) -> str:
    """The greedy first token of `prompt` alone. It comes from the prompt's own prefill, which computes the same
    whatever else shares the step. The tokens after it may not: the default GGUF runs quantized, with int8
    activations, whose rounding can turn the last-bit differences between the one-request decoder and the batched
    kernels into another greedy token (llama.cpp's output varies with the batch in the same way)."""
    return greedy(client, model, prompt=prompt, max_tokens=1, extra_body={"ignore_eos": True}).choices[0].text


def test_n2_and_several_prompts(client, model_name):
    prompts = [PROMPT, "Once upon a time"]
    resp = client.completions.create(
        model=model_name, prompt=prompts, n=2, temperature=0, max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in resp.choices}
    for i, p in enumerate(prompts):
        # The two choices of a prompt run side by side in the same steps: the same greedy text.
        assert by_index[2 * i] == by_index[2 * i + 1]
        assert by_index[2 * i].startswith(first_token(client, model_name, p))
    assert by_index[0] != by_index[2]
    assert resp.usage.completion_tokens == 4 * 6


def test_n2_streaming_sampled(client, model_name):
    stream = client.completions.create(
        model=model_name, prompt=PROMPT, n=2, temperature=1.0, seed=7, max_tokens=8, stream=True
    )
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and all(texts.values())


def test_token_id_prompts(server, client, model_name):
    _, tok = server.request("POST", "/tokenize", {"prompt": PROMPT})
    by_ids = greedy(client, model_name, prompt=tok["tokens"])
    by_text = greedy(client, model_name)
    assert by_ids.choices[0].text == by_text.choices[0].text
    both = greedy(client, model_name, prompt=[tok["tokens"], tok["tokens"][:3]])
    assert len(both.choices) == 2 and [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text.startswith(first_token(client, model_name, PROMPT))
    assert both.choices[1].text.startswith(first_token(client, model_name, tok["tokens"][:3]))


def test_stop_string(client, model_name):
    text = greedy(client, model_name, max_tokens=16).choices[0].text
    stop = text.strip().split()[1]  # a word in the middle of the greedy continuation
    resp = greedy(client, model_name, max_tokens=16, stop=[stop, "zzzz-never"])
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    assert choice.text == text[: text.index(stop)]
    streamed = greedy(client, model_name, max_tokens=16, stop=stop, stream=True)
    parts = list(streamed)
    assert "".join(c.choices[0].text for c in parts) == choice.text
    assert parts[-1].choices[0].finish_reason == "stop"


def test_logprobs_legacy_format(client, model_name):
    resp = greedy(client, model_name, max_tokens=6, logprobs=3, extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tlp <= 0 and 3 <= len(top) <= 4
        # greedy: the chosen token is the most likely one
        assert top[tok] == pytest.approx(max(top.values()), abs=1e-4) and tlp == pytest.approx(top[tok])


def test_echo_with_logprobs(server, client, model_name):
    resp = greedy(client, model_name, max_tokens=4, echo=True, logprobs=1, extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    assert choice.text.startswith(PROMPT)
    _, tok = server.request("POST", "/tokenize", {"prompt": PROMPT})
    n_prompt = tok["count"]
    lp = choice.logprobs
    assert len(lp.tokens) == n_prompt + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == choice.text
    # echo without logprobs, streaming: the first chunk starts with the prompt
    chunks = list(greedy(client, model_name, max_tokens=4, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text


def test_prompt_logprobs_as_vllm_gives_them(server, client, model_name):
    """vLLM's `prompt_logprobs`: per prompt token (None for the first) its own entry and the top N, by token id as
    strings, each {logprob, rank, decoded_token}; on the choice for completions, on the response for chat; the
    same values as echo's legacy logprobs; refused when streaming or above --max-logprobs."""
    resp = greedy(client, model_name, max_tokens=1, extra_body={"prompt_logprobs": 2})
    steps = resp.choices[0].model_extra["prompt_logprobs"]
    _, tok = server.request("POST", "/tokenize", {"prompt": PROMPT})
    ids = tok["tokens"]
    assert len(steps) == len(ids) and steps[0] is None
    echo = greedy(client, model_name, max_tokens=1, echo=True, logprobs=2).choices[0].logprobs
    for pos, step in enumerate(steps[1:], start=1):
        assert str(ids[pos]) in step and 2 <= len(step) <= 3
        assert {1, 2} <= {e["rank"] for e in step.values()}  # the top 2, and the prompt's own token at its rank
        assert step[str(ids[pos])]["logprob"] == pytest.approx(echo.token_logprobs[pos], abs=1e-5)
        assert step[str(ids[pos])]["decoded_token"] == echo.tokens[pos]
    chat = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    mixed = greedy(client, model_name, max_tokens=1, echo=True, logprobs=4, extra_body={"prompt_logprobs": 0})
    assert all(len(step) == 1 for step in mixed.choices[0].model_extra["prompt_logprobs"][1:])  # own token only
    chat_steps = chat.model_extra["prompt_logprobs"]
    assert len(chat_steps) == chat.usage.prompt_tokens and chat_steps[0] is None
    assert all(len(step) == 1 and next(iter(step.values()))["logprob"] <= 0 for step in chat_steps[1:])
    assert greedy(client, model_name, max_tokens=1).choices[0].model_extra.get("prompt_logprobs") is None
    for extra in ({"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": 21}):
        status, body = server.request("POST", "/v1/completions", {"model": model_name, "prompt": PROMPT, **extra})
        assert status == 400 and body["error"]["param"] == "prompt_logprobs", body


def test_logprobs_streaming(client, model_name):
    full = greedy(client, model_name, max_tokens=6, logprobs=2)
    chunks = list(greedy(client, model_name, max_tokens=6, logprobs=2, stream=True))
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == full.choices[0].logprobs.tokens
    assert offsets == full.choices[0].logprobs.text_offset


def test_extra_vllm_sampling_params(server, client, model_name):
    resp = greedy(
        client,
        model_name,
        max_tokens=10,
        extra_body={"min_tokens": 10, "ignore_eos": True, "top_k": 5, "min_p": 0.01, "repetition_penalty": 1.1},
    )
    assert resp.usage.completion_tokens == 10
    # stop_token_ids: stop on the first greedy token, so the completion is empty
    first = greedy(client, model_name, max_tokens=1, logprobs=0).choices[0].logprobs.tokens[0]
    _, tok = server.request("POST", "/tokenize", {"prompt": first, "add_special_tokens": False})
    first_id = tok["tokens"][0]
    resp = greedy(client, model_name, max_tokens=10, extra_body={"stop_token_ids": [first_id]})
    assert resp.choices[0].finish_reason == "stop" and resp.choices[0].text == ""
    assert resp.choices[0].model_extra["stop_reason"] == first_id
    assert resp.usage.completion_tokens == 1


def test_logit_bias_string_keys(server, client, model_name):
    _, tok = server.request("POST", "/tokenize", {"prompt": " banana", "add_special_tokens": False})
    banana = tok["tokens"][0]
    resp = greedy(client, model_name, max_tokens=3, logit_bias={str(banana): 100})
    assert resp.choices[0].text == " banana" * 3


def test_allowed_token_ids_and_bad_words(server, client, model_name):
    _, tok = server.request("POST", "/tokenize", {"prompt": " banana apple", "add_special_tokens": False})
    resp = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=6, seed=3, extra_body={"allowed_token_ids": tok["tokens"]}
    )
    assert set(resp.choices[0].text.split()) <= {"banana", "apple"} and resp.usage.completion_tokens == 6
    word = greedy(client, model_name, max_tokens=1).choices[0].text.strip()
    resp = greedy(client, model_name, max_tokens=4, extra_body={"bad_words": [word]})
    assert word not in resp.choices[0].text
    status, body = server.request("POST", "/v1/completions", {"prompt": PROMPT, "allowed_token_ids": [10**7]})
    assert status == 400 and "allowed_token_ids" in body["error"]["message"], body
    status, body = server.request("POST", "/v1/completions", {"prompt": PROMPT, "bad_words": [" "]})
    assert status == 400 and "bad_words" in body["error"]["message"], body


def test_truncate_prompt_tokens_keeps_the_end(server, client, model_name):
    long = "one two three four five six seven eight nine ten " * 3
    _, tok = server.request("POST", "/tokenize", {"prompt": long})
    resp = greedy(client, model_name, prompt=long, max_tokens=2, echo=True, extra_body={"truncate_prompt_tokens": 6})
    assert resp.usage.prompt_tokens == 6
    head = server.request("POST", "/detokenize", {"tokens": tok["tokens"][-6:]})[1]["prompt"]
    assert resp.choices[0].text.startswith(head)
    whole = greedy(client, model_name, prompt=long, max_tokens=2, extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == tok["count"]  # -1: up to the context, and it fits


def test_seed_makes_sampling_reproducible(client, model_name):
    def sample():
        return (
            client.completions.create(
                model=model_name, prompt=PROMPT, temperature=1.0, top_p=0.9, seed=1234, max_tokens=12
            )
            .choices[0]
            .text
        )

    assert sample() == sample()


def test_context_length_error(client, model_name):
    with pytest.raises(openai.BadRequestError) as exc:
        greedy(client, model_name, max_tokens=2000)
    body = exc.value.body
    assert body["type"] == "BadRequestError" and body["code"] == 400
    assert body["message"].startswith("This model's maximum context length is 1024 tokens. However, you requested")
    assert "in the completion" in body["message"]


@pytest.mark.parametrize(
    "override, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"prompt": 12}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [49152 * 10]}, "prompt"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": 3}, "stop"),
        ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
        ({"presence_penalty": 5}, "presence_penalty"),
        ({"stream": True, "temperature": -1}, "temperature"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"n": 129}, "n"),
        ({"top_k": 10**30}, "top_k"),
        ({"seed": 2**64}, "seed"),
    ],
)
def test_bad_parameters_are_400(server, model_name, override, param):
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 4, **override}
    status, resp = server.request("POST", "/v1/completions", body)
    assert status == 400, resp
    err = resp["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["param"] == param
    assert isinstance(err["message"], str) and err["message"]


def test_missing_prompt_and_bad_json_are_400(server):
    status, resp = server.request("POST", "/v1/completions", {"max_tokens": 3})
    assert status == 400 and resp["error"]["param"] == "prompt"
    status, resp = server.request("POST", "/v1/completions", "{not json")
    assert status == 400 and "JSON" in resp["error"]["message"]
    for body in ("[1, 2]", "null", '"a string"', ""):
        status, resp = server.request("POST", "/v1/completions", body)
        assert status == 400 and resp["error"]["type"] == "BadRequestError", (body, resp)


def test_openai_client_raises_bad_request(client, model_name):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_name, prompt=PROMPT, temperature=-1)
    with pytest.raises(openai.BadRequestError):  # a streaming request is rejected before the stream starts
        client.completions.create(model=model_name, prompt=PROMPT, top_p=2, stream=True)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert exc.value.body["type"] == "NotFoundError" and "no-such-model" in exc.value.body["message"]


def test_raw_sse_framing(server, model_name):
    conn = server.connect()
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=server.headers())
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    raw = resp.read().decode()
    conn.close()
    assert raw.endswith("data: [DONE]\n\n")
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert "usage" not in json.loads(events[0][6:])  # only with stream_options.include_usage


def test_use_beam_search_gives_the_offline_beams(client, model_name):
    """vLLM's `use_beam_search` (width `n`): the choices are LLM.beam_search's sequences, best first, with their
    generated text; chat too; a width above half of --max-logprobs is a 400."""
    from pagedllm import LLM, BeamSearchParams

    with LLM(engine_client="inproc", max_model_len=1024, kv_cache_memory_bytes="64MiB") as llm:
        ids = llm.get_tokenizer().encode(PROMPT)
        best = llm.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=8))[0].sequences
        want = [llm.get_tokenizer().decode(s.tokens[len(ids) : len(s.tokens) - (s.finish_reason == "stop")])
                for s in best]  # fmt: skip
    resp = greedy(client, model_name, max_tokens=8, n=3, extra_body={"use_beam_search": True})
    assert [c.text for c in resp.choices] == want and [c.index for c in resp.choices] == [0, 1, 2]
    assert resp.usage.completion_tokens == sum(len(s.tokens) - len(ids) for s in best)
    chat = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Name a color."}], max_tokens=6, n=2,
        temperature=0, extra_body={"use_beam_search": True},
    )  # fmt: skip
    assert len(chat.choices) == 2 and chat.choices[0].message.content != chat.choices[1].message.content
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="use_beam_search cannot follow"):  # no silent free text
        client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2, tools=[tool],
            tool_choice="required", extra_body={"use_beam_search": True},
        )  # fmt: skip
    with_logprobs = greedy(client, model_name, max_tokens=8, n=3, logprobs=1, extra_body={"use_beam_search": True})
    lp = with_logprobs.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(
        [s[t].logprob for s, t in zip(best[0].logprobs, best[0].tokens[len(ids) :])]
    )
    chunks = list(greedy(client, model_name, max_tokens=8, n=3, stream=True, extra_body={"use_beam_search": True}))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)]
    assert streamed == want
    for extra, match in [
        ({"n": 11}, "a width n of 11 needs the top 22"),
        ({"n": 11, "stream": True}, "a width n of 11"),  # before the stream begins
        ({"n": 2, "extra_body": {"response_format": {"type": "json_object"}}}, "structured output"),
        ({"n": 2, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
    ]:
        kw = {"max_tokens": 2, **extra}
        kw["extra_body"] = {"use_beam_search": True, **kw.get("extra_body", {})}
        with pytest.raises(openai.BadRequestError, match=match):
            greedy(client, model_name, **kw)


def _token_counts(chunks) -> list[int]:
    """The number of tokens each streamed chunk carries (its logprobs' tokens)."""
    return [len(c.choices[0].logprobs.tokens) for c in chunks if c.choices and c.choices[0].logprobs]


def test_stream_interval_gathers_tokens_in_each_chunk(server, client, model_name):
    """vLLM's stream_interval: a chunk once N tokens wait, the first and the last at once; the text is the whole
    one's. vllm_xargs is accepted (SamplingParams.extra_args)."""
    full = greedy(client, model_name, max_tokens=13, extra_body={"ignore_eos": True})
    body = {"ignore_eos": True, "stream_interval": 4, "vllm_xargs": {"tag": "a", "ids": [1, 2.5]}}
    chunks = list(
        client.completions.create(
            model=model_name, prompt=PROMPT, temperature=0, max_tokens=13, stream=True, logprobs=1, extra_body=body
        )
    )
    assert _token_counts(chunks) == [1, 4, 4, 4]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    with pytest.raises(openai.BadRequestError, match="stream_interval"):
        greedy(client, model_name, stream=True, extra_body={"stream_interval": 0})
