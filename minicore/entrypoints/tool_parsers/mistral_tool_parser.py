"""MistralToolParser: calls after Mistral's [TOOL_CALLS] token, as a JSON list
[{"name": ..., "arguments": {...}}] (tokenizers before v11) or as name{...} / name[ARGS]{...},
each after its own [TOOL_CALLS] (v11 and later).

Mirrors vllm/tool_parsers/mistral_tool_parser.py: text before the first [TOOL_CALLS] is content;
the token is special, so the request keeps special tokens in its text. Left out: token ids,
mistral_common's tokenizer.
"""

import dataclasses
import json

from minicore.entrypoints.tool_parsers.abstract_tool_parser import ToolParserManager
from minicore.entrypoints.tool_parsers.whole_calls import Call, WholeCallsToolParser, json_objects
from minicore.sampling_params import SamplingParams

ARGS = "[ARGS]"


@ToolParserManager.register_module("mistral")
class MistralToolParser(WholeCallsToolParser):
    start_marker = "[TOOL_CALLS]"

    @classmethod
    def adjust_request(cls, params: SamplingParams) -> SamplingParams:
        return dataclasses.replace(params, skip_special_tokens=False)

    def parse_calls(self, text: str, final: bool) -> list[Call]:
        parts = [p.strip() for p in text.split(self.start_marker)[1:]]
        if parts and parts[0].startswith("["):
            return _listed(parts[0], final)
        calls = []
        for i, part in enumerate(parts):
            name, _, arguments = (part.partition(ARGS) if ARGS in part
                                  else (part[:part.find("{")], "", part[part.find("{"):]))
            values, rest = json_objects(arguments)
            last = i == len(parts) - 1
            if not values or (rest.strip() and (final or not last)):
                if final:
                    raise ValueError(f"call {name.strip()!r}: its arguments do not parse")
                break
            calls.append((name.strip(), values[0]))
        return calls


def _listed(text: str, final: bool) -> list[Call]:
    values, rest = json_objects(text)
    if not values:
        if final:
            raise ValueError("the [TOOL_CALLS] list does not parse")
        return []
    items = values[0]
    if not isinstance(items, list) or not all(
            isinstance(i, dict) and isinstance(i.get("name"), str) for i in items):
        raise ValueError("[TOOL_CALLS] is not a list of calls")
    return [(i["name"], _object(i.get("arguments", {}))) for i in items]


def _object(arguments) -> dict:
    """Some models write the arguments as a JSON string."""
    return json.loads(arguments) if isinstance(arguments, str) else arguments
