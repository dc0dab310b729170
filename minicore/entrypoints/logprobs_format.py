"""Logprobs in the OpenAI shapes: the response records and their building from Logprob dicts.

Mirrors vllm/entrypoints/openai/completion/serving.py (_create_completion_logprobs: text_offset,
token_logprobs, tokens, top_logprobs, the first echoed prompt token's logprob None),
chat_completion/serving.py (_create_chat_logprobs, _get_top_logprobs: content entries with bytes
and top_logprobs), clamp_prompt_logprobs (vllm/entrypoints/generate/base/serving.py) and the
records of those protocol.py files. As vLLM: -inf becomes -9999.0 (JSON has no infinity); each
Logprob dict holds the token itself first, then the top-N, and a completion's top_logprobs keeps
N+1 entries of it, a chat's top_logprobs its first N (so the token itself when it is not among
the top N); return_tokens_as_token_ids spells tokens "token_id:N". Left out: logprob_token_ids.
"""

import msgspec

from minicore.outputs import Logprob

# What vLLM puts in JSON for a -inf logprob.
MIN_LOGPROB = -9999.0


class CompletionLogProbs(msgspec.Struct):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class ChatCompletionLogProb(msgspec.Struct):
    token: str
    logprob: float = MIN_LOGPROB
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(msgspec.Struct):
    token: str
    logprob: float = MIN_LOGPROB
    bytes: list[int] | None = None
    top_logprobs: list[ChatCompletionLogProb] = []


class ChatCompletionLogProbs(msgspec.Struct):
    content: list[ChatCompletionLogProbsContent] | None = None


class LogprobJSON(msgspec.Struct):
    """vLLM's Logprob as its responses' prompt_logprobs show it."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One per prompt token (None for the first), token id (a JSON key: a string) -> its logprob.
PromptLogprobsJSON = list[dict[str, LogprobJSON] | None]


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class LogprobsFormatter:
    """Builds the logprobs records of one request (its tokenizer and token spelling)."""

    def __init__(self, tokenizer, return_tokens_as_token_ids: bool = False):
        self.tokenizer = tokenizer
        self.as_token_ids = return_tokens_as_token_ids

    def text(self, token_id: int, logprob: Logprob | None = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode(token_id)

    def token(self, token_id: int, logprob: Logprob | None = None) -> str:
        return f"token_id:{token_id}" if self.as_token_ids else self.text(token_id, logprob)

    def completion(self, token_ids: list[int], logprobs: list[dict[int, Logprob] | None],
                   num_top: int, initial_text_offset: int = 0) -> CompletionLogProbs:
        """The completions API's logprobs for these tokens (a None step: an echoed first prompt
        token, which has no logprob); text offsets count from initial_text_offset."""
        result = CompletionLogProbs([], [], [], [])
        offset = initial_text_offset
        for token_id, step in zip(token_ids, logprobs, strict=True):
            if step is None:
                token, token_logprob, top = self.token(token_id), None, None
            else:
                token = self.token(token_id, step[token_id])
                token_logprob = _clamp(step[token_id].logprob)
                # The token itself and the top num_top (vLLM: OpenAI's "num_top + 1" entries).
                top = {self.token(tid, lp): _clamp(lp.logprob)
                       for i, (tid, lp) in enumerate(step.items()) if num_top == -1 or i <= num_top}
            result.text_offset.append(offset)
            result.tokens.append(token)
            result.token_logprobs.append(token_logprob)
            result.top_logprobs.append(top)
            offset += len(token)
        return result

    def chat(self, token_ids: list[int], logprobs: list[dict[int, Logprob]],
             top_logprobs: int | None) -> ChatCompletionLogProbs:
        """The chat API's logprobs for these generated tokens."""
        content = []
        for token_id, step in zip(token_ids, logprobs, strict=True):
            own = step.get(token_id)
            token = self.token(token_id, own)
            if own is None:
                content.append(ChatCompletionLogProbsContent(token, bytes=_utf8(token)))
                continue
            top = [ChatCompletionLogProb(t := self.token(tid, lp), _clamp(lp.logprob), _utf8(t))
                   for i, (tid, lp) in enumerate(step.items())
                   if top_logprobs == -1 or (top_logprobs is not None and i < top_logprobs)]
            # As vLLM: the token's bytes are its text's, also when spelled as its id.
            content.append(ChatCompletionLogProbsContent(
                token, _clamp(own.logprob), _utf8(self.text(token_id, own)), top))
        return ChatCompletionLogProbs(content)


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def prompt_logprobs_json(prompt_logprobs: list[dict[int, Logprob] | None]) -> PromptLogprobsJSON:
    """RequestOutput.prompt_logprobs as vLLM's responses show them (-inf clamped)."""
    return [None if step is None else {
        str(tid): LogprobJSON(_clamp(lp.logprob), lp.rank, lp.decoded_token)
        for tid, lp in step.items()} for step in prompt_logprobs]
