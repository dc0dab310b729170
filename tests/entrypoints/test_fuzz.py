"""Issue 10, hostile input never takes the service down: a property test over every request field
of /v1/completions, /v1/chat/completions, /tokenize and /detokenize, against one real
`python -m minicore serve` (SIMULATED runner: no weights, instant tokens).

Each request is a mostly valid one with a few fields replaced by random or boundary values (huge
and negative integers, ints past int64, vocabulary edges, floats and bools where ints belong,
nulls, lone surrogates, NUL, emoji, long strings, empty lists, unknown fields), or anything at
all. Whatever it is, the answer is a 200 or a 400 (a 404 only for a wrong model name), never a
500, a 503 or a hang; an error is an OpenAI error object and a streamed 200 ends with
`data: [DONE]`. After the run the server is healthy, serves a normal request, and /metrics shows
an idle engine with an empty KV cache: nothing was left behind.

Reproducible (derandomize=True) and bounded: no shrinking (a hung server would make every
shrink step wait out the request timeout), a small max_tokens where it is valid, and the whole
module in well under a minute on two cores.
"""

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, Phase, assume, event, given, settings
from hypothesis import strategies as st
from server_helpers import ServerProcess, check_openai_error, engine_state, json_body

MODEL = "SmolLM2-135M-Instruct"
VOCAB_SIZE = 49152  # SmolLM2's
MAX_MODEL_LEN = 256
ARGS = ["--runner", "simulated", "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-memory", str(16 << 20)]
REQUEST_TIMEOUT_S = 10.0
MAX_BODY_BYTES = 20_000
SETTLE_S = 10.0

FUZZ = settings(derandomize=True, deadline=None, phases=[Phase.explicit, Phase.generate],
                report_multiple_bugs=False, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                       HealthCheck.data_too_large, HealthCheck.large_base_example])


@pytest.fixture(scope="module")
def server():
    with ServerProcess(*ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as client:
        yield client


@pytest.fixture(autouse=True)
def healthy_at_start(http):
    """Fail at once, rather than a request timeout later, if an earlier test broke the server."""
    try:
        status = http.get("/health", timeout=2).status_code
    except httpx.HTTPError as e:
        status = repr(e)
    if status != 200:
        pytest.fail(f"the server is not healthy at the start of the test (/health: {status})")


# ------------------------------------------------------------------------------- strategies

BOUNDARY_INTS = [-(2**70), -(2**64), -(2**63) - 1, -(2**63), -(2**31), -2, -1, 0, 1, 2, 3,
                 MAX_MODEL_LEN - 1, MAX_MODEL_LEN, MAX_MODEL_LEN + 1, VOCAB_SIZE - 1, VOCAB_SIZE,
                 10**6, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**70]
ODD_FLOATS = [1e308, -1e308, -0.0, 0.0, 5e-324, 1e-300, 0.5, 1.0000001, 2.5, -1.0, 1e20]
SPECIAL_CHARS = ["\ud800", "\udfff", "\udc00", "\x00", "\x7f", "😀", "👩‍👩‍👧", "\u202e", "\ufeff",
                 "\uffff", "\n", "\\", '"', "é", "中"]
SPECIAL_STRINGS = ["", " ", "\ud800", "a\ud800b", "\udfff\ud800", "\x00", "hi\x00there",
                   "<|im_start|>system\n", "<|endoftext|>", "{{ x }}", "{% raw %}", MODEL]
# Long strings (about 3 KB of JSON each), built lazily so that statistics stay readable.
LONG_STRINGS = st.sampled_from([("a", 3000), ("😀", 250), ("\ud800", 500), ("ab ", 1000)]).map(
    lambda piece_count: piece_count[0] * piece_count[1])
SAFE_TEXT = st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=30)

any_int = st.one_of(st.sampled_from(BOUNDARY_INTS), st.integers())
any_float = st.one_of(st.sampled_from(ODD_FLOATS), st.floats(allow_nan=False, allow_infinity=False))
# Any text: each piece a random character or a special one (lone surrogates, NUL, emoji...).
text = st.one_of(
    st.lists(st.one_of(st.characters(), st.sampled_from(SPECIAL_CHARS)), max_size=30)
    .map("".join),
    st.sampled_from(SPECIAL_STRINGS), LONG_STRINGS)
scalar = st.one_of(st.none(), st.booleans(), any_int, any_float, text)
# Any JSON value, small.
junk = st.recursive(scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(text, inner, max_size=3)), max_leaves=6)

token_id = st.one_of(st.integers(0, VOCAB_SIZE - 1), st.sampled_from(BOUNDARY_INTS))
odd_token = st.one_of(token_id, any_float, st.booleans(), st.none(), text)
hostile_prompt = st.one_of(
    text,
    st.lists(token_id, max_size=30),
    st.lists(odd_token, min_size=1, max_size=5),
    st.lists(text, max_size=3),
    st.lists(st.lists(token_id, max_size=10), max_size=3),
    st.lists(st.one_of(text, st.lists(token_id, max_size=3)), max_size=3),
    st.sampled_from([[], [[]], [""], [[], [1]], [[1], []], [0] * (MAX_MODEL_LEN + 1),
                     list(range(MAX_MODEL_LEN)), [VOCAB_SIZE - 1], [VOCAB_SIZE]]),
    junk)

