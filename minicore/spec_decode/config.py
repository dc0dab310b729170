"""SpeculativeConfig: how an engine drafts tokens for itself to verify (--speculative-config).

Mirrors vllm/config/speculative.py (SpeculativeConfig) for the one method minicore has, ngram
(prompt lookup: vllm/v1/spec_decode/ngram_proposer.py), with vLLM's defaults and checks. Other
methods (a draft model, EAGLE, MTP, Medusa, suffix decoding) are refused by name. Pure Python:
minicore.config imports it.
"""

from dataclasses import dataclass

METHODS = ("ngram",)


@dataclass(slots=True)
class SpeculativeConfig:
    method: str | None = None
    num_speculative_tokens: int | None = None
    # The longest and shortest n-gram of a request's own tokens that may propose drafts.
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # No drafts while this many requests or more run: a large batch is compute-bound, and
    # verifying drafts that may be rejected costs more than it saves.
    disable_by_batch_size: int | None = None
    # vLLM's key for a draft model: present only to be refused with its name.
    model: str | None = None

    def __post_init__(self):
        if self.model is not None:
            raise ValueError(f"speculative_config: a draft model ({self.model!r}) is not "
                             "supported by minicore: only method 'ngram'")
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method {self.method!r} is not supported by "
                             f"minicore: only {', '.join(map(repr, METHODS))}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError("speculative_config: num_speculative_tokens must be an integer >= 1, "
                             f"got {self.num_speculative_tokens!r}")
        # vLLM's defaults: 5 and 5 when neither is given, else the one given for both.
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if not isinstance(value := getattr(self, name), int) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, "
                                 f"got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) "
                             f"must be <= prompt_lookup_max ({self.prompt_lookup_max})")
        if self.disable_by_batch_size is not None and (
                not isinstance(self.disable_by_batch_size, int) or self.disable_by_batch_size < 2):
            raise ValueError("speculative_config: disable_by_batch_size must be an integer >= 2, "
                             f"got {self.disable_by_batch_size!r}")
