"""SamplingParams: how one request samples and when it stops.

Mirrors vllm/sampling_params.py, keeping the parameters minicore implements: sampling, penalties,
min-p, logit bias, allowed/bad words, logprobs, stop conditions, detokenization switches and
structured outputs (StructuredOutputsParams, as in vLLM; its grammar checks are
minicore/structured_output/params.py's; no beam search, extra_args or logits processors). Invalid
values raise ValueError at construction (minicore/sampling_checks.py), before anything reaches
the scheduler: the engine decodes the same class from the wire, so a request it receives has
passed the same checks.
kv_transfer_params (prefill/decode disaggregation) is a JSON
object the KV connector reads; vLLM carries it in SamplingParams.extra_args["kv_transfer_params"],
minicore has no extra_args and gives it a field of its own.
"""

import json as json_module
from dataclasses import dataclass, field, replace
from typing import Any

from minicore.sampling_checks import INT64_MIN, verify_sampling_params


@dataclass(slots=True)
class StructuredOutputsParams:
    """One constraint on what a request may generate: a JSON schema (json, a dict or its JSON
    text), any JSON object (json_object), a regex, one of some strings (choice), a grammar
    (xgrammar's EBNF dialect, a rule named root; or Lark, told apart as vLLM does) or a
    structural tag (xgrammar's, as JSON text; vLLM's legacy "structures"/"triggers" form too)."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    # JSON without whitespace between its tokens (vLLM's; xgrammar's any_whitespace=False).
    disable_any_whitespace: bool = False

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, "
                             f"grammar, json_object and structural_tag, got {given or 'none'}")
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


KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(slots=True)
class SamplingParams:
    # None: generate until EOS or max_model_len.
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 disables top-k; -1 (vLLM's old spelling) is accepted and normalised to 0.
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    # Stop strings, matched on the detokenized text; the text is cut before the match.
    stop: list[str] = field(default_factory=list)
    # The KV connector's parameters for this request (vLLM: extra_args["kv_transfer_params"]):
    # {"do_remote_decode": true} asks a prefill instance to keep the blocks for a decode instance;
    # the params a prefill instance returned tell a decode instance where to read them.
    kv_transfer_params: dict[str, Any] | None = None
    # The offline LLM fans out n engine requests (the j-th seeded with seed + j).
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    # token id -> bias added to its logit, clamped to [-100, 100] (vLLM's from_optional).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Top-N logprobs per sampled (prompt) token; 0: the token itself only; -1: the whole vocab.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Keep only the last k prompt tokens (-1: max_model_len), applied by the InputProcessor.
    truncate_prompt_tokens: int | None = None
    # bad_words tokenized by the InputProcessor (vLLM: _bad_words_token_ids); users leave it unset.
    bad_words_token_ids: list[list[int]] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        verify_sampling_params(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def parallel_sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of sample `index` of a request's n (vLLM's parallel sampling,
    vllm/v1/engine/parallel_sampling.py): a seeded request's index-th sample uses seed + index,
    wrapped to stay a 64-bit integer, so that the n samples differ and each repeats."""
    if index == 0 or params.seed is None:
        return params
    return replace(params, seed=(params.seed + index - INT64_MIN) % 2**64 + INT64_MIN)
