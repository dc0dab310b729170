"""SamplingParams: how one request samples and when it stops.

Mirrors vllm/sampling_params.py, keeping the parameters minicore implements: sampling, penalties,
min-p, logit bias, allowed/bad words, logprobs, stop conditions and detokenization switches (no beam
search, structured output, extra_args or logits processors). Invalid values raise ValueError at
construction, before anything
reaches the scheduler: the engine decodes the same class from the wire, so a request it receives
has passed the same checks. Integers must fit in 64 signed bits (what msgpack and torch carry) and
strings must be valid Unicode text. kv_transfer_params (prefill/decode disaggregation) is a JSON
object the KV connector reads; vLLM carries it in SamplingParams.extra_args["kv_transfer_params"],
minicore has no extra_args and gives it a field of its own.
"""

import math
from dataclasses import dataclass, field, replace
from typing import Any

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value > INT64_MAX:
        raise ValueError(f"{name} must be <= {INT64_MAX} (2**63 - 1), got {value}")


def check_text(name: str, text: str) -> None:
    """A string the tokenizer and the JSON encoder accept: no lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid Unicode text: {e.reason} at position "
                         f"{e.start}") from None


def _check_json(name: str, value, depth: int = 0) -> None:
    """A JSON value (what the OpenAI layer parsed, and what msgpack carries to the engine)."""
    if depth > 32:
        raise ValueError(f"{name} is nested too deeply")
    if value is None or isinstance(value, (bool, str)):
        return
    if isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            raise ValueError(f"{name} holds an integer that does not fit in 64 bits")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{name} holds a non-finite number")
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_json(name, item, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{name} keys must be strings, got {key!r}")
            _check_json(name, item, depth + 1)
    else:
        raise ValueError(f"{name} holds a {type(value).__name__}, which is not a JSON value")


def _check_number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _token_key(key) -> int:
    """A logit_bias key: a token id, or its decimal string (a JSON object's keys are strings)."""
    if isinstance(key, str):
        try:
            key = int(key)
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
    _check_int("logit_bias keys", key, 0)
    return key


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

    def __post_init__(self):
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        self.temperature = _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        self.top_p = _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, -1)
        if self.top_k == -1:
            self.top_k = 0
        if self.seed is not None:
            _check_int("seed", self.seed, INT64_MIN)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(x, str) and x for x in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = list(self.stop)
        for stop in self.stop:
            check_text("stop", stop)
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, 0)
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.kv_transfer_params is not None:
            if not isinstance(self.kv_transfer_params, dict):
                raise ValueError(f"kv_transfer_params must be a JSON object or null, got "
                                 f"{type(self.kv_transfer_params).__name__}")
            _check_json("kv_transfer_params", self.kv_transfer_params)
        self._verify_sampling_extras()

    def _verify_sampling_extras(self) -> None:
        """The checks of vLLM's _verify_args for n, the penalties, min-p and logprobs."""
        _check_int("n", self.n, 1)
        if self.n > 1 and self.greedy:
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_number(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be greater than zero, got "
                             f"{self.repetition_penalty}")
        self.min_p = _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:  # vLLM's spelling of 1
                setattr(self, name, 1)
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), -1)
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, -1)
            if self.truncate_prompt_tokens == 0:
                raise ValueError("truncate_prompt_tokens must be >= 1 or -1, got 0")
        for name in ("include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        self._verify_token_lists()

    def _verify_token_lists(self) -> None:
        """logit_bias, allowed_token_ids, bad_words and their token ids (the vocabulary bound is
        the InputProcessor's, which knows the model)."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a map of token id to bias, got "
                                 f"{type(self.logit_bias).__name__}")
            self.logit_bias = {_token_key(key): min(100.0, max(-100.0, _check_number(
                "logit_bias", bias))) for key, bias in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be a non-empty list of token ids, got "
                                 f"{self.allowed_token_ids!r}")
            for token_id in self.allowed_token_ids:
                _check_int("allowed_token_ids", token_id, 0)
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(
                    isinstance(w, str) and w for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of non-empty strings, got "
                                 f"{self.bad_words!r}")
            for word in self.bad_words:
                check_text("bad_words", word)
            self.bad_words = list(dict.fromkeys(self.bad_words))
        if self.bad_words_token_ids is not None:
            if not isinstance(self.bad_words_token_ids, (list, tuple)) or not all(
                    isinstance(w, (list, tuple)) and w for w in self.bad_words_token_ids):
                raise ValueError("bad_words_token_ids must be a list of non-empty token id lists")
            for word in self.bad_words_token_ids:
                for token_id in word:
                    _check_int("bad_words_token_ids", token_id, 0)
            self.bad_words_token_ids = [list(w) for w in self.bad_words_token_ids]

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
