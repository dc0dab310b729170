"""kv_transfer_params are checked before any scheduler sees them (issue 24): NixlConnector's check
(validate_nixl_params) refuses each bad shape naming the key; the InputProcessor turns that into an
InvalidRequestError on "kv_transfer_params" (an HTTP 400), and checks nothing without a connector;
the engine checks again, so a request that went around the frontend is refused alone while the
engine serves on (once, `remote_port: "abc"` raised inside schedule() and killed the engine)."""

import re
import sys
import time
import types
from pathlib import Path

import pytest

from minicore.config import create_engine_config
from minicore.engine.components import make_engine_core
from minicore.engine.input_processor import InputProcessor, InvalidRequestError
from minicore.kv_transfer.base import KVConnectorRole
from minicore.kv_transfer.config import KVTransferConfig
from minicore.kv_transfer.nixl import NixlConnector
from minicore.kv_transfer.nixl_metadata import REMOTE_PREFILL_KEYS, validate_nixl_params
from minicore.protocol import EngineCoreRequest, EngineCoreRequestType
from minicore.request import FinishReason
from minicore.sampling_params import SamplingParams
from minicore.testing import make_request

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_helpers import FakeFrontend, simulated_config  # noqa: E402

from minicore.engine.launch import run_engine_core  # noqa: E402

BLOCK_SIZE = 4
PROMPT = list(range(10, 20))  # 10 tokens: 3 blocks of 4
# What a prefill instance returns (NixlConnectorScheduler.request_finished).
VALID = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [7, 8, 9],
         "remote_engine_id": "P", "remote_host": "127.0.0.1", "remote_port": 5600,
         "remote_request_id": "cmpl-1-0", "tp_size": 1}
# What vLLM's toy proxy asks a prefill instance for.
TOY_PREFILL_ASK = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                   "remote_block_ids": None, "remote_host": None, "remote_port": None}


def without(key: str) -> dict:
    return {k: v for k, v in VALID.items() if k != key}


# (params, the key the error names)
BAD = [
    *[(dict(VALID, remote_port=port), "remote_port")
      for port in ("abc", "5600", 0, -1, 65536, 2**40, 5600.0, True, [5600])],
    *[(dict(VALID, remote_block_ids=ids), "remote_block_ids")
      for ids in (5, "1,2", {"0": 1}, [], [-1], [1.5], [True], ["1"], [[1]], [2**31],
                  [1, 2, 3, 4])],
    *[(without(key), key) for key in REMOTE_PREFILL_KEYS],
    *[(dict(VALID, **{key: None}), key) for key in REMOTE_PREFILL_KEYS],
    *[(dict(VALID, remote_engine_id=v), "remote_engine_id") for v in ("", 7, "e" * 1025)],
    *[(dict(VALID, remote_request_id=v), "remote_request_id") for v in (["r"], "\ud800")],
    *[(dict(VALID, remote_host=v), "remote_host")
      for v in ("", 1, "a b", "host/x", "h\n", "h" * 300)],
    *[(dict(VALID, do_remote_prefill=v), "do_remote_prefill") for v in ("yes", 1, [True])],
    ({"do_remote_decode": "true"}, "do_remote_decode"),
    ({"do_remote_prefill": True}, "remote_block_ids"),
    (dict(TOY_PREFILL_ASK, remote_port="x"), "remote_port"),
    *[(dict(VALID, tp_size=v), "tp_size") for v in (2, "1", 0)],
]
GOOD = [VALID, TOY_PREFILL_ASK, {}, {"do_remote_decode": True}, {"other": [1, "x"]},
        dict(VALID, remote_block_ids=[0]), dict(VALID, remote_block_ids=(1, 2)),
        dict(VALID, remote_host="::1"), dict(VALID, remote_host="[fe80::1%eth0]"),
        dict(VALID, remote_port=65535, tp_size=None)]


def _id(case) -> str:
    params, key = case
    return f"{key}={str(params.get(key, '<missing>'))[:12]}"


@pytest.mark.parametrize("params, key", BAD, ids=[_id(c) for c in BAD])
def test_each_bad_shape_is_refused_naming_the_key(params, key):
    with pytest.raises(ValueError, match=rf"^kv_transfer_params\.{key}\b"):
        validate_nixl_params(params, len(PROMPT), BLOCK_SIZE)
    # The connector's classmethod is the same check, with no connector built.
    with pytest.raises(ValueError, match=key):
        NixlConnector.validate_kv_transfer_params(params, len(PROMPT), BLOCK_SIZE,
                                                  nixl_kv_config())


@pytest.mark.parametrize("params", GOOD)
def test_what_a_prefill_instance_returns_or_is_asked_for_passes(params):
    validate_nixl_params(params, len(PROMPT), BLOCK_SIZE, allowed_hosts=("*",))


@pytest.mark.parametrize("allowed, hosts_ok, hosts_refused", [
    # The default: this machine only.
    (None, ["localhost", "LocalHost", "127.0.0.1", "127.0.0.2", "::1", "[::1]"],
     ["10.1.2.3", "prefill-1", "evil.example.com", "::2", "0.0.0.0"]),
    (["10.0.0.0/8", "prefill-1", "fd00::/8"], ["10.1.2.3", "prefill-1", "fd00::5"],
     ["127.0.0.1", "11.0.0.1", "prefill-2", "fe80::1"]),
    (["*"], ["10.1.2.3", "anything.example.com"], []),
])
def test_a_decode_instance_reads_only_from_the_allowed_prefill_hosts(allowed, hosts_ok,
                                                                     hosts_refused):
    """A request names the host its KV is read from: a host not allowed is refused (a 400 at the
    server) before anything connects there."""
    extra = {} if allowed is None else {"allowed_remote_hosts": allowed}
    p = processor(nixl_config(extra))
    for host in hosts_ok:
        p.process_inputs("ok", PROMPT, SamplingParams(kv_transfer_params=dict(VALID,
                                                                              remote_host=host)))
    for host in hosts_refused:
        with pytest.raises(InvalidRequestError, match=rf"remote_host '{re.escape(host)}' is not "
                           r"a prefill peer .*allowed_remote_hosts") as e:
            p.process_inputs("r", PROMPT, SamplingParams(kv_transfer_params=dict(
                VALID, remote_host=host)))
        assert e.value.param == "kv_transfer_params"


