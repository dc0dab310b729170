"""InputProcessor: the one place a prompt and its sampling parameters are checked and turned into
an EngineCoreRequest, for the offline LLM, AsyncLLM and the HTTP server alike.

Mirrors vllm/v1/engine/input_processor.py (process_inputs, _validate_model_input): a text prompt
is tokenized (without special tokens: a chat template already holds them), token ids must be
integers in the vocabulary, the prompt must hold 1 to max_model_len - 1 tokens (room for one
output token, as in vLLM), a priority needs the priority policy and a DP rank must exist; text must
be valid Unicode and integers must fit in 64 bits (SamplingParams checks its own fields).
Everything is checked before anything is sent, so a refused request leaves nothing behind. The
engine checks the prompt's token ids again with validate_prompt_token_ids (it trusts no frontend).
Left out: multimodal inputs, LoRA, structured output, tokenization caches.
"""

import time

from minicore.config import EngineConfig
from minicore.protocol import EngineCoreRequest
from minicore.sampling_params import INT64_MAX, INT64_MIN, SamplingParams, check_text

Prompt = str | list[int]


class InvalidRequestError(ValueError):
    """A request that cannot be served; param names the field at fault (for an HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = config.scheduler_config.max_model_len
        self.policy = config.scheduler_config.policy
        self.num_engines = config.parallel_config.data_parallel_size

    def process_inputs(self, request_id: str, prompt: Prompt, params: SamplingParams, *,
                       arrival_time: float | None = None, priority: int = 0,
                       data_parallel_rank: int | None = None) -> EngineCoreRequest:
        """The EngineCoreRequest for one prompt (a string, or a list of token ids); raises
        InvalidRequestError (a ValueError) for anything the engine could not run."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"sampling params must be SamplingParams, got {type(params).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int) or not (
                INT64_MIN <= priority <= INT64_MAX):
            raise InvalidRequestError(f"priority must be a 64-bit integer, got {priority!r}",
                                      "priority")
        if priority != 0 and self.policy != "priority":
            raise InvalidRequestError(f"priority {priority} needs the priority scheduling policy "
                                      "(--scheduling-policy priority)", "priority")
        if data_parallel_rank is not None and not 0 <= data_parallel_rank < self.num_engines:
            raise InvalidRequestError(
                f"data_parallel_rank {data_parallel_rank} is out of range: there are "
                f"{self.num_engines} data parallel engines", "data_parallel_rank")
        token_ids = self.tokenize(prompt)
        try:
            validate_prompt_token_ids(token_ids, self.vocab_size, self.max_model_len)
        except ValueError as e:
            raise InvalidRequestError(str(e), "prompt") from None
        return EngineCoreRequest(
            request_id, token_ids, params, self.tokenizer.eos_token_id,
            time.monotonic() if arrival_time is None else arrival_time, priority,
            data_parallel_rank=data_parallel_rank)

    def tokenize(self, prompt: Prompt) -> list[int]:
        """A text prompt's token ids (a list of ids is taken as it is)."""
        if isinstance(prompt, str):
            try:
                check_text("the prompt", prompt)
            except ValueError as e:
                raise InvalidRequestError(str(e), "prompt") from None
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if not isinstance(prompt, list | tuple):
            raise InvalidRequestError(f"a prompt is a string or a list of token ids, got "
                                      f"{type(prompt).__name__}", "prompt")
        return list(prompt)


def validate_prompt_token_ids(token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """ValueError unless the prompt holds 1 to max_model_len - 1 integer ids in
    [0, vocab_size): as vLLM's input processor, a prompt must leave room for one output token."""
    if not token_ids:
        raise ValueError("the prompt is empty: it must contain at least one token")
    if len(token_ids) >= max_model_len:
        than = "more than" if len(token_ids) > max_model_len else "as many as"
        raise ValueError(f"the prompt has {len(token_ids)} tokens, {than} max_model_len "
                         f"({max_model_len}): it must leave room for an output token")
    # The engine would drop a request whose ids do not decode as ints: refuse it here.
    if (not all(type(t) is int for t in token_ids)
            or min(token_ids) < 0 or max(token_ids) >= vocab_size):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
