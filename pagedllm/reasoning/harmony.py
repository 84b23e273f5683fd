"""gpt-oss's harmony output format, read as text with its special tokens kept (`--reasoning-parser openai_gptoss`,
the default for gpt-oss models; `--tool-call-parser openai` for its function calls).

Contract. A reply is a run of messages, each `HEADER<|message|>BODY` closed by `<|end|>`, `<|call|>` or `<|return|>`,
the next one opened by `<|start|>` (the prompt opens the first: its template ends with `<|start|>assistant`). A header
holds the role (after `<|start|>`), `<|channel|>NAME`, an optional recipient `to=RECIPIENT` (before or after the
channel) and a content type (`<|constrain|>json`, or a bare `json`). `parse(text)` sorts the bodies:
* channel `analysis`, or a recipient that is a built-in tool (`python`, `browser.*`, ...): reasoning;
* a recipient `functions.NAME`: a function call, NAME with the body as its arguments;
* anything else (`final`, a `commentary` preamble, no channel): content.
Text that does not open with a harmony marker (a model constrained to JSON from its first token) is all content.

The reasoning parser gives the calls on in its content as `<|channel|>commentary to=functions.NAME<|message|>ARGS
<|call|>` (CALL_PREFIX ... CALL_END), which the `openai` tool parser reads; without that parser the call stays text
in the content. Streamed (`HarmonyStream`), each step parses what has arrived but a marker cut in two at its end, and
sends what the reasoning and the content grew by: a message's pieces go out as its body arrives, a call's once its
header is whole; joined, they are the whole text's split.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CALL, RETURN, CONSTRAIN = "<|call|>", "<|return|>", "<|constrain|>"
CALL_PREFIX = "<|channel|>commentary to=functions."  # a call as the reasoning parser hands it on
CALL_END = CALL
_BODY_END = re.compile(r"<\|(?:end|call|return|start)\|>")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")


@dataclass
class Message:
    header: str
    body: str
    closed: bool  # its end marker (or the next message) came

    @property
    def channel(self) -> str | None:
        m = _CHANNEL.search(self.header)
        return m.group(1) if m else None

    @property
    def recipient(self) -> str | None:
        m = _RECIPIENT.search(self.header)
        return m.group(1) if m else None


def is_harmony(text: str) -> bool | None:
    """Whether a reply is in harmony (it opens with a marker or a recipient); None while too little has come."""
    head = text.lstrip()
    if head.startswith(("<|", "to=")):
        return True
    if not head or "to=".startswith(head) or "<|".startswith(head):
        return None
    return False


def messages(text: str) -> list[Message]:
    """The messages of a harmony reply; a header still without its `<|message|>` is left out."""
    out: list[Message] = []
    pos = 0
    while True:
        m = text.find(MESSAGE, pos)
        if m < 0:
            return out
        header = text[pos:m]
        start = m + len(MESSAGE)
        end = _BODY_END.search(text, start)
        if end is None:
            out.append(Message(header, text[start:], False))
            return out
        out.append(Message(header, text[start : end.start()], True))
        pos = end.end() if end.group() != START else end.start()
        if text.startswith(START, pos):
            pos += len(START)


@dataclass
class Split:
    reasoning: str
    content: str  # with calls as CALL_PREFIX NAME MESSAGE ARGS CALL_END


def split(text: str) -> Split:
    """The reasoning and the content of a whole (or partial) reply (module docstring)."""
    for marker in (RETURN, CALL):  # a stop token the detokenizer kept
        if text.endswith(marker):
            text = text[: -len(marker)]
    kind = is_harmony(text)
    if kind is not True:
        return Split("", "" if kind is None else text)
    reasoning: list[str] = []
    content: list[str] = []
    for msg in messages(text):
        recipient = msg.recipient
        if recipient is not None and recipient.startswith("functions."):
            name = recipient[len("functions.") :]
            content.append(f"{CALL_PREFIX}{name}{MESSAGE}{msg.body}" + (CALL_END if msg.closed else ""))
        elif msg.channel == "analysis" or recipient is not None:
            reasoning.append(msg.body)
        else:
            content.append(msg.body)
    return Split("".join(reasoning), "".join(content))


def stable(text: str) -> str:
    """`text` without a marker cut in two at its end (`<|` with no `|>` after it)."""
    i = text.rfind("<|")
    if i >= 0 and text.find("|>", i) < 0:
        return text[:i]
    if text.endswith("<"):
        return text[:-1]
    return text


class HarmonyStream:
    """The streamed split of one reply: `step(delta)` -> (reasoning piece, content piece); `finish()` the rest."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = Split("", "")

    def step(self, delta: str) -> tuple[str | None, str | None]:
        self.text += delta
        return self._send(split(stable(self.text)))

    def finish(self) -> tuple[str | None, str | None]:
        return self._send(split(self.text))

    def _send(self, now: Split) -> tuple[str | None, str | None]:
        pieces = []
        for old, new in ((self.sent.reasoning, now.reasoning), (self.sent.content, now.content)):
            # a reply only grows, and so does each part of its split; were one to shrink (a body closed by a marker
            # that had looked like text), what was sent stays sent
            pieces.append(new[len(old) :] if new.startswith(old) else "")
        if now.reasoning.startswith(self.sent.reasoning):
            self.sent.reasoning = now.reasoning
        if now.content.startswith(self.sent.content):
            self.sent.content = now.content
        return pieces[0] or None, pieces[1] or None
