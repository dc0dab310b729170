"""A structured-output constraint's checks and grammar: what the frontend refuses, and the EBNF an
xgrammar compiler takes.

The constraint itself, StructuredOutputsParams, is minicore/sampling_params.py's, as in vLLM.
Mirrors the frontend's grammar checks of vllm/v1/structured_output/backend_xgrammar.py
(validate_xgrammar_grammar), Lark told apart from EBNF as vLLM does (grammar_is_likely_lark) and
compiled by xgrammar's Lark front end, and structural tags in both of vLLM's forms. Pure Python
until a check runs: validate_structured_outputs imports xgrammar then. Left out: whitespace
patterns,
disable_additional_properties, the backend fallback and a timeout on compiling a regex.
"""

import json as json_module
import re

from minicore.sampling_params import StructuredOutputsParams


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar of exactly one of the strings (vLLM's choice_as_grammar), every control
    character escaped (a raw one is an EBNF lexer error)."""
    return "root ::= " + " | ".join(f'"{_ebnf_escape(c)}"' for c in choices)


def _ebnf_escape(text: str) -> str:
    # \u takes exactly four hex digits (\x takes all that follow: "\x00b" would be 0x0b).
    return "".join("\\" + c if c in '"\\' else f"\\u{ord(c):04x}" if c < " " or c == "\x7f"
                   else c for c in text)


# vLLM's MAX_STRUCTURED_OUTPUT_JSON_NESTING: converting a schema costs steeply with its depth.
MAX_JSON_NESTING = 64
# The limits on what reaches xgrammar's native compiler, whose recursive parsers overflow the
# stack (SIGSEGV, the whole process gone) on a regex or grammar nested some 30,000 levels deep
# and cost memory with size. --structured-outputs-config raises them
# ({"max_grammar_nesting": N, "max_grammar_bytes": N}).
MAX_GRAMMAR_NESTING = 256
MAX_GRAMMAR_BYTES = 256 << 10
# JSON-schema keywords xgrammar 0.2.8 compiles but does not enforce (measured: a violating
# document is accepted): refused, as vLLM's has_xgrammar_unsupported_json_features refuses its
# list, so that no client believes a constraint holds that nothing enforced.
UNENFORCED_KEYWORDS = ("uniqueItems", "contains", "minContains", "maxContains", "not", "if",
                       "then", "else", "dependentRequired", "contentEncoding",
                       "contentMediaType", "unevaluatedItems")
# The string formats xgrammar enforces; any other is refused.
ENFORCED_FORMATS = ("email", "date", "time", "date-time", "duration", "uuid", "ipv4", "ipv6",
                    "hostname", "uri", "uri-reference", "uri-template", "json-pointer",
                    "relative-json-pointer")
# Keys whose values map names (not keywords) to subschemas, and keys whose values are data.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA_KEYS = ("enum", "const", "default", "examples", "required", "description", "title")


def build_grammar(params: StructuredOutputsParams, disable_any_whitespace: bool = False,
                  max_whitespace_cnt: int | None = None):
    """The xgrammar Grammar of params (no tokenizer needed); ValueError naming the field when
    the schema, regex or grammar does not parse. JSON is compact when the request or the engine
    (--structured-outputs-config) disables whitespace, as vLLM's separators make it; else at most
    max_whitespace_cnt whitespace characters run between its tokens (None: any number)."""
    import xgrammar as xgr

    kind = params.kind
    compact = disable_any_whitespace or params.disable_any_whitespace
    json_options = {"any_whitespace": not compact, "separators": (",", ":") if compact else None,
                    "max_whitespace_cnt": None if compact else max_whitespace_cnt}
    try:
        if kind == "json":
            schema = params.json if isinstance(params.json, str) else json_module.dumps(params.json)
            return xgr.Grammar.from_json_schema(schema, **json_options)
        if kind == "json_object":  # an object, as vLLM compiles it (not any JSON value)
            return xgr.Grammar.from_json_schema('{"type": "object"}', **json_options)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_grammar(params.choice))
        if kind == "structural_tag":
            return _structural_tag_grammar(params.structural_tag)
        if grammar_is_likely_lark(params.grammar):
            return xgr.Grammar.from_lark(params.grammar)
        return xgr.Grammar.from_ebnf(params.grammar)
    except RuntimeError as e:
        # xgrammar's message starts with a timestamp and its C++ source position.
        message = str(e).strip().split(": ", 1)[-1] if ".cc:" in str(e) else str(e).strip()
        raise ValueError(f"invalid structured_outputs.{kind}: {message}") from None


def grammar_is_likely_lark(grammar: str) -> bool:
    """vLLM's test (vllm/v1/structured_output/utils.py): a grammar none of whose lines, comments
    left out, defines a rule with EBNF's ``::=`` is Lark."""
    lines = (re.sub(r"(#|//).*$", "", line).strip() for line in grammar.split("\n"))
    return not any("::=" in line for line in lines if line)


def _structural_tag_grammar(spec: str):
    """xgrammar's structural tag, or vLLM's legacy form ({"structures": [{"begin", "schema",
    "end"}], "triggers": [...]}), which vLLM compiles with xgrammar's deprecated call."""
    import xgrammar as xgr

    try:
        tag = json_module.loads(spec)
    except ValueError:
        raise ValueError("invalid structured_outputs.structural_tag: not JSON") from None
    if not (isinstance(tag, dict) and "structures" in tag):
        return xgr.Grammar.from_structural_tag(spec)
    try:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json_module.dumps(s["schema"]),
                                       end=s["end"]) for s in tag["structures"]]
        return xgr.Grammar.from_structural_tag(items, list(tag["triggers"]))
    except (KeyError, TypeError) as e:
        raise ValueError("invalid structured_outputs.structural_tag: each of its structures "
                         f"needs begin, schema and end, and it needs triggers ({e!r})") from None