@pytest.mark.parametrize("allowed", ["10.0.0.1", [1], ["a b"], None])
def test_a_bad_allowed_hosts_list_stops_the_connector_naming_the_key(allowed):
    config = nixl_config({"allowed_remote_hosts": allowed})
    with pytest.raises(ValueError, match="kv_connector_extra_config.allowed_remote_hosts must be"):
        NixlConnector(config, KVConnectorRole.SCHEDULER)


def nixl_kv_config(extra: dict | None = None) -> KVTransferConfig:
    return KVTransferConfig("NixlConnector", "kv_both", "E", {"side_channel_port": 7100,
                                                              **(extra or {})})


def nixl_config(extra: dict | None = None):
    return create_engine_config(block_size=BLOCK_SIZE, max_model_len=64,
                                kv_transfer_config=nixl_kv_config(extra))


def processor(config) -> InputProcessor:
    return InputProcessor(config, types.SimpleNamespace(eos_token_id=2), 1000)


@pytest.mark.parametrize("params, key", BAD, ids=[_id(c) for c in BAD])
def test_the_input_processor_refuses_them_as_kv_transfer_params(params, key):
    with pytest.raises(InvalidRequestError, match=rf"kv_transfer_params\.{key}") as e:
        processor(nixl_config()).process_inputs(
            "r", PROMPT, SamplingParams(kv_transfer_params=params))
    assert e.value.param == "kv_transfer_params"


def test_the_block_bound_is_the_prompt_as_it_is_sent():
    p = processor(nixl_config())
    request = p.process_inputs("ok", PROMPT, SamplingParams(kv_transfer_params=VALID))
    assert request.sampling_params.kv_transfer_params == VALID
    # Truncated to 4 tokens, the prompt fills one block: three remote ones cannot be its.
    with pytest.raises(InvalidRequestError, match="at most 1 blocks"):
        p.process_inputs("r", PROMPT, SamplingParams(truncate_prompt_tokens=4,
                                                     kv_transfer_params=VALID))


def test_without_a_connector_the_params_are_not_checked():
    p = processor(create_engine_config(block_size=BLOCK_SIZE, max_model_len=64))
    for params, _ in BAD:
        p.process_inputs("r", PROMPT, SamplingParams(kv_transfer_params=params))


def fake_nixl_kv_config() -> KVTransferConfig:
    return KVTransferConfig("FakeNixlConnector", "kv_both", "E", {},
                            kv_connector_module_path="fake_connector")


def test_the_engine_refuses_them_alone_and_serves_on():
    """Straight to EngineCore.add_request, as a frontend that checked nothing would send them."""
    engine = make_engine_core(create_engine_config(runner="simulated", block_size=BLOCK_SIZE,
                                             max_model_len=64,
                                             kv_transfer_config=fake_nixl_kv_config()))
    engine.add_request(make_request("beside", PROMPT, max_tokens=5))
    for i, (params, key) in enumerate(BAD):
        with pytest.raises(ValueError, match=rf"kv_transfer_params\.{key}"):
            engine.add_request(make_request(f"bad{i}", PROMPT, kv_transfer_params=params))
    assert list(engine.scheduler.requests) == ["beside"]
    tokens = []
    while engine.scheduler.has_requests():
        outputs, _ = engine.step()
        tokens += [t for o in outputs for t in o.new_token_ids]
    assert len(tokens) == 5


def test_the_engine_process_finishes_each_with_an_error_alone():
    """Over the engine's sockets: each bad request finishes at once with FinishReason.ERROR and
    its message, a request beside them runs to its end, and the engine lives on."""
    bad = {f"bad{i}": params for i, (params, _) in enumerate(BAD[:12])}
    with FakeFrontend() as frontend:
        proc = frontend.start(run_engine_core, simulated_config(
            kv_transfer_config=fake_nixl_kv_config()))
        frontend.complete_handshake()
        frontend.send(EngineCoreRequestType.ADD, EngineCoreRequest(
            "beside", PROMPT, SamplingParams(max_tokens=20), 2, time.monotonic()))
        for req_id, params in bad.items():
            frontend.send(EngineCoreRequestType.ADD, EngineCoreRequest(
                req_id, PROMPT, SamplingParams(kv_transfer_params=params), 2, time.monotonic()))
        finished, deadline = {}, time.monotonic() + 30
        while len(finished) < len(bad) + 1:
            frame = frontend.next_output(max(0.01, deadline - time.monotonic()))
            assert not isinstance(frame, bytes), frame  # ENGINE_CORE_DEAD
            finished.update({o.request_id: o for o in frame.outputs if o.finish_reason is not None})
        assert all(finished[r].finish_reason is FinishReason.ERROR
                   and "kv_transfer_params." in finished[r].error_message for r in bad)
        assert finished["beside"].finish_reason is FinishReason.LENGTH
        assert proc.is_alive()
