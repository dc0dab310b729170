"""StructuredOutputsConfig: the engine's structured-output settings (--structured-outputs-config).

Mirrors vllm/config/structured_outputs.py (StructuredOutputsConfig), with its JSON flag. minicore
has one backend, xgrammar (vLLM's default under "auto"; chosen by measurement, docs/BENCHMARKS.md),
so "auto" means xgrammar and vLLM's other backends are refused by name, as are the settings that
only they read (disable_additional_properties is guidance's). reasoning_parser is set by
--reasoning-parser, as vLLM's. Adds the bounds on a request's grammar (max_grammar_nesting,
max_grammar_bytes) and on the whitespace a JSON output may run (max_whitespace_cnt, on by default:
where minicore differs from vLLM). Pure Python: minicore.config imports it.
"""

from dataclasses import dataclass

from minicore.structured_output.params import MAX_GRAMMAR_BYTES, MAX_GRAMMAR_NESTING

BACKENDS = ("auto", "xgrammar")
DEFAULT_MAX_WHITESPACE = 16
# vLLM's other backends: named in the refusal, so that a vLLM command line fails clearly.
OTHER_BACKENDS = ("guidance", "outlines", "lm-format-enforcer")


@dataclass(slots=True)
class StructuredOutputsConfig:
    backend: str = "auto"
    # Compact JSON for every request (no whitespace between tokens), as vLLM's.
    disable_any_whitespace: bool = False
    # At most this many whitespace characters in a row between JSON tokens (JSON schemas,
    # json_object, tool-call arguments); None lets a model write newlines until max_tokens, as
    # vLLM's grammar does (vllm-project/vllm issue 38696). minicore's own default, from a
    # measurement (docs/BENCHMARKS.md): the indentation of nested JSON fits it.
    max_whitespace_cnt: int | None = DEFAULT_MAX_WHITESPACE
    disable_additional_properties: bool = False
    # A thinking model's parser (--reasoning-parser): a request's grammar starts once its
    # reasoning has ended, unless enable_in_reasoning.
    reasoning_parser: str = ""
    enable_in_reasoning: bool = False
    # minicore's bounds on what a request's grammar may be before xgrammar sees it (params.py).
    max_grammar_nesting: int = MAX_GRAMMAR_NESTING
    max_grammar_bytes: int = MAX_GRAMMAR_BYTES

    def __post_init__(self):
        if self.backend not in BACKENDS:
            known = "not available in minicore" if self.backend in OTHER_BACKENDS else "unknown"
            raise ValueError(f"structured_outputs_config: backend {self.backend!r} is {known}: "
                             f"choose among {', '.join(map(repr, BACKENDS))}")
        for name in ("disable_any_whitespace", "disable_additional_properties",
                     "enable_in_reasoning"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs_config: {name} must be true or false, got "
                                 f"{getattr(self, name)!r}")
        value = self.max_whitespace_cnt
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 0):
            raise ValueError("structured_outputs_config: max_whitespace_cnt must be an integer "
                             f">= 0 or null, got {value!r}")
        for name in ("max_grammar_nesting", "max_grammar_bytes"):
            if not isinstance(value := getattr(self, name), int) or isinstance(value, bool) or (
                    value < 1):
                raise ValueError(f"structured_outputs_config: {name} must be an integer >= 1, "
                                 f"got {value!r}")
        if self.disable_additional_properties:
            raise ValueError("structured_outputs_config: disable_additional_properties is only "
                             "supported by vLLM's guidance backend, which minicore does not have")
        if self.reasoning_parser:
            from minicore.entrypoints.reasoning import REASONING_PARSERS

            if self.reasoning_parser not in REASONING_PARSERS:
                raise ValueError(f"reasoning_parser {self.reasoning_parser!r} is not a reasoning "
                                 f"parser; they are {', '.join(sorted(REASONING_PARSERS))}")
