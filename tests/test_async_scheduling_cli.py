"""--async-scheduling / --no-async-scheduling and LLM(async_scheduling=) without a model: the
flag reaches the scheduler config, its default (None) resolves by device (off on CPU, on for
CUDA, vLLM's), and the pairs it does not support are refused by name when asked for explicitly,
and quietly left off when not."""

import json

import pytest

import minicore.__main__ as cli
from minicore.config import create_engine_config
from minicore.engine.arg_utils import engine_kwargs_from_cli
from minicore.llm import LLM

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
NIXL = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})


def config_of(*argv: str):
    return create_engine_config(**engine_kwargs_from_cli(cli.make_parser().parse_args(
        ["serve", *argv])))


@pytest.mark.parametrize("argv, value", [((), None), (("--async-scheduling",), True),
                                         (("--no-async-scheduling",), False)])
def test_the_flag_reaches_the_scheduler_config(argv, value):
    assert config_of(*argv).scheduler_config.async_scheduling is value


@pytest.mark.parametrize("device, argv, resolved", [
    ("cpu", (), False), ("cuda", (), True), ("cpu", ("--async-scheduling",), True),
    ("cuda", ("--no-async-scheduling",), False),
    # Unsupported pairs: off by default, even on CUDA.
    ("cuda", ("--speculative-config", NGRAM), False),
    ("cuda", ("--kv-transfer-config", NIXL), False),
])
def test_the_default_resolves_by_device_and_support(device, argv, resolved):
    config = config_of(*argv)
    assert config.resolve_async_scheduling(device) is resolved
    assert config.scheduler_config.async_scheduling is resolved


@pytest.mark.parametrize("argv, message", [
    (("--speculative-config", NGRAM), "does not support ngram speculative decoding"),
    (("--kv-transfer-config", NIXL), "does not support a KV connector"),
    (("--runner", "simulated", "-dp", "2"),
     "does not support the simulated runner with --data-parallel-size > 1"),
])
def test_unsupported_pairs_are_refused_by_name(argv, message):
    with pytest.raises(ValueError, match=message):
        config_of("--async-scheduling", *argv)


def test_the_llm_keyword_refuses_a_pair_before_loading_a_model():
    with pytest.raises(ValueError, match="--async-scheduling does not support ngram"):
        LLM("/nonexistent-model-dir", async_scheduling=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 3})


def test_the_help_says_the_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--async-scheduling, --no-async-scheduling" in out
    assert "off on CPU" in out
