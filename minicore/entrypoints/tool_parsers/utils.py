"""Helpers the parsers share (vllm/tool_parsers/utils.py): how much of a tag a text ends with,
and whether a text is whole JSON."""

import json


def partial_tag_overlap(text: str, tag: str) -> int:
    """The length of the longest proper prefix of tag that text ends with."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def is_complete_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):  # nested past Python's recursion limit: not a call
        return False
    return True
