"""The checks of a request's values from outside: SamplingParams' fields, and the integers and
text the InputProcessor checks.

Mirrors SamplingParams._verify_args and _verify_greedy_sampling (vllm/sampling_params.py), which
minicore keeps beside the record rather than inside it, so that the record reads as what a request
asks for. Integers must fit in 64 signed bits (what msgpack and torch carry) and strings must be
valid Unicode text. The vocabulary bounds are the InputProcessor's, which knows the model.
"""

import math

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def check_int(name: str, value, minimum: int) -> None:
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


def check_json(name: str, value, depth: int = 0) -> None:
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
            check_json(name, item, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{name} keys must be strings, got {key!r}")
            check_json(name, item, depth + 1)
    else:
        raise ValueError(f"{name} holds a {type(value).__name__}, which is not a JSON value")


def check_number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def token_key(key) -> int:
    """A logit_bias key: a token id, or its decimal string (a JSON object's keys are strings)."""
    if isinstance(key, str):
        try:
            key = int(key)
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
    check_int("logit_bias keys", key, 0)
    return key


def verify_sampling_params(p) -> None:
    """Check every field of SamplingParams p, normalising the spellings vLLM accepts (top_k -1,
    a single stop string, logprobs True, logit_bias keys as strings); ValueError naming it."""
    if p.max_tokens is not None:
        check_int("max_tokens", p.max_tokens, 1)
    p.temperature = check_number("temperature", p.temperature)
    if p.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {p.temperature}")
    p.top_p = check_number("top_p", p.top_p)
    if not 0 < p.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {p.top_p}")
    check_int("top_k", p.top_k, -1)
    if p.top_k == -1:
        p.top_k = 0
    if p.seed is not None:
        check_int("seed", p.seed, INT64_MIN)
    if isinstance(p.stop, str):
        p.stop = [p.stop]
    if not isinstance(p.stop, (list, tuple)) or not all(isinstance(x, str) and x for x in p.stop):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {p.stop!r}")
    p.stop = list(p.stop)
    for stop in p.stop:
        check_text("stop", stop)
    if not isinstance(p.stop_token_ids, (list, tuple)):
        raise ValueError(f"stop_token_ids must be a list of integers, got {p.stop_token_ids!r}")
    for token_id in p.stop_token_ids:
        check_int("stop_token_ids", token_id, 0)
    p.stop_token_ids = list(p.stop_token_ids)
    if not isinstance(p.ignore_eos, bool):
        raise ValueError(f"ignore_eos must be a boolean, got {p.ignore_eos!r}")
    check_int("min_tokens", p.min_tokens, 0)
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise ValueError(f"min_tokens ({p.min_tokens}) must be <= max_tokens ({p.max_tokens})")
    if p.kv_transfer_params is not None:
        if not isinstance(p.kv_transfer_params, dict):
            raise ValueError(f"kv_transfer_params must be a JSON object or null, got "
                             f"{type(p.kv_transfer_params).__name__}")
        check_json("kv_transfer_params", p.kv_transfer_params)
    _verify_sampling_extras(p)


def _verify_sampling_extras(p) -> None:
    """The checks of vLLM's _verify_args for n, the penalties, min-p and logprobs."""
    check_int("n", p.n, 1)
    if p.n > 1 and p.temperature == 0.0:
        raise ValueError(f"n must be 1 when using greedy sampling, got {p.n}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = check_number(name, getattr(p, name))
        if not -2.0 <= value <= 2.0:
            raise ValueError(f"{name} must be in [-2, 2], got {value}")
        setattr(p, name, value)
    p.repetition_penalty = check_number("repetition_penalty", p.repetition_penalty)
    if p.repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be greater than zero, got "
                         f"{p.repetition_penalty}")
    p.min_p = check_number("min_p", p.min_p)
    if not 0.0 <= p.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {p.min_p}")
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(p, name) is True:  # vLLM's spelling of 1
            setattr(p, name, 1)
        if getattr(p, name) is not None:
            check_int(name, getattr(p, name), -1)
    if p.truncate_prompt_tokens is not None:
        check_int("truncate_prompt_tokens", p.truncate_prompt_tokens, -1)
        if p.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be >= 1 or -1, got 0")
    for name in ("include_stop_str_in_output", "skip_special_tokens",
                 "spaces_between_special_tokens"):
        if not isinstance(getattr(p, name), bool):
            raise ValueError(f"{name} must be a boolean, got {getattr(p, name)!r}")
    _verify_token_lists(p)


def _verify_token_lists(p) -> None:
    """logit_bias, allowed_token_ids, bad_words and their token ids (the vocabulary bound is
    the InputProcessor's, which knows the model)."""
    if p.logit_bias is not None:
        if not isinstance(p.logit_bias, dict):
            raise ValueError(f"logit_bias must be a map of token id to bias, got "
                             f"{type(p.logit_bias).__name__}")
        p.logit_bias = {token_key(key): min(100.0, max(-100.0, check_number(
            "logit_bias", bias))) for key, bias in p.logit_bias.items()}
    if p.allowed_token_ids is not None:
        if not isinstance(p.allowed_token_ids, (list, tuple)) or not p.allowed_token_ids:
            raise ValueError("allowed_token_ids must be a non-empty list of token ids, got "
                             f"{p.allowed_token_ids!r}")
        for token_id in p.allowed_token_ids:
            check_int("allowed_token_ids", token_id, 0)
        p.allowed_token_ids = list(p.allowed_token_ids)
    if p.bad_words is not None:
        if not isinstance(p.bad_words, (list, tuple)) or not all(
                isinstance(w, str) and w for w in p.bad_words):
            raise ValueError(f"bad_words must be a list of non-empty strings, got "
                             f"{p.bad_words!r}")
        for word in p.bad_words:
            check_text("bad_words", word)
        p.bad_words = list(dict.fromkeys(p.bad_words))
    if p.bad_words_token_ids is not None:
        if not isinstance(p.bad_words_token_ids, (list, tuple)) or not all(
                isinstance(w, (list, tuple)) and w for w in p.bad_words_token_ids):
            raise ValueError("bad_words_token_ids must be a list of non-empty token id lists")
        for word in p.bad_words_token_ids:
            for token_id in word:
                check_int("bad_words_token_ids", token_id, 0)
        p.bad_words_token_ids = [list(w) for w in p.bad_words_token_ids]
