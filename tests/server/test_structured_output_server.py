"""Structured output over HTTP, on the shared server (the default model): OpenAI's `response_format`, vLLM's
`structured_outputs` and the older `guided_*` fields all take effect (they were once accepted and ignored), in
both endpoints, streamed or not; a constraint that does not parse is a 400 naming its field while the requests in
flight finish; two constraints at once, or a backend pagedllm does not run, are 400s too."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 50000000},
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Which city is the capital of France, and how many people live there?"}]


def test_response_format_json_schema(client, model_name):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    resp = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=60, temperature=0.8, seed=3, response_format=fmt
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    # Streamed: the concatenated deltas are the same kind of document.
    stream = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=60, temperature=0, response_format=fmt, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_response_format_json_object(client, model_name):
    messages = [{"role": "user", "content": 'Describe Paris as a JSON object with the keys "name" and "country".'}]
    resp = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=300, temperature=0, response_format={"type": "json_object"}
    )
    assert resp.choices[0].finish_reason == "stop", resp.choices[0].message.content
    assert isinstance(json.loads(resp.choices[0].message.content), dict)


def test_structured_outputs_and_guided_fields_take_effect(client, model_name):
    prompt = "My favourite colour is"
    cases = [
        ({"structured_outputs": {"choice": ["cyan", "magenta"]}}, lambda t: t in ("cyan", "magenta")),
        ({"guided_choice": ["cyan", "magenta"]}, lambda t: t in ("cyan", "magenta")),
        ({"guided_regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        ({"structured_outputs": {"regex": r"(up|down){2}"}}, lambda t: re.fullmatch(r"(up|down){2}", t)),
        ({"guided_grammar": 'root ::= "a" ("b" | "c") [bc]?'}, lambda t: re.fullmatch(r"a[bc]{1,2}", t)),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"guided_json": json.dumps(SCHEMA), "guided_decoding_backend": "guidance"}, lambda t: json.loads(t)),
    ]
    for extra, check in cases:
        resp = client.completions.create(
            model=model_name, prompt=prompt, max_tokens=40, temperature=0.8, seed=1, extra_body=extra
        )
        text = resp.choices[0].text
        assert resp.choices[0].finish_reason == "stop", (extra, text)
        assert check(text), (extra, text)
    # Chat with a vLLM extra field, streamed.
    stream = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        stream=True,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) in ("yes", "no")


@pytest.mark.parametrize(
    ("extra", "param", "fragment"),
    [
        ({"guided_regex": "[a-z"}, "guided_regex", "unclosed character class"),
        ({"structured_outputs": {"json": {"type": "objectx"}}}, "structured_outputs", "objectx"),
        ({"guided_choice": []}, "guided_choice", "non-empty strings"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex", "give one output constraint"),
        ({"structured_outputs": {"regex": "a", "xml": "b"}}, "structured_outputs", "'xml'"),
        ({"guided_choice": ["a"], "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "llguidance"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, "response_format", "schema"),
    ],
)
def test_bad_constraints_are_400(client, model_name, extra, param, fragment):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=model_name, prompt="x", max_tokens=4, extra_body=extra)
    body = exc.value.body
    assert fragment in body["message"], body
    assert body["param"] == param, body


def test_a_broken_schema_is_400_while_others_finish(server, model_name):
    async def main() -> None:
        aclient = server.async_client()
        long_run = asyncio.create_task(
            aclient.completions.create(
                model=model_name,
                prompt="Once upon a time",
                max_tokens=48,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
        )
        constrained = asyncio.create_task(
            aclient.completions.create(
                model=model_name, prompt="A city:", max_tokens=40, temperature=0, extra_body={"guided_json": SCHEMA}
            )
        )
        await asyncio.sleep(0.5)
        with pytest.raises(openai.BadRequestError):
            await aclient.completions.create(
                model=model_name,
                prompt="x",
                max_tokens=4,
                extra_body={"guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
            )
        done = await long_run
        assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 48
        jsonschema.validate(json.loads((await constrained).choices[0].text), SCHEMA)

    asyncio.run(main())
