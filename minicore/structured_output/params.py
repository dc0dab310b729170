"""StructuredOutputsParams: the constraint a request's output must follow, and its check.

Mirrors StructuredOutputsParams in vllm/sampling_params.py and the frontend's grammar checks of
vllm/v1/structured_output/backend_xgrammar.py (validate_xgrammar_grammar). Pure Python until a
check runs: validate_structured_outputs imports xgrammar then, so that the scheduler package,
which imports SamplingParams, stays free of it. Left out: structural tags, whitespace patterns,
disable_additional_properties, the backend fallback and a timeout on compiling a regex.
"""

import json as json_module
from dataclasses import dataclass


@dataclass(slots=True)
class StructuredOutputsParams:
    """One constraint on what a request may generate: a JSON schema (json, a dict or its JSON
    text), any JSON object (json_object), a regex, one of some strings (choice) or an EBNF
    grammar (xgrammar's dialect: a rule named root)."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON without whitespace between its tokens (vLLM's; xgrammar's any_whitespace=False).
    disable_any_whitespace: bool = False

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar "
                             f"and json_object, got {given or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice or
                                        not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty "
                             f"strings, got {self.choice!r}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    def key(self) -> tuple[str, str]:
        """(kind, spec): what a compiled grammar is cached under (vLLM's request key)."""
        kind = self.kind
        spec = getattr(self, kind)
        if kind == "json":
            spec = spec if isinstance(spec, str) else json_module.dumps(spec, sort_keys=True)
        elif kind == "choice":
            spec = json_module.dumps(spec)
        elif kind == "json_object":
            spec = ""
        return f"{kind}{'' if not self.disable_any_whitespace else ':compact'}", spec


KINDS = ("json", "regex", "choice", "grammar", "json_object")


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar of exactly one of the strings (vLLM's choice_as_grammar)."""
    quoted = (c.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for c in choices)
    return "root ::= " + " | ".join(f'"{c}"' for c in quoted)


# vLLM's MAX_STRUCTURED_OUTPUT_JSON_NESTING: converting a schema costs steeply with its depth.
MAX_JSON_NESTING = 64


def build_grammar(params: StructuredOutputsParams, disable_any_whitespace: bool = False):
    """The xgrammar Grammar of params (no tokenizer needed); ValueError naming the field when
    the schema, regex or grammar does not parse. JSON is compact when the request or the engine
    (--structured-outputs-config) disables whitespace, as vLLM's separators make it."""
    import xgrammar as xgr

    kind = params.kind
    compact = disable_any_whitespace or params.disable_any_whitespace
    json_options = {"any_whitespace": not compact, "separators": (",", ":") if compact else None}
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
        return xgr.Grammar.from_ebnf(params.grammar)
    except RuntimeError as e:
        # xgrammar's message starts with a timestamp and its C++ source position.
        message = str(e).strip().split(": ", 1)[-1] if ".cc:" in str(e) else str(e).strip()
        raise ValueError(f"invalid structured_outputs.{kind}: {message}") from None


def validate_structured_outputs(params: StructuredOutputsParams) -> None:
    """The frontend's checks (vLLM's SamplingParams._validate_structured_outputs and
    validate_xgrammar_grammar): ValueError naming the field for what the engine could not
    compile, or could compile only at a cost no request should impose."""
    for kind in ("json", "grammar"):
        if isinstance(value := getattr(params, kind), str) and not value.strip():
            raise ValueError(f"structured_outputs.{kind} cannot be an empty string")
    if params.json_object is not None and params.json_object is not True:
        raise ValueError("structured_outputs.json_object must be true if set; omit "
                         "structured_outputs to disable structured outputs")
    if params.regex is not None and "\x00" in params.regex:
        raise ValueError("structured_outputs.regex must not contain a NUL character")
    if params.json is not None and _nesting_exceeds(params.json, MAX_JSON_NESTING):
        raise ValueError("structured_outputs.json: the JSON schema is nested too deeply: objects "
                         f"and arrays may nest at most {MAX_JSON_NESTING} levels")
    build_grammar(params)


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
