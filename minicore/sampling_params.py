"""SamplingParams: how one request samples and when it stops.

Mirrors vllm/sampling_params.py, keeping the parameters minicore implements (no logprobs, penalties,
beam search or structured output). Invalid values raise ValueError at construction, before anything
reaches the scheduler: the engine decodes the same class from the wire, so a request it receives
has passed the same checks. Integers must fit in 64 signed bits (what msgpack and torch carry) and
strings must be valid Unicode text. kv_transfer_params (prefill/decode disaggregation) is a JSON
object the KV connector reads; vLLM carries it in SamplingParams.extra_args["kv_transfer_params"],
minicore has no extra_args and gives it a field of its own.
"""

import math
from dataclasses import dataclass, field
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