def validate_structured_outputs(params: StructuredOutputsParams,
                                max_nesting: int = MAX_GRAMMAR_NESTING,
                                max_bytes: int = MAX_GRAMMAR_BYTES) -> None:
    """The frontend's checks (vLLM's SamplingParams._validate_structured_outputs and
    validate_xgrammar_grammar): ValueError naming the field for what the engine could not
    compile, could compile only at a cost no request should impose (size and nesting within
    max_bytes and max_nesting, checked before xgrammar parses anything), or would not enforce."""
    for kind in ("json", "grammar"):
        if isinstance(value := getattr(params, kind), str) and not value.strip():
            raise ValueError(f"structured_outputs.{kind} cannot be an empty string")
    if params.json_object is not None and params.json_object is not True:
        raise ValueError("structured_outputs.json_object must be true if set; omit "
                         "structured_outputs to disable structured outputs")
    if params.regex is not None and "\x00" in params.regex:
        raise ValueError("structured_outputs.regex must not contain a NUL character")
    kind, spec = params.kind, params.key()[1]
    if len(spec.encode()) > max_bytes:
        raise ValueError(f"structured_outputs.{kind} is {len(spec.encode())} bytes, more than "
                         f"the server's limit of {max_bytes} (max_grammar_bytes)")
    if params.json is not None:
        _check_json_schema(params.json, max_nesting)
    elif kind in ("regex", "grammar", "structural_tag"):
        _check_nesting(spec, f"structured_outputs.{kind}", max_nesting)
    build_grammar(params)


def _check_json_schema(schema: str | dict, max_nesting: int) -> None:
    if _nesting_exceeds(schema, MAX_JSON_NESTING):
        raise ValueError("structured_outputs.json: the JSON schema is nested too deeply: objects "
                         f"and arrays may nest at most {MAX_JSON_NESTING} levels")
    if isinstance(schema, str):
        try:
            schema = json_module.loads(schema)
        except ValueError:
            return  # not JSON: build_grammar says so
    _check_schema_node(schema, "structured_outputs.json", max_nesting)


def _check_schema_node(node, where: str, max_nesting: int) -> None:
    """Refuse the keywords xgrammar does not enforce and regexes nested too deeply, anywhere in
    a schema (recursion bounded by MAX_JSON_NESTING, checked first)."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            _check_schema_node(item, f"{where}[{i}]", max_nesting)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        at = f"{where}.{key}"
        if key in _DATA_KEYS:
            continue
        if key in UNENFORCED_KEYWORDS and not (key == "uniqueItems" and value is False):
            raise ValueError(f"{at}: the JSON-schema keyword {key!r} is not supported by the "
                             "xgrammar backend (it would not be enforced)")
        if key == "format" and value not in ENFORCED_FORMATS:
            raise ValueError(f"{at}: 'format' {value!r} is not supported by the xgrammar "
                             f"backend (it would not be enforced); supported: "
                             f"{', '.join(ENFORCED_FORMATS)}")
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            raise ValueError(f"{at}: 'allOf' with more than one schema is not supported by the "
                             "xgrammar backend (it would not be enforced)")
        if key == "pattern" and isinstance(value, str):
            _check_nesting(value, at, max_nesting)
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                if key == "patternProperties":
                    _check_nesting(name, f"{at} key", max_nesting)
                _check_schema_node(sub, f"{at}.{name}", max_nesting)
        else:
            _check_schema_node(value, at, max_nesting)


def _check_nesting(text: str, where: str, limit: int) -> None:
    """ValueError if brackets nest deeper than limit in a regex or grammar. Every unescaped
    bracket counts, inside quotes and character classes too (a quote in `[^"]` must not hide
    what follows), and closers never take the depth below zero (`[)]` repeated must not pay for
    openers after it): an overcount at worst, never an undercount."""
    depth = deepest = 0
    escaped = False
    for c in text:
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in ")]}":
            depth = max(0, depth - 1)
    if deepest > limit:
        raise ValueError(f"{where} nests {deepest} levels of brackets, more than the server's "
                         f"limit of {limit} (max_grammar_nesting)")


def _nesting_exceeds(spec: str | dict, limit: int) -> bool:
    """Whether a JSON document nests objects and arrays deeper than limit (breadth first: a
    deep document must not overflow a recursive walk)."""
    if isinstance(spec, str):
        try:
            spec = json_module.loads(spec)
        except RecursionError:
            return True
        except ValueError:
            return False  # not JSON: build_grammar says so
    level = [spec] if isinstance(spec, dict | list) else []
    for _ in range(limit):
        level = [child for node in level
                 for child in (node.values() if isinstance(node, dict) else node)
                 if isinstance(child, dict | list)]
    return bool(level)