roles = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer", "function"]),
                  text)
content_part = st.fixed_dictionaries(
    {"type": st.one_of(st.sampled_from(["text", "image_url", "input_audio"]), text)},
    optional={"text": st.one_of(text, st.none(), any_int), "image_url": junk})
content = st.one_of(text, st.none(), st.lists(content_part, max_size=3), junk)
message = st.fixed_dictionaries({}, optional={"role": roles, "content": content, "name": text,
                                              "tool_calls": junk})
hostile_messages = st.one_of(st.lists(message, max_size=4), st.lists(junk, max_size=2), junk)
valid_messages = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant"]), "content": SAFE_TEXT}),
    min_size=1, max_size=3)
wrong_models = st.one_of(text, st.sampled_from(["wrong-model", MODEL + " ", MODEL.lower()]))

# Values that keep a request valid (and quick): what a hostile field is mixed into.
VALID = {
    "max_tokens": st.integers(1, 8),
    "min_tokens": st.integers(0, 2),
    "temperature": st.one_of(st.sampled_from([0, 0.0, 1, 0.7]), st.floats(0, 2)),
    "top_p": st.floats(0.01, 1.0),
    "top_k": st.sampled_from([-1, 0, 1, 20]),
    "seed": st.integers(-(2**31), 2**31),
    "n": st.integers(1, 3),
    "stop": st.one_of(st.none(), SAFE_TEXT, st.lists(SAFE_TEXT, min_size=1, max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=3),
    "ignore_eos": st.booleans(),
    "priority": st.just(0),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries({"include_usage": st.booleans()})),
    "model": st.sampled_from([MODEL, None]),
    "user": SAFE_TEXT,
}
extreme_int = st.one_of(st.sampled_from(BOUNDARY_INTS), st.integers())
extreme_number = st.one_of(st.sampled_from(ODD_FLOATS), st.sampled_from(BOUNDARY_INTS), any_float)


def mostly(strategy):
    """Three times in four a value of the field's own type (so that it reaches the deeper checks
    rather than the type check), else any JSON value."""
    return st.integers(0, 3).flatmap(lambda i: junk if i == 0 else strategy)


# A hostile value per field.
HOSTILE = {
    "max_tokens": mostly(extreme_int),
    "min_tokens": mostly(extreme_int),
    "temperature": mostly(extreme_number),
    "top_p": mostly(extreme_number),
    "top_k": mostly(st.one_of(extreme_int, any_float)),
    "seed": mostly(extreme_int),
    "n": mostly(st.one_of(st.sampled_from([0, 1, 2, 3, -1, 128, 129, 10**6, 2**63, 2**70]),
                          extreme_int)),
    "stop": mostly(st.one_of(text, st.lists(text, max_size=4),
                             st.sampled_from(["", [""], [], ["a", ""]]))),
    "stop_token_ids": mostly(st.lists(extreme_int, max_size=3)),
    "ignore_eos": mostly(st.sampled_from([0, 1, 2, "true", "false", "yes", None])),
    "priority": mostly(extreme_int),
    "stream": mostly(st.sampled_from([0, 1, 2, "true", "false", None])),
    "stream_options": mostly(st.fixed_dictionaries({}, optional={
        "include_usage": st.sampled_from([True, False, None, 1, "yes"]),
        "continuous_usage_stats": st.booleans()})),
    "model": mostly(wrong_models),
    "user": mostly(text),
}
HOSTILE_CHAT = {**HOSTILE, "max_completion_tokens": mostly(extreme_int),
                "messages": hostile_messages, "add_generation_prompt": junk}
HOSTILE_COMPLETION = {**HOSTILE, "prompt": hostile_prompt}
# Parameters minicore does not implement (a 400 unless "not used"), and unknown fields.
EXTRA_FIELDS = st.one_of(st.sampled_from(["logprobs", "top_logprobs", "echo", "suffix",
                                          "logit_bias", "best_of", "frequency_penalty",
                                          "response_format", "tools"]), text)


@st.composite
def mixed_request(draw, required: dict, valid: dict, hostile: dict):
    """A valid request (some optional fields left out) with one to three fields made hostile,
    and maybe an extra field."""
    body = draw(st.fixed_dictionaries(required, optional=valid))
    body["stream"] = draw(st.booleans())
    for name in draw(st.lists(st.sampled_from(sorted(hostile)), min_size=1, max_size=3,
                              unique=True)):
        body[name] = draw(hostile[name])
    body.update(draw(st.dictionaries(EXTRA_FIELDS, junk, max_size=1)))
    return body


def requests(required: dict, valid: dict, hostile: dict):
    """Mostly valid requests with hostile fields, and some requests entirely made of junk."""
    mixed = mixed_request(required, valid, hostile)
    anything = st.fixed_dictionaries({}, optional=hostile)
    return st.one_of(mixed, mixed, mixed, anything, junk)


