"""InputProcessor: the one place a prompt and its sampling parameters are checked and turned into
an EngineCoreRequest, for the offline LLM, AsyncLLM and the HTTP server alike.

Mirrors vllm/v1/engine/input_processor.py (process_inputs, _validate_model_input) with
SamplingParams.verify and update_from_tokenizer (vllm/sampling_params.py): a text prompt is
tokenized (with the tokenizer's special tokens unless add_special_tokens=False, as vLLM; a chat
template already holds them), truncate_prompt_tokens keeps the prompt's last tokens, token ids must
be integers in the vocabulary, the prompt must hold 1 to max_model_len - 1 tokens (room for one
output token, as in vLLM), a priority needs a policy using them and a DP rank must exist; text must
be valid Unicode and integers must fit in 64 bits (SamplingParams checks its own fields). bad_words
become bad_words_token_ids; logit_bias, allowed_token_ids, stop ids and bad words must be in the
vocabulary, and logprobs within --max-logprobs; the generation config's extra EOS ids join
stop_token_ids; kv_transfer_params must be what the configured KV connector can act on (its
classmethod validate_kv_transfer_params; without a connector they are ignored, as in vLLM); a
structured-output constraint must compile (xgrammar, no tokenizer) in a config that runs it.
Everything is checked before anything is sent, so a refused request leaves nothing behind. The
engine checks the prompt's token ids, the sampling token ids and the kv_transfer_params again
(validate_prompt_token_ids, validate_sampling_params, ConnectorRemoteKV.validate_request: it
trusts no frontend).
Left out: multimodal inputs, LoRA, tokenization caches, logprob_token_ids.
"""

import dataclasses
import time

