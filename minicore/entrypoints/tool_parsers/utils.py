"""Helpers the parsers share (vllm/tool_parsers/utils.py): how much of a tag a text ends with,
whether a text is whole JSON, and a parameter's text typed by its tool's schema."""

import json
import math


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


# Type names models write beside JSON Schema's (vLLM's _TYPE_ALIASES).
TYPE_ALIASES = {**dict.fromkeys(("str", "text", "varchar", "char", "enum"), "string"),
                **dict.fromkeys(("int", "int32", "int64", "uint", "uint32", "uint64", "long",
                                 "short", "unsigned"), "integer"),
                **dict.fromkeys(("float", "float32", "float64", "double"), "number"),
                "bool": "boolean", "dict": "object",
                **dict.fromkeys(("arr", "list", "sequence"), "array")}
JSON_TYPES = ((type(None), "null"), (bool, "boolean"), (int, "integer"), (float, "number"),
              (str, "string"), (list, "array"), (dict, "object"))


def tool_properties(tools: list[dict] | None, name: str) -> dict:
    """The parameters' schemas of the request's tool of that name ({} for none)."""
    for tool in tools or ():
        function = tool.get("function") or {}
        if function.get("name") == name:
            return (function.get("parameters") or {}).get("properties") or {}
    return {}


def schema_types(schema) -> set[str]:
    """The types a parameter's schema allows: its type(s), its enum values', those of its
    anyOf / oneOf / allOf; "string" where it says none (vLLM's extract_types_from_schema)."""
    if not isinstance(schema, dict):
        return {"string"}
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
    types = {kind for kind in kinds if isinstance(kind, str)}
    enum = schema.get("enum")
    for value in enum if isinstance(enum, list) else ():  # bool before int: JSON_TYPES' order
        types.add(next((name for kind, name in JSON_TYPES if isinstance(value, kind)), "string"))
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(choices := schema.get(key), list):
            types |= set().union(*map(schema_types, choices))
    return types or {"string"}


def coerce_to_schema_type(value: str, types: set[str]):
    """A parameter's text as the first type its schema allows that it reads as, in vLLM's order
    (null, integer, number, boolean, object, array, string); failing all, JSON if it is that,
    else the text (vLLM's coerce_to_schema_type)."""
    allowed = {TYPE_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in types}
    for kind in ("null", "integer", "number", "boolean", "object", "array", "string"):
        if kind not in allowed:
            continue
        if kind == "string":
            return value
        if (read := _read_as(kind, value)) is not _NOT:
            return read
    return _finite_json(value, value)


_NOT = object()


def _read_as(kind: str, value: str):
    """value read as a JSON Schema type, _NOT where it does not read as one."""
    if kind == "null":
        return None if value.lower() == "null" else _NOT
    if kind in ("integer", "number"):
        try:
            number = int(value) if kind == "integer" else float(value)
        except (ValueError, OverflowError):
            return _NOT
        if kind == "integer" or not math.isfinite(number):
            return number if kind == "integer" else _NOT
        return int(number) if number == int(number) else number
    if kind == "boolean":
        return {"true": True, "1": True, "false": False, "0": False}.get(
            value.lower().strip(), _NOT)
    return _finite_json(value, _NOT)  # object, array


def _finite_json(value: str, otherwise):
    """value as JSON, otherwise where it is not JSON or holds an infinity or NaN (json.dumps
    would write invalid JSON for them)."""
    try:
        parsed = json.loads(value)
    except ValueError:
        return otherwise
    try:
        json.dumps(parsed, allow_nan=False)
    except ValueError:
        return otherwise
    return parsed