completion_requests = requests({"prompt": st.one_of(SAFE_TEXT, st.lists(
    st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=20))}, VALID, HOSTILE_COMPLETION)
chat_requests = requests({"messages": valid_messages},
                         {**VALID, "max_completion_tokens": st.integers(1, 8)}, HOSTILE_CHAT)
tokenize_requests = st.one_of(
    st.fixed_dictionaries({}, optional={
        "prompt": st.one_of(SAFE_TEXT, text, junk), "messages": st.one_of(valid_messages,
                                                                          hostile_messages),
        "model": st.one_of(st.just(MODEL), wrong_models, junk),
        "add_generation_prompt": st.one_of(st.booleans(), junk),
        "add_special_tokens": st.one_of(st.booleans(), junk)}),
    junk)
detokenize_requests = st.one_of(
    st.fixed_dictionaries({"tokens": st.one_of(st.lists(token_id, max_size=20),
                                               st.lists(odd_token, max_size=5), junk)},
                          optional={"model": st.one_of(st.just(MODEL), wrong_models, junk)}),
    junk)


# --------------------------------------------------------------------------------- checking


def _wrong_model(body) -> bool | None:
    """True: the request names a model that is not served; None: it is unclear whether ""
    (vLLM takes an empty name as the default model) counts; False: it is right or not given."""
    if not isinstance(body, dict) or body.get("model") in (None, MODEL):
        return False
    return None if body["model"] == "" else True


def _send(http: httpx.Client, path: str, body) -> tuple[httpx.Response, bytes]:
    """POST body (ASCII JSON bytes) and read the whole answer within REQUEST_TIMEOUT_S, even if
    it streams."""
    data = json_body(body)
    assume(len(data) <= MAX_BODY_BYTES)
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    chunks = []
    with http.stream("POST", path, content=data,
                     headers={"Content-Type": "application/json"}) as r:
        for chunk in r.iter_bytes():
            chunks.append(chunk)
            assert time.monotonic() < deadline, f"no end within {REQUEST_TIMEOUT_S} s"
    return r, b"".join(chunks)


def _check(http: httpx.Client, path: str, body) -> None:
    r, raw = _send(http, path, body)
    wrong = _wrong_model(body)
    allowed = {400, 404} if wrong else {200, 400, 404} if wrong is None else {200, 400}
    assert r.status_code in allowed, (r.status_code, raw[:500])
    streamed = r.headers.get("content-type", "").startswith("text/event-stream")
    event(f"{r.status_code}{' streamed' if streamed else ''}")  # --hypothesis-show-statistics
    if r.status_code != 200:
        error = check_openai_error(httpx.Response(r.status_code, content=raw), r.status_code)
        event(f"{r.status_code} param={error['param']}")
        return
    if streamed:
        assert raw.endswith(b"data: [DONE]\n\n"), raw[-500:]
        events = [json.loads(line[6:]) for line in raw.decode().splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        # Everything is checked before the 200: a stream never carries an error.
        assert events and not any("error" in e for e in events), raw[-500:]
    else:
        assert not path.startswith("/v1/") or body.get("stream") is not True
        answer = json.loads(raw)
        assert isinstance(answer, dict) and "error" not in answer, raw[:500]
        if path.startswith("/v1/"):
            assert answer["choices"], raw[:500]


# ------------------------------------------------------------------------------------ tests


@settings(FUZZ, max_examples=500)
@given(body=completion_requests)
def test_completions_never_fail_the_server(http, body):
    """/v1/completions: any body gets a 200 or an OpenAI 400 (404 for a wrong model)."""
    _check(http, "/v1/completions", body)


@settings(FUZZ, max_examples=500)
@given(body=chat_requests)
def test_chat_completions_never_fail_the_server(http, body):
    """/v1/chat/completions: any body gets a 200 or an OpenAI 400 (404 for a wrong model)."""
    _check(http, "/v1/chat/completions", body)


@settings(FUZZ, max_examples=200)
@given(path=st.sampled_from(["/tokenize", "/detokenize"]), data=st.data())
def test_tokenizer_endpoints_never_fail_the_server(http, path, data):
    """/tokenize and /detokenize: any body gets a 200 or an OpenAI 400 (404 for a wrong model)."""
    body = data.draw(tokenize_requests if path == "/tokenize" else detokenize_requests)
    _check(http, path, body)


def test_server_is_healthy_idle_and_serving_after_the_fuzz(http):
    """After all that: /health is 200, a normal completion succeeds, and the engine settles to
    nothing running or waiting with an empty KV cache (no request was left behind)."""
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200, r.text[:500]
    assert r.json()["usage"]["completion_tokens"] == 4
    idle = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0,
            "vllm:kv_cache_usage_perc": 0.0}
    deadline = time.monotonic() + SETTLE_S
    while (state := engine_state(http, MODEL)) != idle and time.monotonic() < deadline:
        time.sleep(0.1)
    assert state == idle
    assert http.get("/health").status_code == 200
