"""gpt-oss's function calls, vLLM's `openai` tool parser: a harmony message to `functions.NAME` whose body is the
arguments, as the `openai_gptoss` reasoning parser hands it on in the content (pagedllm/reasoning/harmony.py):

    <|channel|>commentary to=functions.NAME<|message|>ARGUMENTS<|call|>

The content is the text outside the calls (the final answer, a preamble); `arguments` is the body as the model wrote
it (its JSON), without surrounding whitespace, `{}` when empty; a call cut off at the end of the output ends there.
Streamed: a call opens when its name is whole, and its arguments go out as they are written (whitespace at their
end held back): joined, the same string."""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract import IncrementalToolParser, ToolParserManager
from pagedllm.reasoning.harmony import CALL_END, CALL_PREFIX, MESSAGE
from pagedllm.text_tags import partial_tag_length


@ToolParserManager.register("openai")
class HarmonyToolParser(IncrementalToolParser):
    needs_special_tokens = True

    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self._mode = "content"
        self._region = 0  # where the open call's text starts

    def _advance(self, final: bool) -> None:
        self._run_steps({"content": self._content_step, "name": self._name_step, "args": self._args_step}, final)

    def _content_step(self, final: bool) -> bool:
        i = self._content_until(CALL_PREFIX, final)
        if i is None:
            return False
        self._region, self._pos, self._mode = i, i + len(CALL_PREFIX), "name"
        return True

    def _name_step(self, final: bool) -> bool:
        i = self._text.find(MESSAGE, self._pos)
        if i < 0:
            if final:
                self._give_up(self._region)
            return False
        self._open_call(self._text[self._pos : i].strip())
        self._pos, self._mode = i + len(MESSAGE), "args"
        return True

    def _args_step(self, final: bool) -> bool:
        text, pos = self._text, self._pos
        j = text.find(CALL_END, pos)
        if j < 0 and not final:
            self._send_arguments(text[pos : len(text) - partial_tag_length(text[pos:], CALL_END)].strip())
            return False
        end = len(text) if j < 0 else j
        self._close_call(text[pos:end].strip() or "{}")
        self._pos, self._mode = (end if j < 0 else j + len(CALL_END)), "content"
        return j >= 0
