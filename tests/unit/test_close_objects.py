"""JSON schemas are read as vLLM's default backend and llama.cpp read them: an object that lists its properties
allows no others unless it says so (structured_output/guidance.py close_objects), checked on the schema and on the
compiled grammar with the default model's tokenizer."""

from __future__ import annotations

import json

import pytest

from pagedllm.structured_output.guidance import GuidanceBackend, close_objects

TOOL_ARGS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_objects_with_properties_are_closed_and_the_rest_kept() -> None:
    schema = {
        "type": "object",
        "properties": {
            "inner": {"type": "object", "properties": {"n": {"type": "integer"}}},
            "open": {"type": "object", "properties": {"n": {}}, "additionalProperties": True},
            "typed": {"type": "object", "properties": {}, "additionalProperties": {"type": "string"}},
            "any": {"type": "object"},
            "properties": {"type": "object", "properties": {"x": {"enum": [{"properties": {"y": 1}}]}}},
            "list": {"type": "array", "items": {"type": "object", "properties": {"k": {}}}},
        },
        "$defs": {"D": {"type": "object", "properties": {"q": {}}}},
    }
    closed = close_objects(schema)
    props = closed["properties"]
    assert closed["additionalProperties"] is False and props["inner"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True and props["typed"]["additionalProperties"] == {
        "type": "string"
    }
    assert "additionalProperties" not in props["any"]  # {"type": "object"}: any object
    assert props["properties"]["additionalProperties"] is False  # a property named "properties" is a schema
    assert props["properties"]["properties"]["x"]["enum"] == [{"properties": {"y": 1}}]  # values stay as they are
    assert props["list"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["D"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # a copy
    # beside or inside an allOf (or any composition), closing would refuse the other parts' properties
    composed = {
        "properties": {"a": {}},
        "allOf": [{"properties": {"b": {}}}, {"properties": {"c": {"type": "object", "properties": {"d": {}}}}}],
    }
    out = close_objects(composed)
    assert "additionalProperties" not in out
    assert all("additionalProperties" not in part for part in out["allOf"])
    assert out["allOf"][1]["properties"]["c"]["additionalProperties"] is False  # a plain object below is closed
    assert "additionalProperties" not in close_objects({"properties": {"a": {}}, "anyOf": [{"required": ["a"]}]})


@pytest.fixture(scope="module")
def backend() -> tuple[GuidanceBackend, object]:
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.tokenizer import get_tokenizer

    mc = EngineArgs(max_model_len=256).create_model_config()
    tokenizer = get_tokenizer(mc)
    return GuidanceBackend(tokenizer, mc.vocab_size), tokenizer


def _accepts(backend: tuple[GuidanceBackend, object], schema: dict, text: str) -> bool:
    guidance, tokenizer = backend
    grammar = guidance.compile(("json", json.dumps(schema), "any"))
    return grammar.accept_tokens("r", tokenizer.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("schema", "text", "ok"),
    [
        (TOOL_ARGS, '{"city": "Paris"}', True),
        (TOOL_ARGS, '{"city": "Paris", "required": true}', False),  # what a 0.5B model wrote
        ({**TOOL_ARGS, "additionalProperties": True}, '{"city": "Paris", "required": true}', True),
        ({"type": "object"}, '{"anything": [1, 2]}', True),
    ],
)
def test_the_compiled_grammar_refuses_keys_the_schema_does_not_list(backend, schema, text, ok) -> None:
    assert _accepts(backend, schema, text) is ok
