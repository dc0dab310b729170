"""Argument helpers with vLLM's semantics, pure Python (minicore.config uses them).

Mirrors vllm/utils/argparse_utils.py (human_readable_int), the template loading of vLLM's
chat utilities (load_chat_template) and the generation-config reading of vllm/config/model.py
(try_get_generation_config, get_diff_sampling_param). Left out: human_readable_int_or_auto
(minicore does not derive max_model_len from the model), a generation config taken from
config.json when a model has no generation_config.json, --override-generation-config.
"""

import argparse
import json
import os
import re
from pathlib import Path

# generation_config.json keys that are sampling defaults, in vLLM's order (get_diff_sampling_param).
_SAMPLING_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature",
                  "top_k", "top_p", "min_p", "max_new_tokens")

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


def check_generation_config(value: str) -> None:
    """--generation-config: 'auto' (the model's generation_config.json), 'vllm' (vLLM's neutral
    sampling defaults) or a local folder holding a generation_config.json."""
    if value in ("auto", "vllm"):
        return
    if not (Path(value).expanduser() / "generation_config.json").is_file():
        raise ValueError(f"--generation-config {value!r} must be auto, vllm or a local folder "
                         "holding a generation_config.json (minicore loads local files only; no "
                         "downloads)")


def read_generation_config(folder: str | os.PathLike) -> dict:
    """A folder's generation_config.json as a dict; {} when it has none (vLLM too then goes on
    with its own defaults)."""
    path = Path(folder).expanduser() / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"could not read {path}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return config


def diff_sampling_param(generation_config: dict) -> dict:
    """The sampling defaults a generation config sets (vLLM's get_diff_sampling_param):
    HF's max_new_tokens becomes max_tokens."""
    diff = {k: generation_config[k] for k in _SAMPLING_KEYS if generation_config.get(k) is not None}
    if "max_new_tokens" in diff:
        diff["max_tokens"] = diff.pop("max_new_tokens")
    return diff
