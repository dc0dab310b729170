"""The engine's command-line flags, made from the config records' fields.

Mirrors EngineArgs.add_cli_args and EngineArgs.from_cli_args in vllm/engine/arg_utils.py: one
flag per user-facing field of minicore/config.py's sub-configs, grouped by sub-config, with type,
choices and default from the field and --help from its metadata, so every default is written once,
in the records. The records outside the sub-configs take one JSON flag each, as vLLM's:
--kv-transfer-config (prefill/decode disaggregation), --speculative-config (draft tokens) and
--structured-outputs-config (the grammar backend), each also field by field
(``--speculative-config.method ngram``: minicore.arg_utils.FlexibleArgumentParser, vLLM's).
Left out: vLLM's EngineArgs dataclass (the flat keyword arguments go
straight to create_engine_config), config files (--config), deprecation notices.
"""

import argparse
from dataclasses import MISSING, Field, fields, is_dataclass
from types import NoneType, UnionType
from typing import Literal, get_args, get_origin

from minicore.arg_utils import json_object
from minicore.config import SUB_CONFIGS
from minicore.kv_transfer.config import KVTransferConfig
from minicore.scheduler.policies import get_policy, policy_names
from minicore.spec_decode.config import SpeculativeConfig
from minicore.spec_decode.drafter import drafters
from minicore.structured_output.config import StructuredOutputsConfig

KV_TRANSFER_HELP = (
    "run a KV connector for prefill/decode disaggregation, as vLLM's flag: "
    '\'{"kv_connector": "NixlConnector", "kv_role": "kv_both"}\' (kv_role: kv_producer, '
    "kv_consumer or kv_both; kv_connector_extra_config: side_channel_host, side_channel_port, "
    "abort_request_timeout)")
STRUCTURED_OUTPUTS_HELP = (
    "structured outputs' settings, as vLLM's flag: '{\"backend\": \"xgrammar\", "
    '"disable_any_whitespace": false}\' (backend: auto or xgrammar, the one minicore has; '
    "disable_any_whitespace: compact JSON for every request)")
SPECULATIVE_HELP = (
    "draft tokens for the model to verify in one forward, as vLLM's flag: "
    '\'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, '
    '"prompt_lookup_min": 2}\' (ngram: the tokens that followed the longest earlier match of a '
    "request's last prompt_lookup_min..max tokens, default 5..5; disable_by_batch_size: no drafts "
    "while that many requests run; mtp, or deepseek_mtp: drafts from the checkpoint's "
    "multi-token-prediction layers, DeepSeek-V2/V3's; also field by field, "
    "--speculative-config.method ngram, or --spec-method ngram --spec-tokens 3). Methods: ")


def add_engine_cli_args(parser: argparse.ArgumentParser,
                        exclude: tuple[str, ...] = ()) -> dict[str, argparse._ArgumentGroup]:
    """Add one flag per user-facing field of the sub-configs, grouped by sub-config, as
    vllm/engine/arg_utils.py EngineArgs.add_cli_args does: type, choices and default from the
    field, --help from its metadata. exclude: field names or group titles to leave out. Returns
    the groups by title, for a command's own flags that belong in one."""
    groups = {title: parser.add_argument_group(title)
              for _, _, title in SUB_CONFIGS if title not in exclude}
    for f, title in _cli_fields(exclude):
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        groups[title].add_argument(flag, *f.metadata.get("aliases", ()), **_flag_kwargs(f))
    for name, title, parse, help in _record_flags():
        if name not in exclude:
            groups[title] = parser.add_argument_group(title)
            groups[title].add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                                       metavar="JSON", type=parse, help=help)
    return groups


def engine_kwargs_from_cli(args: argparse.Namespace, exclude: tuple[str, ...] = ()) -> dict:
    """create_engine_config's keyword arguments from a namespace parsed with the flags of
    add_engine_cli_args(parser, exclude) (vLLM: EngineArgs.from_cli_args)."""
    kwargs = {f.name: getattr(args, f.name) for f, _ in _cli_fields(exclude)}
    for name, *_ in _record_flags():
        if name not in exclude:
            kwargs[name] = getattr(args, name)
    return kwargs


def _record_flags():
    """(field of EngineConfig, --help group, flag type, help) of each record's JSON flag."""
    return (("kv_transfer_config", "KV transfer", _json_dataclass(KVTransferConfig),
             KV_TRANSFER_HELP),
            ("speculative_config", "speculative decoding", _json_dataclass(SpeculativeConfig),
             SPECULATIVE_HELP + ", ".join(drafters())),
            ("structured_outputs_config", "structured outputs",
             _json_dataclass(StructuredOutputsConfig), STRUCTURED_OUTPUTS_HELP))


def _cli_fields(exclude: tuple[str, ...]):
    """(field, group title) of every field with a flag, less those excluded."""
    for _, cls, title in SUB_CONFIGS:
        for f in fields(cls):
            group = f.metadata.get("group", title)
            if f.metadata.get("cli", True) and f.name not in exclude and group not in exclude:
                yield f, group


def _flag_kwargs(f: Field) -> dict:
    """add_argument's keywords for a field, from its annotation and default."""
    default = f.default_factory() if f.default is MISSING else f.default
    kwargs = {"dest": f.name, "default": default, "help": f.metadata["help"]}
    if f.name == "policy":  # the policy registry's, which config.py cannot import (a circle)
        kwargs["choices"] = policy_names()
        kwargs["help"] += "".join(f"; {name}: {get_policy(name).description}"
                                  for name in policy_names())
    if default is not None and not is_dataclass(default):  # the help says what None stands for
        kwargs["help"] += " (default: %(default)s)"
    kind = f.type
    if isinstance(kind, UnionType):  # X | None: None is a default, not a value to type in
        kind = next(t for t in get_args(kind) if t is not NoneType)
    if kind is bool:  # --flag and --no-flag, so that either overrides the default
        return kwargs | {"action": argparse.BooleanOptionalAction}
    if is_dataclass(kind):
        return kwargs | {"type": _json_dataclass(kind), "metavar": "JSON"}
    if get_origin(kind) is Literal:
        return kwargs | {"choices": get_args(kind)}
    if get_origin(kind) is list:  # vLLM's list flags: --flag A B
        (item,) = get_args(kind)
        return kwargs | {"nargs": "+", **({"choices": get_args(item)} if get_origin(item) is Literal
                                          else {"type": item})}
    return kwargs | {"type": f.metadata.get("type", kind)}


def _json_dataclass(cls: type):
    """A flag type that reads a JSON object into cls, with the bad key or value named
    (minicore.arg_utils.json_object); argparse's error names the flag."""

    def parse(text: str):
        try:
            return cls(**json_object(text, cls))
        except (TypeError, ValueError) as e:  # TypeError: a value that is not a number
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse
