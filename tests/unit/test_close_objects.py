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
    # a key required but not listed: left open (closing it would make the schema unsatisfiable)
    assert "additionalProperties" not in close_objects({"properties": {"a": {}}, "required": ["a", "b"]})


AB = '{"a": 1, "b": 2}'
BASE = {"type": "object", "properties": {"a": {"type": "integer"}}}
B = {"type": "object", "properties": {"b": {"type": "integer"}}}
# (schema, a document it accepts, a key the outermost object refuses or None: a merged allOf stays open, as a part
# of it cannot know the other parts' keys)
COMPOSED = [
    ({"allOf": [{"$ref": "#/$defs/Base"}, B], "$defs": {"Base": BASE}}, AB, None),  # OpenAPI's inheritance
    ({"allOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/definitions/B"}], "$defs": {"A": BASE}, "definitions": {"B": B}},
     AB, None),
    ({"$ref": "#/$defs/Base", "properties": {"b": {"type": "integer"}}, "$defs": {"Base": BASE}}, AB, None),
    ({"properties": {"a": {"type": "integer"}}, "anyOf": [B, {"required": ["a"]}]}, AB, None),
    ({"allOf": [BASE, {"anyOf": [B]}]}, AB, None),
    ({"allOf": [{"$ref": "#/$defs/Mid"}, B], "$defs": {"Mid": {"allOf": [{"$ref": "#/$defs/Base"}]}, "Base": BASE}},
     AB, None),  # a reference reached through a reference
    # a plain union of shapes, and a plain reference: closed
    ({"anyOf": [{"$ref": "#/$defs/Base"}, B], "$defs": {"Base": BASE}}, '{"a": 1}', "b"),
    ({"type": "object", "properties": {"loc": {"$ref": "#/$defs/Base"}}, "$defs": {"Base": BASE}}, '{"loc": {"a": 1}}',
     None),
]  # fmt: skip


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


@pytest.mark.parametrize(("schema", "good", "extra"), COMPOSED)
def test_composed_schemas_still_take_what_their_parts_list(backend, schema, good, extra) -> None:
    assert _accepts(backend, schema, good), (schema, good)
    if extra is not None:  # the outermost object still refuses a key that no part lists
        assert not _accepts(backend, schema, good[:-1] + f', "{extra}": 3}}'), schema


def test_a_plain_reference_target_is_closed(backend) -> None:
    schema = COMPOSED[-1][0]
    assert not _accepts(backend, schema, '{"loc": {"a": 1, "z": 2}}')


def test_a_schema_nested_too_deeply_is_a_value_error() -> None:
    from pagedllm.structured_output.guidance import grammar_text

    deep = '{"anyOf": [' * 450 + '{"type": "integer"}' + "]}" * 450  # json.loads takes it
    with pytest.raises(ValueError, match="nested too deeply|recursion"):
        grammar_text(("json", deep, "any"))


def test_required_tool_calls_take_each_tools_definitions_to_the_root(backend) -> None:
    """A Pydantic-made tool schema refers to its `$defs` from its root; inside the calls' list schema they move to
    that schema's root, where the references point (two tools defining one name differently: a ValueError)."""
    from pagedllm.entrypoints.openai.tool_parsers.required import required_calls_schema

    loc = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    params = {"type": "object", "properties": {"where": {"$ref": "#/$defs/Loc"}}, "required": ["where"],
              "$defs": {"Loc": loc}}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "weather", "parameters": params}},
             {"type": "function", "function": {"name": "time", "parameters": params}}]  # fmt: skip
    schema = required_calls_schema(tools)
    assert schema["$defs"] == {"Loc": loc} and "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert "$defs" in params  # the request's own tools are left as they were
    good = '[{"name": "weather", "parameters": {"where": {"city": "Paris"}}}]'
    assert _accepts(backend, schema, good)
    assert not _accepts(backend, schema, good.replace('"Paris"}', '"Paris", "zip": 1}'))
    other = {**params, "$defs": {"Loc": {"type": "string"}}}
    clash = [tools[0], {"type": "function", "function": {"name": "time", "parameters": other}}]
    with pytest.raises(ValueError, match="'weather' and 'time' define \\$defs/Loc differently"):
        required_calls_schema(clash)
