"""Structured output through `LLM` on the default model (SmolLM2-135M-Instruct): JSON schemas, any JSON object,
regex, choice and grammars, sampled (temperature 0.8, several seeds) and checked in full (jsonschema, fullmatch);
also under preemption, with n > 1, across tensor-parallel ranks, and the error paths (a constraint that does not
parse is a ValueError before the engine; one that fails in the engine finishes that request alone with finish
reason "error", the rest complete and every KV block is freed)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams

SEEDS = (1, 2, 3)

SCHEMAS: dict[str, dict] = {
    "enum_and_range": {
        "type": "object",
        "properties": {
            "color": {"type": "string", "enum": ["red", "green", "blue"]},
            "count": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["color", "count"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 20},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["person", "active"],
        "additionalProperties": False,
    },
    "bounded_array": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 3},
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["code", "score"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    engine = LLM(max_model_len=1024, kv_cache_memory_bytes="256MiB")
    yield engine
    engine.shutdown()


def _chat(llm: LLM, text: str) -> dict:
    templated = llm.input_processor.apply_chat_template([{"role": "user", "content": text}])
    return {"prompt_token_ids": llm.input_processor.tokenize(templated, add_special_tokens=False)}


def _sampled(**constraint: object) -> list[SamplingParams]:
    so = StructuredOutputsParams(**constraint)  # type: ignore[arg-type]
    return [SamplingParams(temperature=0.8, seed=s, max_tokens=300, structured_outputs=so) for s in SEEDS]


def _check_clean(llm: LLM) -> None:
    stats = llm.check_invariants()
    assert stats["unfinished"] == 0 and stats["in_use"] == 0, stats


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schemas_hold_when_sampling(llm: LLM, name: str) -> None:
    schema = SCHEMAS[name]
    prompt = _chat(llm, f"Reply with a JSON object for this schema: {json.dumps(schema)}")
    params = _sampled(json=schema)
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (completion.finish_reason, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)
    _check_clean(llm)


def test_json_object_and_json_text(llm: LLM) -> None:
    prompt = _chat(llm, 'Describe a cat as a JSON object with the keys "name" and "age".')
    params = [p.clone(max_tokens=300) for p in _sampled(json_object=True)]
    outs = llm.generate([prompt] * 3, params, use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        assert isinstance(json.loads(out.outputs[0].text), dict)
    # The schema as JSON text, and compact JSON on request.
    schema = SCHEMAS["enum_and_range"]
    params = SamplingParams(
        temperature=0, max_tokens=60, structured_outputs={"json": json.dumps(schema), "disable_any_whitespace": True}
    )
    text = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text
    value = json.loads(text)
    jsonschema.validate(value, schema)
    assert text == json.dumps(value, separators=(",", ":"))


def test_regex_choice_and_grammars_match_fully(llm: LLM) -> None:
    prompt = _chat(llm, "Give me a date, a colour and a greeting.")
    cases: list[tuple[dict, object]] = [
        ({"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}, re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")),
        ({"regex": r"(yes|no), because [a-z ]{3,30}\."}, re.compile(r"(yes|no), because [a-z ]{3,30}\.")),
        ({"choice": ["red", "green", "blue", "dark purple"]}, {"red", "green", "blue", "dark purple"}),
        # Lark, and the same language in GBNF (llama.cpp's notation).
        (
            {"grammar": 'start: greeting " " name\ngreeting: "hello" | "hi"\nname: /[a-z]{2,8}/'},
            re.compile(r"(hello|hi) [a-z]{2,8}"),
        ),
        ({"grammar": 'root ::= ("hello" | "hi") " " [a-z] [a-z] [a-z]?'}, re.compile(r"(hello|hi) [a-z]{2,3}")),
    ]
    for constraint, expected in cases:
        outs = llm.generate([prompt] * len(SEEDS), _sampled(**constraint), use_tqdm=False)
        for out in outs:
            text = out.outputs[0].text
            assert out.outputs[0].finish_reason == "stop", (constraint, text)
            if isinstance(expected, set):
                assert text in expected, (constraint, text)
            else:
                assert expected.fullmatch(text), (constraint, text)  # type: ignore[union-attr]
    _check_clean(llm)


def test_constrained_and_free_requests_in_one_batch(llm: LLM) -> None:
    """A constrained request, free ones beside it: the grammar's rows are masked, not theirs (free text that no
    grammar of this schema would allow: it does not start with "{")."""
    free_prompt = _chat(llm, "What is the capital of France?")
    greedy = SamplingParams(temperature=0, max_tokens=16)
    constrained = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": SCHEMAS["pattern"]})
    outs = llm.generate([free_prompt, _chat(llm, "A code and a score."), free_prompt], [greedy, constrained, greedy])
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert len(outs[0].outputs[0].token_ids) > 1 and not outs[0].outputs[0].text.lstrip().startswith("{")
    jsonschema.validate(json.loads(outs[1].outputs[0].text), SCHEMAS["pattern"])


def test_forced_tokens_ride_as_drafts_and_change_no_token(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tokens a grammar forces (keys, the punctuation around them) are verified as drafts: fewer steps, the same
    tokens as an engine that decodes them one by one ($PAGEDLLM_GRAMMAR_FORCED_DRAFTS=0), greedy and seeded, compact
    JSON and JSON with free whitespace; the verified ones count as forced drafts, not as speculative ones."""
    schema = SCHEMAS["nested"]
    prompt = _chat(llm, f"Reply with a JSON object for this schema: {json.dumps(schema)}")
    params = [
        SamplingParams(temperature=0, max_tokens=120, structured_outputs={"json": schema}),
        SamplingParams(
            temperature=0, max_tokens=120, structured_outputs={"json": schema, "disable_any_whitespace": True}
        ),
        *[p.clone(max_tokens=120) for p in _sampled(json=schema)],
    ]
    before = llm.engine_core.call_utility("get_structured_output_stats")
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    after = llm.engine_core.call_utility("get_structured_output_stats")
    drafts = after["forced_drafts"] - before["forced_drafts"]
    assert drafts > 0 and after["forced_accepted"] - before["forced_accepted"] > 0, (before, after)
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    _check_clean(llm)

    monkeypatch.setenv("PAGEDLLM_GRAMMAR_FORCED_DRAFTS", "0")
    plain = LLM(max_model_len=1024, kv_cache_memory_bytes="64MiB")
    try:
        expected = plain.generate([prompt] * len(params), params, use_tqdm=False)
        assert plain.engine_core.call_utility("get_structured_output_stats")["forced_drafts"] == 0
    finally:
        plain.shutdown()
    for out, ref in zip(outs, expected, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids, (out.outputs[0].text, ref.outputs[0].text)


def test_n_samples_each_follow_the_grammar(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=20, structured_outputs={"regex": r"[a-z]{3,6}!"})
    out = llm.generate(_chat(llm, "Say a word."), params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    assert all(re.fullmatch(r"[a-z]{3,6}!", c.text) for c in out.outputs), [c.text for c in out.outputs]


def test_bad_constraints_are_value_errors_before_the_engine(llm: LLM) -> None:
    prompt = _chat(llm, "hi")
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar or json_object"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]})
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="choice must be a list of non-empty strings"):
        StructuredOutputsParams(choice=[])
    for constraint in ({"regex": "[a-z"}, {"json": {"type": "objectx"}}, {"grammar": "start: undefined_rule"}):
        with pytest.raises(ValueError):
            llm.generate(prompt, SamplingParams(structured_outputs=constraint), use_tqdm=False)
    _check_clean(llm)
    assert llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_a_grammar_failing_in_the_engine_fails_that_request_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine core in this process (inproc client), its compile made to fail for one regex."""
    llm = LLM(max_model_len=512, kv_cache_memory_bytes="64MiB", engine_client="inproc")
    try:
        manager = llm.engine_core.engine_core.structured_output_manager
        original = manager._compile

        def failing(key):  # noqa: ANN001, ANN202
            if key[1] == "x+":
                raise ValueError("made to fail")
            return original(key)

        monkeypatch.setattr(manager, "_compile", failing)
        prompt = _chat(llm, "hi")
        params = [
            SamplingParams(temperature=0, max_tokens=8),
            SamplingParams(temperature=0, max_tokens=8, structured_outputs={"regex": "x+"}),
            SamplingParams(temperature=0, max_tokens=8, structured_outputs={"regex": "[ab]+"}),
        ]
        outs = llm.generate([prompt] * 3, params, use_tqdm=False)
        failed = outs[1].outputs[0]
        assert failed.finish_reason == "error" and "made to fail" in str(failed.stop_reason)
        assert failed.token_ids == []
        assert len(outs[0].outputs[0].token_ids) == 8
        assert re.fullmatch("[ab]+", outs[2].outputs[0].text)
        _check_clean(llm)
    finally:
        llm.shutdown()


def test_preemption_mid_constrained_request_keeps_it_valid() -> None:
    """A KV cache of 15 blocks of 16 tokens for four concurrent requests of the same ~135 prompt tokens (8 blocks,
    shared through the prefix cache, and one of their own) and 20-35 output tokens: when they all need a second
    block of their own they outgrow the cache, and some are preempted (recomputed) in the middle of their JSON,
    which stays valid. (Measured with four sets of seeds: one to three preemptions each.)"""
    llm = LLM(max_model_len=240, block_size=16, num_gpu_blocks_override=15, max_num_batched_tokens=256)
    try:
        schema = SCHEMAS["nested"]
        prompt = _chat(llm, f"JSON for {json.dumps(schema)}")
        params = [
            SamplingParams(temperature=0.8, seed=s, max_tokens=100, structured_outputs={"json": schema})
            for s in range(4)
        ]
        outs = llm.generate([prompt] * 4, params, use_tqdm=False)
        stats = llm.check_invariants()
        assert stats["num_preemptions"] > 0, stats
        for out in outs:
            assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
        assert stats["unfinished"] == 0 and stats["in_use"] == 0
    finally:
        llm.shutdown()


@pytest.mark.timeout(300)
def test_tensor_parallel_ranks_sample_under_the_grammar() -> None:
    """TP=2 (worker processes): the grammar bitmask reaches the ranks through sample_tokens; same tokens as TP=1."""
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": SCHEMAS["enum_and_range"]})
    results = []
    for tp in (1, 2):
        llm = LLM(max_model_len=512, kv_cache_memory_bytes="64MiB", tensor_parallel_size=tp)
        try:
            out = llm.generate(_chat(llm, "Pick a colour and a count."), params, use_tqdm=False)[0].outputs[0]
            results.append(out.token_ids)
            jsonschema.validate(json.loads(out.text), SCHEMAS["enum_and_range"])
        finally:
            llm.shutdown()
    assert results[0] == results[1]


def test_llm_chat_gives_tools_to_the_template(llm: LLM) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    template = (
        "{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    )
    out = llm.chat(
        [{"role": "user", "content": "Weather in Oslo?"}],
        SamplingParams(temperature=0, max_tokens=2),
        use_tqdm=False,
        chat_template=template,
        tools=tools,
    )[0]
    assert out.prompt.startswith("TOOL get_weather\nuser: Weather in Oslo?")


def test_template_gets_tool_call_arguments_as_an_object(llm: LLM) -> None:
    """As vLLM: a past call's arguments given as JSON text reach the template as an object, so that `tojson` writes
    them once (the Qwen and Hermes templates do); empty text is an empty object; other text that is not a JSON object
    is left as it is."""
    template = (
        "{% for m in messages %}{{ m.role }}:"
        "{% for c in m.tool_calls or [] %} {{ c.function.arguments | tojson }}{% endfor %}|{% endfor %}"
    )
    calls = [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"city": "Oslo"}'}},
        {"id": "b", "type": "function", "function": {"name": "f", "arguments": "not json"}},
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": ""}},
    ]
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    text = llm.input_processor.apply_chat_template(messages, add_generation_prompt=False, chat_template=template)
    assert text == 'user:|assistant: {"city": "Oslo"} "not json" {}|'
    assert calls[0]["function"]["arguments"] == '{"city": "Oslo"}'  # the caller's messages are not changed
