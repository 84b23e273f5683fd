"""Tags in streamed text: how much of a text's end may be the start of a tag not yet complete.

Stream parsers (tool calls, reasoning) hold that much back until the next delta tells whether the tag comes."""

from __future__ import annotations


def partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag` (0 when none is)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
