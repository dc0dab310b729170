"""Argument helpers with vLLM's semantics, pure Python (minicore.config uses them).

Mirrors vllm/utils/argparse_utils.py (human_readable_int), the template loading of vLLM's
chat utilities (load_chat_template) and the generation-config reading of vllm/config/model.py
(try_get_generation_config, get_diff_sampling_param), --max-model-len auto
(human_readable_int_or_auto; the model's context length by _get_and_verify_max_len's rule,
derived_max_model_len), and flag(), the config fields' --help metadata that
minicore/engine/arg_utils.py makes flags from. Left out: a generation config from config.json when a
model has no generation_config.json, --override-generation-config; auto's fitting of max_model_len
to the KV cache (minicore refuses at start a cache that cannot hold one request of max_model_len).
"""

import argparse
import json
import os
import re
import sys
import types
from dataclasses import field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

# generation_config.json keys that are sampling defaults, in vLLM's order (get_diff_sampling_param).
_SAMPLING_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature",
                  "top_k", "top_p", "min_p", "max_new_tokens")

# Characters that make a --chat-template value an inline template, not a file path (vLLM's rule).
_JINJA_CHARS = "{}\n"


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that takes vLLM's spellings of its flags (FlexibleArgumentParser in
    vllm/utils/argparse_utils.py): underscores for dashes in a flag's name (``--max_model_len``),
    a JSON flag's fields one by one (``--speculative-config.method ngram``, merged into one JSON
    object; a value is JSON where it parses, else a string), and the shorthands in SHORTHANDS.
    --help shows the dashed flags only."""

    # vLLM's shorthands for a JSON flag's fields.
    SHORTHANDS = {"--spec-method": "--speculative-config.method",
                  "--spec-tokens": "--speculative-config.num_speculative_tokens"}

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(vllm_spellings(args), namespace)


def vllm_spellings(args: list[str]) -> list[str]:
    """args with vLLM's spellings rewritten as minicore's flags take them: a JSON flag's fields
    given one by one join the object given whole, if any."""
    out: list[str] = []
    objects: dict[str, dict] = {}
    it = iter(args)
    for arg in it:
        if not arg.startswith("--") or arg == "--":
            out.append(arg)
            continue
        name, eq, value = arg.partition("=")
        head, dot, path = name.partition(".")
        head = head.replace("_", "-")
        name = FlexibleArgumentParser.SHORTHANDS.get(head, head) + dot + path
        if "." not in name:
            out.append(name + eq + value)
            continue
        flag, *keys = name.split(".")
        nested = objects.setdefault(flag, {})
        for key in keys[:-1]:
            nested = nested.setdefault(key, {})
        value = value if eq else next(it, "")
        try:
            nested[keys[-1]] = json.loads(value)
        except json.JSONDecodeError:
            nested[keys[-1]] = value
    for flag, fields_given in objects.items():
        out += [flag, json.dumps(_merged(_take_flag(out, flag), fields_given))]
    return out


def _take_flag(args: list[str], flag: str) -> dict:
    """The JSON object that flag's last occurrence in args gives ({} if none), taking out each
    occurrence that gives one (one that does not stays, for the flag's own error)."""
    whole: dict = {}
    i = 0
    while i < len(args):
        name, eq, value = args[i].partition("=")
        width = 1 if eq else 2
        value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
        try:
            given = json.loads(value) if name == flag else None
        except json.JSONDecodeError:
            given = None
        if not isinstance(given, dict):
            i += 1
            continue
        del args[i:i + width]
        whole = given
    return whole


def _merged(base: dict, fields_given: dict) -> dict:
    for key, value in fields_given.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            value = _merged(base[key], value)
        base[key] = value
    return base


def human_readable_int_or_auto(value: str) -> int:
    """vLLM's --max-model-len type: human_readable_int, or -1 for '-1' and 'auto' (the model's
    own context length)."""
    value = value.strip()
    if value == "-1" or value.lower() == "auto":
        return -1
    return human_readable_int(value)


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
    return read_json_file(folder, "generation_config.json")


def read_json_file(folder: str | os.PathLike, name: str) -> dict:
    """A JSON object file of a model's folder as a dict; {} when the folder has no such file."""
    path = Path(folder).expanduser() / name
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


# config.json keys that bound a model's context, smallest first wins (vLLM's possible_keys in
# vllm/transformers_utils/model_arch_config_convertor.py).
_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                 "model_max_length", "max_target_positions", "max_sequence_length",
                 "max_seq_length", "seq_len")
