"""--async-scheduling / --no-async-scheduling and LLM(async_scheduling=) without a model: the
flag reaches the scheduler config, its default (None) resolves by device (off on CPU, on for
CUDA, vLLM's), with drafts and with a KV connector too, and the one pair it does not support is
refused by name when asked for explicitly, and quietly left off when not."""

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
    ("cuda", ("--speculative-config", NGRAM), True), ("cuda", ("--kv-transfer-config", NIXL), True),
    ("cpu", ("--async-scheduling", "--speculative-config", NGRAM, "--kv-transfer-config", NIXL),
     True),
    # Unsupported: off by default, even on CUDA.
    ("cuda", ("--runner", "simulated", "-dp", "2"), False),
])
def test_the_default_resolves_by_device_and_support(device, argv, resolved):
    config = config_of(*argv)
    assert config.resolve_async_scheduling(device) is resolved
    assert config.scheduler_config.async_scheduling is resolved


def test_the_unsupported_pair_is_refused_by_name():
    with pytest.raises(ValueError, match="does not support the simulated runner with "
                                         "--data-parallel-size > 1"):
        config_of("--async-scheduling", "--runner", "simulated", "-dp", "2")


def test_the_llm_keyword_refuses_it_before_loading_a_model():
    with pytest.raises(ValueError, match="--async-scheduling does not support the simulated"):
        LLM("/nonexistent-model-dir", async_scheduling=True, runner="simulated",
            data_parallel_size=2)


def test_the_help_says_the_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--async-scheduling, --no-async-scheduling" in out
    assert "off on CPU" in out
