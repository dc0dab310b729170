"""LogprobsProcessor: a request's logprobs in the frontend, from the engine's LogprobsLists.

Mirrors vllm/v1/engine/logprobs.py with vllm/logprobs.py's append_logprobs_for_next_position: each
position becomes a dict {token id: Logprob}, the sampled (or prompt) token first with its rank, then
the top-N with ranks 1..N (N entries when the token is among them, else N + 1); cumulative_logprob
sums the sampled tokens' logprobs; prompt logprobs start with None for the first prompt token.
Each token is decoded alone, as vLLM's convert_ids_list_to_tokens (tokenizer.decode([id])); a
piece that ends in U+FFFD (part of a multi-byte character) is decoded again after up to 4
preceding tokens of the sequence and given the text they complete (vLLM's _correct_decoded_token,
simplified: the context's own text is cut by length). Left out: FlatLogprobs, logprob_token_ids,
SentencePiece leading-space restoration.
"""

import itertools

from minicore.outputs import Logprob, PromptLogprobs, SampleLogprobs
from minicore.protocol import EngineCoreOutput, LogprobsLists
from minicore.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
# Preceding tokens tried as context for a piece of a multi-byte character (a UTF-8 character has
# at most 4 bytes).
_MAX_CONTEXT = 4


class LogprobsProcessor:
    __slots__ = ("tokenizer", "num_logprobs", "num_prompt_logprobs", "logprobs",
                 "prompt_logprobs", "cumulative_logprob")

    def __init__(self, tokenizer, params: SamplingParams):
        self.tokenizer = tokenizer
        self.num_logprobs = params.logprobs
        self.num_prompt_logprobs = params.prompt_logprobs
        self.logprobs: SampleLogprobs | None = None if params.logprobs is None else []
        self.cumulative_logprob: float | None = None if params.logprobs is None else 0.0
        self.prompt_logprobs: PromptLogprobs | None = (
            None if params.prompt_logprobs is None else [None])

    def update_from_output(self, output: EngineCoreOutput) -> None:
        if output.new_logprobs is not None and self.logprobs is not None:
            self._append(self.logprobs, output.new_logprobs, self.num_logprobs)
            self.cumulative_logprob += sum(row[0] for row in output.new_logprobs.logprobs)
        if output.new_prompt_logprobs is not None and self.prompt_logprobs is not None:
            self._append(self.prompt_logprobs, output.new_prompt_logprobs,
                         self.num_prompt_logprobs)

    def _append(self, positions: list, lists: LogprobsLists, num_logprobs: int) -> None:
        for token_ids, logprobs, rank in zip(lists.logprob_token_ids, lists.logprobs,
                                             lists.sampled_token_ranks):
            decoded = self._decode(token_ids, _context(positions))
            top = len(logprobs) - 1 if num_logprobs == -1 else num_logprobs
            ranks = itertools.chain((rank,), range(1, top + 1))
            positions.append({token_id: Logprob(logprob, token_rank, text)
                              for token_id, logprob, token_rank, text
                              in zip(token_ids, logprobs, ranks, decoded)})

    def _decode(self, token_ids: list[int], context: list[int]) -> list[str]:
        texts = [self.tokenizer.decode([token_id]) for token_id in token_ids]
        return [self._correct(token_id, context) if text.endswith(_REPLACEMENT) else text
                for token_id, text in zip(token_ids, texts)]

    def _correct(self, token_id: int, context: list[int]) -> str:
        """The text token_id completes after the shortest run of preceding tokens that makes it
        whole; "" while the character is still incomplete."""
        for num in range(1, min(len(context), _MAX_CONTEXT) + 1):
            full = self.tokenizer.decode(context[-num:] + [token_id])
            if full.endswith(_REPLACEMENT):
                continue
            prefix = self.tokenizer.decode(context[-num:])
            # The context's own incomplete bytes decode to U+FFFD: what is left of them is
            # the character token_id completes.
            clean = prefix.rstrip(_REPLACEMENT)
            return full[len(clean):] if full.startswith(clean) else full
        return ""


def _context(positions: list) -> list[int]:
    """The sequence's last few tokens: the first key of each position's dict."""
    return [next(iter(entry)) for entry in positions[-_MAX_CONTEXT:] if entry is not None]