from minicore.config import EngineConfig, rank_span
from minicore.kv_transfer.base import KVConnectorBase_V1
from minicore.kv_transfer.factory import KVConnectorFactory
from minicore.model.registry import runner_info
from minicore.protocol import EngineCoreRequest
from minicore.sampling_checks import INT64_MAX, INT64_MIN, check_text
from minicore.sampling_params import SamplingParams
from minicore.scheduler.policies import get_policy, policy_names
from minicore.structured_output.manager import structured_outputs_unsupported
from minicore.structured_output.params import validate_structured_outputs

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
        self.policy = get_policy(config.scheduler_config.policy)
        # Read at each request: an elastic scale changes the ranks.
        self.parallel_config = config.parallel_config
        self.max_logprobs = config.model_config.max_logprobs
        self.has_logits = runner_info(config.model_config.runner).has_logits
        self.structured_outputs_refused = structured_outputs_unsupported(config, self.has_logits)
        so_config = config.structured_outputs_config
        self.max_grammar_nesting = so_config.max_grammar_nesting
        self.max_grammar_bytes = so_config.max_grammar_bytes
        # vLLM's update_from_generation_config: the generation config's other EOS ids stop too.
        eos_ids = config.model_config.try_get_generation_config().get("eos_token_id")
        eos_ids = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids or ())
        self.extra_eos_token_ids = [t for t in eos_ids if t != tokenizer.eos_token_id]
        # Whose check kv_transfer_params pass: the configured connector's (its class only: the
        # connector itself lives in the engine); the base class's, which passes all, without one.
        self.kv_transfer_config = kv_config = config.kv_transfer_config
        self.kv_connector_class = (KVConnectorBase_V1 if kv_config is None
                                   else KVConnectorFactory.get_connector_class(kv_config))
        self.block_size = config.cache_config.block_size

    def process_inputs(self, request_id: str, prompt: Prompt, params: SamplingParams, *,
                       arrival_time: float | None = None, priority: int = 0,
                       data_parallel_rank: int | None = None,
                       add_special_tokens: bool = True) -> EngineCoreRequest:
        """The EngineCoreRequest for one prompt (a string, or a list of token ids); raises
        InvalidRequestError (a ValueError) for anything the engine could not run."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"sampling params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str):
            # The engine would drop it as malformed, and its caller would wait forever.
            raise InvalidRequestError(f"request_id must be a string, got {request_id!r}",
                                      "request_id")
        if isinstance(priority, bool) or not isinstance(priority, int) or not (
                INT64_MIN <= priority <= INT64_MAX):
            raise InvalidRequestError(f"priority must be a 64-bit integer, got {priority!r}",
                                      "priority")
        if priority != 0 and not self.policy.uses_priority:
            names = " or ".join(n for n in policy_names() if get_policy(n).uses_priority)
            raise InvalidRequestError(f"priority {priority} needs a scheduling policy that uses "
                                      f"priorities (--scheduling-policy {names})", "priority")
        ranks = self.parallel_config.engine_ranks
        if data_parallel_rank is not None and data_parallel_rank not in ranks:
            raise InvalidRequestError(
                f"data_parallel_rank {data_parallel_rank} is out of range: this frontend's data "
                f"parallel engines are ranks {rank_span(ranks)}", "data_parallel_rank")
        token_ids = self._truncate(self.tokenize(prompt, add_special_tokens),
                                   params.truncate_prompt_tokens)
        try:
            validate_prompt_token_ids(token_ids, self.vocab_size, self.max_model_len)
        except ValueError as e:
            raise InvalidRequestError(str(e), "prompt") from None
        self._check_kv_transfer_params(params, len(token_ids))
        if params.bad_words:
            params = dataclasses.replace(params, bad_words_token_ids=self._bad_words_token_ids(
                params.bad_words))
        if self.extra_eos_token_ids and not params.ignore_eos:
            params = dataclasses.replace(params, stop_token_ids=list(dict.fromkeys(
                [*params.stop_token_ids, *self.extra_eos_token_ids])))
        validate_sampling_params(params, self.vocab_size, self.max_logprobs, self.has_logits)
        self._check_structured_outputs(params)
        return EngineCoreRequest(
            request_id, token_ids, params, self.tokenizer.eos_token_id,
            time.monotonic() if arrival_time is None else arrival_time, priority,
            data_parallel_rank=data_parallel_rank)

    def tokenize(self, prompt: Prompt, add_special_tokens: bool = True) -> list[int]:
        """A text prompt's token ids (a list of ids is taken as it is)."""
        if isinstance(prompt, str):
            try:
                check_text("the prompt", prompt)
            except ValueError as e:
                raise InvalidRequestError(str(e), "prompt") from None
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if not isinstance(prompt, list | tuple):
            raise InvalidRequestError(f"a prompt is a string or a list of token ids, got "
                                      f"{type(prompt).__name__}", "prompt")
        return list(prompt)

    def _check_kv_transfer_params(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        if params.kv_transfer_params is None:
            return
        try:
            self.kv_connector_class.validate_kv_transfer_params(
                params.kv_transfer_params, num_prompt_tokens, self.block_size,
                self.kv_transfer_config)
        except ValueError as e:
            raise InvalidRequestError(str(e), "kv_transfer_params") from None

    def _check_structured_outputs(self, params: SamplingParams) -> None:
        """A constraint the engine can compile, in a config that can run it (vLLM: the
        frontend's structured-output validation), so that a bad one is a 400, not an engine
        error."""
        if params.structured_outputs is None:
            return
        if self.structured_outputs_refused:
            raise InvalidRequestError("structured outputs are not supported with "
                                      f"{self.structured_outputs_refused}", "structured_outputs")
        try:
            validate_structured_outputs(params.structured_outputs, self.max_grammar_nesting,
                                        self.max_grammar_bytes)
        except ValueError as e:
            raise InvalidRequestError(str(e), "structured_outputs") from None

    def _truncate(self, token_ids: list[int], keep: int | None) -> list[int]:
        """The last `keep` tokens (-1: max_model_len), as vLLM's truncate_prompt_tokens."""
        if keep is None:
            return token_ids
        if keep > self.max_model_len:
            raise InvalidRequestError(
                f"truncate_prompt_tokens ({keep}) is greater than max_model_len "
                f"({self.max_model_len})", "truncate_prompt_tokens")
        keep = self.max_model_len if keep == -1 else keep
        return token_ids[-keep:]

    def _bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Each bad word's token ids, as itself and after a space when that makes a different word
        of as many tokens (vLLM's SamplingParams.update_from_tokenizer)."""
        words: list[list[int]] = []
        for bad_word in bad_words:
            for prefix in ("", " "):
                token_ids = self.tokenizer.encode(prefix + bad_word.lstrip(),
                                                  add_special_tokens=False)
                if not token_ids:
                    if not prefix:
                        raise InvalidRequestError(
                            f"bad_words entry {bad_word!r} tokenizes to no token", "bad_words")
                    continue
                if not prefix or (token_ids[0] != words[-1][0]
                                  and len(token_ids) == len(words[-1])):
                    words.append(token_ids)
        return words


def validate_sampling_params(params: SamplingParams, vocab_size: int, max_logprobs: int,
                             has_logits: bool = True) -> None:
    """InvalidRequestError (a ValueError) unless every token id the sampler indexes with is in
    [0, vocab_size) and logprobs are within max_logprobs (-1: the vocabulary), as vLLM's
    SamplingParams.verify; a runner without logits (the simulated one) gives no logprobs."""
    for name, token_ids in (("logit_bias", list(params.logit_bias or ())),
                            ("allowed_token_ids", params.allowed_token_ids or []),
                            ("stop_token_ids", params.stop_token_ids),
                            ("bad_words", [t for word in params.bad_words_token_ids or []
                                           for t in word])):
        if invalid := [t for t in token_ids if not 0 <= t < vocab_size]:
            raise InvalidRequestError(f"token id(s) {invalid[:8]} in {name} are out of the "
                                      f"vocabulary (size {vocab_size})", name)
    bound = vocab_size if max_logprobs == -1 else max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        if (num := getattr(params, name)) is None:
            continue
        if not has_logits:
            raise InvalidRequestError(f"{name}: the simulated model runner computes no logits, "
                                      "so it gives no logprobs", name)
        if (vocab_size if num == -1 else num) > bound:
            raise InvalidRequestError(
                f"requested {name} of {num}, which is greater than max allowed: {bound} "
                "(--max-logprobs)", name)


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
