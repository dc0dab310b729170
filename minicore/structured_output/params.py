"""StructuredOutputsParams: the constraint a request's output must follow, and its check.

Mirrors StructuredOutputsParams in vllm/sampling_params.py and the frontend's grammar checks of
vllm/v1/structured_output/backend_xgrammar.py (validate_xgrammar_grammar). Pure Python until a
check runs: validate_structured_outputs imports xgrammar then, so that the scheduler package,
which imports SamplingParams, stays free of it. Left out: structural tags, whitespace patterns,
disable_additional_properties and the backend fallback.
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


def build_grammar(params: StructuredOutputsParams):
    """The xgrammar Grammar of params (no tokenizer needed); ValueError naming the field when
    the schema, regex or grammar does not parse."""
    import xgrammar as xgr

    kind = params.kind
    try:
        if kind == "json":
            schema = params.json if isinstance(params.json, str) else json_module.dumps(params.json)
            return xgr.Grammar.from_json_schema(
                schema, any_whitespace=not params.disable_any_whitespace)
        if kind == "json_object":  # an object, as vLLM compiles it (not any JSON value)
            return xgr.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=not params.disable_any_whitespace)
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
    """The frontend's check (vLLM's validate_xgrammar_grammar): ValueError if it cannot compile."""
    build_grammar(params)
