"""Argument helpers with vLLM's semantics, pure Python (minicore.config uses them).

Mirrors vllm/utils/argparse_utils.py (human_readable_int) and the template loading of vLLM's
chat utilities (load_chat_template). Left out: human_readable_int_or_auto (minicore does not derive
max_model_len from the model).
"""

import argparse
import os
import re

# Characters that make a --chat-template value an inline template, not a file path (vLLM's rule).
_JINJA_CHARS = "{}\n"


def human_readable_int(value: str) -> int:
    """vLLM's integer flag type (vllm/utils/argparse_utils.py), followed exactly: '1k' is 1000,
    '1K' 1024, '25.6k' 25600; decimals with binary suffixes (K, M, G, T) are refused."""
    value = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if not match:
        return int(value)
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 10 ** {"k": 3, "m": 6, "g": 9, "t": 12}[suffix])
    try:
        return int(number) * 2 ** {"K": 10, "M": 20, "G": 30, "T": 40}[suffix]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"Decimals are not allowed with binary suffixes like {suffix}. Did you mean to use "
            f"{number}{suffix.lower()} instead?") from None


def resolve_chat_template(chat_template: str | None) -> str | None:
    """--chat-template's value as a template: a string with Jinja characters is the template
    itself, anything else the path of a file holding it (vLLM's load_chat_template)."""
    if chat_template is None or any(c in chat_template for c in _JINJA_CHARS):
        return chat_template
    try:
        with open(os.path.expanduser(chat_template), encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"chat_template {chat_template!r} looks like a file path, but it could "
                         f"not be read ({e.strerror}), and it is no inline template") from None
