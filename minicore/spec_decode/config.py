"""SpeculativeConfig: how an engine drafts tokens for itself to verify (--speculative-config).

Mirrors vllm/config/speculative.py (SpeculativeConfig) for the methods of this package
(drafter.py finds them by name; each fills in and checks its own fields, as vLLM's ngram
defaults), with vLLM's checks; model "ngram" or "[ngram]" names the ngram method, as in vLLM, and
"deepseek_mtp" is the "mtp" method (vLLM renames it so). num_lookahead_tokens is vLLM's
VllmConfig property: the KV slots a step allocates past its tokens for a proposer that writes KV
of its own (MTP). A draft model is refused by name. Pure Python: minicore.config imports it.
"""

from dataclasses import dataclass

from minicore.spec_decode.drafter import drafters

NGRAM_NAMES = ("ngram", "[ngram]")
# vLLM's other spellings of a method, and the name it takes for them.
RENAMED = {"[ngram]": "ngram", "deepseek_mtp": "mtp"}


@dataclass(slots=True)
class SpeculativeConfig:
    method: str | None = None
    num_speculative_tokens: int | None = None
    # ngram: the longest and shortest n-gram of a request's own tokens that may propose drafts.
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # No drafts while this many requests or more run: a large batch is compute-bound, and
    # verifying drafts that may be rejected costs more than it saves.
    disable_by_batch_size: int | None = None
    # vLLM's key for a draft model: present only to be refused with its name.
    model: str | None = None

    def __post_init__(self):
        methods = drafters()
        # vLLM's spellings of ngram: as the model (its NGRAM_SPEC_CONFIG), or bracketed.
        if self.method is None and self.model in NGRAM_NAMES:
            self.method, self.model = "ngram", None
        if isinstance(self.method, str):
            self.method = RENAMED.get(self.method, self.method)
        if self.model is not None:
            raise ValueError(f"speculative_config: a draft model ({self.model!r}) is not "
                             f"supported by minicore: methods {', '.join(map(repr, methods))}")
        if self.method not in methods:
            raise ValueError(f"speculative_config: method {self.method!r} is not supported by "
                             f"minicore: methods {', '.join(map(repr, methods))}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError("speculative_config: num_speculative_tokens must be an integer >= 1, "
                             f"got {self.num_speculative_tokens!r}")
        if self.disable_by_batch_size is not None and (
                not isinstance(self.disable_by_batch_size, int) or self.disable_by_batch_size < 2):
            raise ValueError("speculative_config: disable_by_batch_size must be an integer >= 2, "
                             f"got {self.disable_by_batch_size!r}")
        methods[self.method].verify_config(self)

    def use_eagle(self) -> bool:
        """Whether the method drafts with a model over the target's hidden states, which writes
        KV of its own (vLLM's name: EAGLE and MTP)."""
        return drafters()[self.method].use_eagle

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots to allocate past a step's scheduled tokens: the drafter's steps write there
        (vLLM: num_speculative_tokens for EAGLE and MTP, 0 for ngram)."""
        return self.num_speculative_tokens if self.use_eagle() else 0
