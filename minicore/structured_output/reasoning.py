"""Structured outputs after the reasoning: a thinking model's grammar constrains only what it
writes once its reasoning has ended (--reasoning-parser), as vLLM's.

Mirrors the reasoner of vllm/v1/structured_output/__init__.py (StructuredOutputManager's
_get_constraint_bounds, accept_tokens, structured_req.reasoning_ended) with the rule of
vllm/reasoning/basic_parsers.py (BaseThinkingReasoningParser.is_reasoning_end): a prompt whose
last tag is the end tag has ended it, else the reasoning runs until the output writes the end
tag, and the grammar starts at the token after it, drafts included. vLLM looks for the tags as
tokens and needs each to be one token of the vocabulary; here they are looked for in the tokens'
text, so that a model which spells them as several tokens (in whatever pieces) works too. Left
out: vLLM's engine-side parsers whose end token is content (a tool call that ends the
reasoning); a token that carries text past the end tag leaves that text unconstrained.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache


@dataclass(slots=True)
class ReasoningEnd:
    """One request's reasoning: whether it has ended, and the end of the text seen so far (an
    end tag may straddle tokens, and steps)."""
    end: str
    decode: Callable[[int], str]
    tail: str = ""
    ended: bool = False

    def num_free(self, drafts: Sequence[int]) -> int:
        """How many of the positions after the tokens seen so far, and after each of drafts in
        turn, are still reasoning (the grammar leaves them free)."""
        if self.ended:
            return 0
        end, _ = self._scan(drafts)
        return len(drafts) + 1 if end is None else end

    def consume(self, tokens: Sequence[int]) -> int:
        """Take the sampled tokens; how many of them are reasoning (the end tag's included): the
        grammar reads the rest."""
        if self.ended:
            return 0
        end, self.tail = self._scan(tokens)
        self.ended = end is not None
        return len(tokens) if end is None else end

    def _scan(self, tokens: Sequence[int]) -> tuple[int | None, str]:
        """The number of tokens up to the one that completes the end tag (None: none does), and
        the text's tail after them all."""
        text = self.tail
        for count, token_id in enumerate(tokens, 1):
            text += self.decode(token_id)
            if self.end in text:
                return count, ""
            text = _tail(text, self.end)
        return None, text


class NoReasoning:
    """The default: the grammar constrains the whole output."""

    def for_request(self, prompt_token_ids: Sequence[int]) -> ReasoningEnd:
        return ReasoningEnd("", str, ended=True)


NO_REASONING = NoReasoning()


class ReasoningGate:
    """A reasoning parser's tags; each structured request's ReasoningEnd starts from its prompt."""

    def __init__(self, tokenizer, start: str, end: str):
        self.tokenizer, self.start, self.end = tokenizer, start, end
        # Per token: the tags are ASCII, whole in the pieces' text.
        self.decode = lru_cache(maxsize=1 << 16)(lambda token_id: tokenizer.decode([token_id]))

    def for_request(self, prompt_token_ids: Sequence[int]) -> ReasoningEnd:
        prompt = self.tokenizer.decode(prompt_token_ids)
        ended = prompt.rfind(self.end) > prompt.rfind(self.start)
        return ReasoningEnd(self.end, self.decode, _tail(prompt, self.end), ended)


def _tail(text: str, end: str) -> str:
    """What of text an end tag still to come may have begun in."""
    return text[len(text) - len(end) + 1:] if len(text) >= len(end) else text


def make_reasoning_gate(so_config, tokenizer) -> NoReasoning | ReasoningGate:
    """The gate of --reasoning-parser (structured_outputs_config.reasoning_parser), unless
    enable_in_reasoning has the grammar constrain the reasoning too."""
    if not so_config.reasoning_parser or so_config.enable_in_reasoning:
        return NO_REASONING
    from minicore.entrypoints.reasoning import REASONING_PARSERS

    parser = REASONING_PARSERS[so_config.reasoning_parser]
    return ReasoningGate(tokenizer, parser.start, parser.end)
