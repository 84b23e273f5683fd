"""Tool-call parsers: turn a model's text into OpenAI `tool_calls`, whole or streamed.

Contract. A parser is registered by name (`--tool-call-parser NAME`; `ToolParserManager.get(name)` returns its
class) and made per request with the tokenizer. `extract_tool_calls(text)` gives the content before the calls and
the calls, each with its `arguments` as a JSON string (the model's own text of the value).
`extract_tool_calls_streaming(delta_text)` is fed the text as it is generated and returns what the client should
get now: content, and tool-call deltas (the id, type and name once, then pieces of the arguments). A call's
`arguments` is the model's own JSON text of the value, whole or streamed: the pieces are that text as it grows
(a bracket-and-string scanner finds where the value ends), so joined they equal the non-streamed `arguments`
exactly. (Re-serialising partial parses cannot promise that: `1.5e3` parsed early dumps as `1.5`, whole as
`1500.0`.) `finish()` flushes what the stream still holds at the end of the output.

Parsers (vLLM's names): `hermes` (`<tool_call>{json}</tool_call>`), `llama3_json` (alias `llama4_json`),
`mistral`, `pythonic` (alias `llama4_pythonic`), `qwen3_coder` and `openai` (gpt-oss's harmony calls, as the
`openai_gptoss` reasoning parser hands them on); each module's docstring gives its format. A
parser is made with the tokenizer and the request's tools (`Parser(tokenizer, tools=None)`: qwen3_coder types its
values by them). The newer ones are `IncrementalToolParser`s: written once as a stream, the whole-text parse being
the same machine fed the whole text. `FirstCallOnly` wraps a parser for `parallel_tool_calls: false`.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract import (
    ExtractedToolCalls,
    FirstCallOnly,
    FunctionCall,
    IncrementalToolParser,
    StreamedToolCallDelta,
    ToolCall,
    ToolParser,
    ToolParserManager,
)
from pagedllm.entrypoints.openai.tool_parsers.harmony_calls import HarmonyToolParser
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from pagedllm.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from pagedllm.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser

__all__ = [
    "ExtractedToolCalls",
    "FirstCallOnly",
    "FunctionCall",
    "HarmonyToolParser",
    "HermesToolParser",
    "IncrementalToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "PythonicToolParser",
    "Qwen3CoderToolParser",
    "StreamedToolCallDelta",
    "ToolCall",
    "ToolParser",
    "ToolParserManager",
]