# vLLM's default when config.json names no length (it warns).
DEFAULT_MAX_MODEL_LEN = 2048


def derived_max_model_len(hf_config: dict, tokenizer_config: dict | None = None) -> int:
    """A model's context length, as vLLM derives max_model_len when it is unset or auto
    (vllm/config/model.py _get_and_verify_max_len): the smallest of config.json's length keys
    (the text config's, for a multimodal model; Command-R's model_max_length wins), capped by the
    tokenizer's model_max_length, scaled by a linear or dynamic RoPE factor; LongRoPE uses its
    original_max_position_embeddings."""
    config = hf_config.get("text_config") or hf_config
    lengths = [config[k] for k in _MAX_LEN_KEYS if isinstance(config.get(k), (int, float))]
    derived = min(lengths, default=float("inf"))
    if isinstance(config.get("model_max_length"), int):
        derived = config["model_max_length"]
    tokenizer_max = (tokenizer_config or {}).get("model_max_length")
    if isinstance(tokenizer_max, (int, float)):
        derived = min(derived, tokenizer_max)
    if derived == float("inf"):
        return DEFAULT_MAX_MODEL_LEN
    rope = config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type == "longrope":
        return int(config.get("original_max_position_embeddings", derived))
    if rope_type in ("linear", "dynamic") and "gemma3" not in str(config.get("model_type")):
        derived *= rope.get("factor") or 1.0
    return int(derived)


def flag(default, help: str, **cli) -> Any:
    """A field with a command-line flag. cli: flag= (its name, when not --field-name), aliases=
    (short forms), group= (its --help group, when not its config's), type= (argparse's, when not the
    annotation's)."""
    return field(default=default, metadata={"help": help, **cli})


# The metadata of a config field set at run time: no flag.
RUNTIME = {"cli": False}


def config_record(cls: type, value, name: str):
    """A config record from its flag's JSON text, a keyword's dict, or the record itself;
    ValueError naming the flag's field and the bad key or value."""
    if isinstance(value, cls):
        return value
    try:
        kwargs = json_object(value, cls)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    return cls(**kwargs)


def json_object(value: str | dict, cls: type) -> dict:
    """The keyword arguments of dataclass cls in a config-valued flag's JSON text or a keyword's
    dict (vLLM parses those flags from JSON too); ValueError for text that is not JSON, a value
    that is not an object, or a key cls has no field for."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON ({e}): {value}") from None
    names = [f.name for f in fields(cls)]
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object with keys among {', '.join(names)}, "
                         f"got {value!r}")
    if unknown := sorted(set(value) - set(names)):
        raise ValueError(f"expected a JSON object with keys among {', '.join(names)}, got "
                         f"unknown key(s) {', '.join(unknown)}")
    hints = get_type_hints(cls)
    for key, item in value.items():
        if not _json_value_fits(item, hints[key]):
            raise ValueError(f"{key} must be {_describe_type(hints[key])}, got {json.dumps(item)}")
    return value


def check_choices(record) -> None:
    """ValueError naming the first of record's Literal-typed fields that holds another value."""
    for name, annotation in get_type_hints(type(record)).items():
        choices = get_args(annotation) if get_origin(annotation) is Literal else None
        if choices and (value := getattr(record, name)) not in choices:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got "
                             f"{value!r}")


def check_at_least(record, **minimums: int) -> None:
    """ValueError naming the first of record's fields below its minimum."""
    for name, minimum in minimums.items():
        if (value := getattr(record, name)) < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")


# A JSON value's Python types for each annotation a config field has: strict, as JSON itself is
# (true is not 1, 1 is not 1.0's only spelling), so a typo fails at start-up naming the key.
_JSON_TYPES = {int: (int,), float: (int, float), bool: (bool,), str: (str,), dict: (dict,),
               list: (list,), type(None): (type(None),)}


def _json_value_fits(value, annotation) -> bool:
    if annotation is Any:
        return True
    options = get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    for option in options:
        allowed = _JSON_TYPES.get(get_origin(option) or option, ())
        if isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed):
            return True
    return False


def _describe_type(annotation) -> str:
    options = get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    words = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
             dict: "a JSON object", list: "a JSON array", type(None): "null"}
    return " or ".join(words.get(get_origin(o) or o, str(o)) for o in options)
