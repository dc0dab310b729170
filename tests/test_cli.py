"""The command line's engine flags, made from the config dataclasses by add_engine_cli_args: one
flag per user-facing field with the dataclass's default, vLLM's flag names, and a bad value refused
by argparse (exit code 2) or by the config (ValueError); a model that --enable-expert-parallel
cannot serve is refused from its config.json; --max-model-len auto resolved from a model's files;
vLLM's log format. Parsing only: no engine starts."""

import argparse
import re
from collections import Counter
from dataclasses import fields

import pytest

import minicore.__main__ as cli
from minicore.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    create_engine_config,
)
from minicore.engine.arg_utils import engine_kwargs_from_cli
from minicore.model.config import SimulatedCost

CONFIGS = (ModelConfig, SchedulerConfig, CacheConfig, ParallelConfig)
RUNTIME_FIELDS = {"num_blocks", "data_parallel_rank", "model_source", "client_count"}


def engine_config(argv: list[str]) -> EngineConfig:
    args = cli.make_parser().parse_args(argv)
    exclude = cli.GENERATE_EXCLUDE if args.command == "generate" else ()
    return create_engine_config(**engine_kwargs_from_cli(args, exclude))


def flag_counts(command: str) -> Counter:
    """How many flags set each destination in the subcommand's parser."""
    sub = next(a for a in cli.make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return Counter(a.dest for a in sub.choices[command]._actions)


@pytest.mark.parametrize("argv", [["serve"], ["generate", "hi"]])
def test_defaults_are_the_dataclass_defaults(argv):
    assert engine_config(argv) == EngineConfig()


def test_serve_has_one_flag_per_user_facing_field():
    counts = flag_counts("serve")
    for cls in CONFIGS:
        for f in fields(cls):
            assert counts[f.name] == (0 if f.name in RUNTIME_FIELDS else 1), f.name


def test_generate_has_the_engine_flags_but_data_parallel_and_runner():
    counts = flag_counts("generate")
    left_out = RUNTIME_FIELDS | {"runner", "simulated_cost"}
    for cls in CONFIGS:
        for f in fields(cls):
            dp = cls is ParallelConfig or f.name.startswith("balance_")
            assert counts[f.name] == (0 if dp or f.name in left_out else 1), f.name


def test_generate_seed_seeds_the_requests_not_the_engine():
    args = cli.make_parser().parse_args(["generate", "hi", "--seed", "5"])
    assert args.seed == 5
    assert engine_config(["generate", "hi", "--seed", "5"]).model_config.seed == 0


def test_serve_flags_round_trip():
    config = engine_config([
        "serve", "--max-num-seqs", "7", "--no-enable-prefix-caching", "--scheduling-policy",
        "priority", "-dp", "2", "--balance-scheduling", "--balance-threshold", "one-short",
        "--balance-count-sync", "all-reduce-max",
        "--simulated-cost", '{"step_s": 0.01}', "--runner", "simulated", "--seed", "3",
        "--kv-cache-memory", "4096", "--gpu-memory-utilization", "0.5", "-dpl", "1", "-dpr", "1",
        "-dpa", "10.0.0.2", "-dpp", "30000"])
    sched, cache, model, par = (config.scheduler_config, config.cache_config,
                                config.model_config, config.parallel_config)
    assert (sched.max_num_seqs, sched.policy) == (7, "priority")
    assert (sched.balance_scheduling, sched.balance_threshold, sched.balance_count_sync) \
        == (True, "one-short", "all-reduce-max")
    assert (cache.enable_prefix_caching, cache.kv_cache_memory, cache.gpu_memory_utilization) \
        == (False, 4096, 0.5)
    assert (model.runner, model.seed, model.simulated_cost) == ("simulated", 3, SimulatedCost(0.01))
    assert (par.data_parallel_size, par.data_parallel_size_local, par.data_parallel_start_rank,
            par.data_parallel_address, par.data_parallel_rpc_port) == (2, 1, 1, "10.0.0.2", 30000)


def test_generate_flags_round_trip():
    config = engine_config(["generate", "hi", "--model", "m.gguf", "--dtype", "float16",
                            "--no-enable-chunked-prefill", "--max-num-batched-tokens", "4096",
                            "--max-model-len", "1024", "--block-size", "32",
                            "--long-prefill-token-threshold", "64"])
    assert (config.model_config.model, config.model_config.dtype) == ("m.gguf", "float16")
    sched = config.scheduler_config
    assert (sched.enable_chunked_prefill, sched.max_num_batched_tokens, sched.max_model_len,
            sched.long_prefill_token_threshold) == (False, 4096, 1024, 64)
    assert config.cache_config.block_size == 32


@pytest.mark.parametrize("argv, message", [
    (["serve", "--scheduling-policy", "lifo"], "invalid choice: 'lifo'"),
    (["serve", "--balance-threshold", "half"], "invalid choice: 'half'"),
    (["serve", "--balance-threshold", "seed"], "invalid choice: 'seed'"),  # the old name
    (["serve", "--balance-count-sync", "all-reduce-sum"], "invalid choice: 'all-reduce-sum'"),
    (["serve", "--max-num-seqs", "x"], "invalid int value: 'x'"),
    (["serve", "--simulated-cost", '{"bogus": 1}'],
     "--simulated-cost: expected a JSON object with keys among step_s, prefill_token_s"),
    (["serve", "--simulated-cost", "step_s=1"], "--simulated-cost: not JSON"),
    (["serve", "--simulated-cost", '{"step_s": -1}'], "step_s must be >= 0 seconds"),
    (["serve", "--num-blocks", "8"], "unrecognized arguments: --num-blocks"),
    (["serve", "--data-parallel-multi-port-external-lb"],
     "unrecognized arguments: --data-parallel-multi-port-external-lb"),
    (["generate", "hi", "-dp", "2"], "unrecognized arguments: -dp"),
    (["generate", "hi", "--runner", "simulated"], "unrecognized arguments: --runner"),
])
def test_bad_flags_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["serve", "--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
    (["serve", "--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be in"),
    (["serve", "--balance-scheduling"], "data_parallel_size >= 2"),
    (["serve", "--enable-expert-parallel"],
     "over the data-parallel ranks: --enable-expert-parallel needs --data-parallel-size >= 2"),
    (["serve", "-dp", "2", "--runner", "simulated", "--enable-expert-parallel"],
     "the simulated runner has no experts to shard"),
    (["generate", "hi", "--no-enable-chunked-prefill", "--max-num-batched-tokens", "16"],
     "without chunked prefill"),
])
def test_bad_values_are_config_errors(argv, message):
    with pytest.raises(ValueError, match=message):
        engine_config(argv)


def test_help_groups_the_flags_by_config(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    titles = [out.index(f"\n{title}:\n") for title in ("model", "scheduler", "cache",
                                                      "data parallel")]
    assert titles == sorted(titles)
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in out
    assert "--data-parallel-size DATA_PARALLEL_SIZE, -dp DATA_PARALLEL_SIZE" in out
    assert out.index("\n  --headless ") > titles[-1]


def test_expert_parallel_flag():
    assert engine_config(["serve", "-dp", "2", "--enable-expert-parallel"]) \
        .parallel_config.enable_expert_parallel
    assert not engine_config(["serve", "-dp", "2"]).parallel_config.enable_expert_parallel


SUPPORTED_MOE = ("(supported model types: deepseek_v2, deepseek_v3, mixtral, olmoe, qwen2_moe, "
                 "qwen3_moe)")


@pytest.mark.parametrize("model_type, config_args, dp, message", [
    ("llama", {}, 2,
     "dense model (llama): --enable-expert-parallel needs a mixture-of-experts model "
     + SUPPORTED_MOE),
    # A latent attention minicore does not run: refused before any engine too.
    ("glm4_moe_lite", {"n_routed_experts": 8}, 2,
     "model 'glm4_moe_lite' (?) uses multi-head latent attention (kv_lora_rank / q_lora_rank) "
     "outside deepseek_v2 and deepseek_v3: minicore's paged attention cannot run it"),
    ("phimoe", {"num_local_experts": 4}, 2,
     "expert parallelism does not support 'phimoe' models " + SUPPORTED_MOE),
    ("olmoe", {"num_experts": 4}, 8,
     "expert parallelism over 8 ranks needs at least 8 experts per layer (one per rank); "
     "this olmoe model has 4"),
])
def test_serve_refuses_a_model_expert_parallelism_cannot_serve(tmp_path, model_type,
                                                               config_args, dp, message):
    """From the model's config alone, before any engine starts: `error: ...`, as for a bad value
    (the directory holds nothing else)."""
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, **config_args).save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as e:
        # --port 0: the port is bound before the model is looked at (vLLM's order).
        cli.main(["serve", str(tmp_path), "-dp", str(dp), "--enable-expert-parallel",
                  "--port", "0"])
    assert e.value.code == f"error: {message}"


# ---- vLLM's command lines (issue 15): its flag names and forms, and clear refusals -------------

@pytest.mark.parametrize("value, expected", [
    ("32k", 32000), ("32K", 32768), ("25.6k", 25600), ("1m", 10**6), ("2M", 2 * 2**20),
    ("4096", 4096)])
def test_max_model_len_takes_vllms_human_readable_ints(value, expected):
    config = engine_config(["serve", "--max-model-len", value, "--max-num-batched-tokens", "64k"])
    assert config.scheduler_config.max_model_len == expected
    assert config.scheduler_config.max_num_batched_tokens == 64000


def test_human_readable_int_refuses_decimals_with_binary_suffixes(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--max-model-len", "1.5K"])
    assert e.value.code == 2
    assert "Decimals are not allowed with binary suffixes like K" in capsys.readouterr().err


@pytest.mark.parametrize("dtype, expected", [
    ("float", "float32"), ("half", "float16"), ("bfloat16", "bfloat16")])
def test_vllms_dtype_aliases_resolve_on_cpu(dtype, expected):
    import torch

    from minicore.model.loader import _resolve_dtype

    assert engine_config(["serve", "--dtype", dtype]).model_config.dtype == dtype
    assert _resolve_dtype(dtype, torch.device("cpu")) == getattr(torch, expected)


def test_dtype_auto_resolves_by_the_machine_kind_on_cpu_and_to_bfloat16_on_cuda(cpu_kind):
    import torch

    from minicore.model.loader import _resolve_dtype

    assert engine_config(["serve", "--dtype", "auto"]).model_config.dtype == "auto"
    assert _resolve_dtype("auto", torch.device("cpu")) == getattr(torch, cpu_kind)
    assert _resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_a_bad_dtype_is_refused_at_parse_and_config_time(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--dtype", "int8"])
    assert e.value.code == 2 and "invalid choice: 'int8'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="dtype must be one of auto, half, float16"):
        ModelConfig(dtype="int8")


def test_accepted_no_op_flags_say_so_in_help(capsys):
    config = engine_config(["serve", "--trust-remote-code", "--enforce-eager", "-tp", "1",
                            "-pp", "1", "--generation-config", "vllm", "--enable-sleep-mode"])
    assert config.model_config.trust_remote_code and config.model_config.enforce_eager
    assert config.model_config.enable_sleep_mode
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "never runs a model's own code" in out
    assert "minicore always runs eagerly" in out
    assert "sleep and wake_up always work here" in out
    assert "--tensor-parallel-size TENSOR_PARALLEL_SIZE, -tp TENSOR_PARALLEL_SIZE" in out


@pytest.mark.parametrize("argv, message", [
    (["-tp", "2"], "--tensor-parallel-size 2 is not supported by minicore"),
    (["--pipeline-parallel-size", "4"], "--pipeline-parallel-size 4 is not supported by minicore"),
    (["--generation-config", "/models/x"], "--generation-config '/models/x' must be auto, vllm"),
    (["--chat-template", "/no/such/template.jinja"], "looks like a file path, but it could not"),
    (["Qwen/Qwen3-0.6B"], "minicore loads local models only; no downloads: model "
                          "'Qwen/Qwen3-0.6B' is not a local file or directory"),
    (["--tokenizer", "Qwen/Qwen3-0.6B"], "no downloads: tokenizer 'Qwen/Qwen3-0.6B'"),
])
def test_serve_refuses_what_minicore_cannot_do_before_starting_anything(argv, message):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", *argv])
    assert str(e.value.code).startswith("error: ") and message in e.value.code


@pytest.mark.parametrize("flag, value, message", [
    # A bool is not an integer (true once hung every request), 1.5 not an integer either.
    ("--speculative-config", '{"method": "ngram", "num_speculative_tokens": true}',
     "--speculative-config: num_speculative_tokens must be an integer or null, got true"),
    ("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
     '"prompt_lookup_max": 1.5}', "prompt_lookup_max must be an integer or null, got 1.5"),
    ("--speculative-config", '{"method": "ngram", "num_speculative_tokens": "3"}',
     'num_speculative_tokens must be an integer or null, got "3"'),
    # More drafts than a sequence can hold (1e9 once grew the engine past 3.9 GB at start-up).
    ("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 1000000000}',
     "num_speculative_tokens (1000000000) must be less than max_model_len (2048)"),
    ("--structured-outputs-config", '{"disable_any_whitespace": 1}',
     "disable_any_whitespace must be true or false, got 1"),
    ("--structured-outputs-config", '{"max_grammar_nesting": 0}',
     "max_grammar_nesting must be an integer >= 1"),
    ("--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_both", '
     '"kv_connector_extra_config": []}', "kv_connector_extra_config must be a JSON object"),
])
def test_config_flags_are_type_checked_strictly_naming_the_flag(flag, value, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", flag, value])
    assert message in f"{e.value.code} {capsys.readouterr().err}"


def test_chat_template_is_a_file_or_the_template_itself(tmp_path):
    from minicore.arg_utils import resolve_chat_template

    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(inline)
    assert resolve_chat_template(inline) == inline
    assert resolve_chat_template(str(path)) == inline
    assert engine_config(["serve", "--chat-template", str(path)]).model_config.chat_template \
        == str(path)


def test_hub_id_is_refused_fast_by_a_real_serve_process():
    """The whole command, as a user runs it: no engine, no server import, an answer at once."""
    import subprocess
    import sys
    import time

    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "minicore", "serve", "Qwen/Qwen3-0.6B"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.startswith("error: minicore loads local models only; no downloads")
    assert time.monotonic() - start < 10


# ---- --max-model-len auto (vLLM's -1): the model's context length ---------------------------

@pytest.mark.parametrize("value", ["auto", "AUTO", "-1"])
def test_max_model_len_auto_parses_to_vllms_minus_one(value):
    assert engine_config(["serve", "--max-model-len", value]).scheduler_config.max_model_len == -1


@pytest.mark.parametrize("value", ["0", "-2"])
def test_max_model_len_below_one_other_than_auto_is_refused(value):
    with pytest.raises(ValueError, match="max_model_len must be >= 1"):
        engine_config(["serve", "--max-model-len", value])


@pytest.mark.parametrize("hf_config, tokenizer_config, expected", [
    ({"max_position_embeddings": 8192}, {}, 8192),
    # The smallest of the keys vLLM reads wins.
    ({"max_position_embeddings": 8192, "n_positions": 4096}, {}, 4096),
    ({"n_positions": 1024}, {}, 1024),  # GPT-2
    ({"seq_length": 32768}, {}, 32768),  # ChatGLM
    # The tokenizer's model_max_length caps it (a huge sentinel does not).
    ({"max_position_embeddings": 8192}, {"model_max_length": 2048}, 2048),
    ({"max_position_embeddings": 8192}, {"model_max_length": 1e30}, 8192),
    # A multimodal model's text config.
    ({"text_config": {"max_position_embeddings": 4096}}, {}, 4096),
    # Linear / dynamic RoPE scaling multiply; llama3 and YaRN have it scaled already.
    ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}}, {},
     8192),
    ({"max_position_embeddings": 131072,
      "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, {}, 131072),
    ({"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
      "rope_scaling": {"rope_type": "longrope", "factor": 32.0}}, {}, 4096),
    ({}, {}, 2048),  # no length key: vLLM's default
])
def test_derived_max_model_len_follows_vllms_rule(hf_config, tokenizer_config, expected):
    from minicore.arg_utils import derived_max_model_len

    assert derived_max_model_len(hf_config, tokenizer_config) == expected


def test_serve_resolves_max_model_len_auto_from_the_models_files(tmp_path):
    """Before any engine starts (resolve_model, which the frontend and headless ranks run): auto
    becomes the length in config.json and tokenizer_config.json; a number stays as given."""
    import json

    from minicore.engine.launch import resolve_model

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 3000}))
    serve = ["serve", "--model", str(tmp_path), "--max-model-len"]
    auto = resolve_model(engine_config([*serve, "auto"]))
    assert auto.scheduler_config.max_model_len == 3000
    given = resolve_model(engine_config([*serve, "1k"]))
    assert given.scheduler_config.max_model_len == 1000


# ---- one log format (vLLM's) -----------------------------------------------------------------

def test_log_lines_are_vllms_with_the_process_named_on_every_line():
    import logging
    import re

    from minicore.logger import NewLineFormatter

    formatter = NewLineFormatter("EngineCore_DP1")
    record = logging.LogRecord("minicore.x", logging.WARNING, "/a/b/core.py", 42,
                               "first\nsecond", None, None)
    first, second = formatter.format(record).split("\r\n")
    prefix = r"\(EngineCore_DP1 pid=\d+\) WARNING \d\d-\d\d \d\d:\d\d:\d\d \[core\.py:42\] "
    assert re.fullmatch(prefix + "first", first), first
    assert re.fullmatch(prefix + "second", second), second


def test_uvicorns_loggers_go_through_the_root_handler():
    import logging.config

    from minicore.logger import uvicorn_log_config

    logging.config.dictConfig(uvicorn_log_config("info"))
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        assert logger.handlers == [] and logger.propagate and logger.level == logging.INFO


NGRAM3 = '{"method": "ngram", "num_speculative_tokens": 3}'


@pytest.mark.parametrize("vllms, canonical", [
    (["--max_model_len", "1024", "--max_num_seqs=8"], ["--max-model-len", "1024",
                                                       "--max-num-seqs", "8"]),
    (["--structured-outputs-config.backend", "xgrammar"],
     ["--structured-outputs-config", '{"backend": "xgrammar"}']),
    (["--speculative_config", NGRAM3], ["--speculative-config", NGRAM3]),
    (["--speculative-config.method", "ngram", "--speculative-config.num_speculative_tokens=3"],
     ["--speculative-config", NGRAM3]),
    (["--spec-method", "ngram", "--spec-tokens", "3"], ["--speculative-config", NGRAM3]),
    (["--speculative-config", '{"model": "[ngram]", "num_speculative_tokens": 3}'],
     ["--speculative-config", NGRAM3]),
    (["--speculative-config", '{"model": "ngram", "num_speculative_tokens": 3}'],
     ["--speculative-config", NGRAM3]),
    # Fields one by one join the object given whole.
    (["--speculative-config", '{"method": "ngram"}', "--spec-tokens", "3",
      "--speculative-config.prompt_lookup_max", "4"],
     ["--speculative-config",
      '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}']),
], ids=["underscores", "dotted", "underscored-json", "dotted-fields", "spec-shorthand",
        "ngram-model-bracketed", "ngram-model", "merged"])
def test_vllms_spellings_give_the_canonical_config(vllms, canonical):
    assert engine_config(["serve", *vllms]) == engine_config(["serve", *canonical])


def test_help_shows_the_dashed_spelling_only(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--max-model-len" in out and "--max_model_len" not in out
    # Named in --speculative-config's help (which argparse may wrap at a hyphen).
    assert "--spec-method ngram --spec-tokens 3" in re.sub(r"-\s+", "-", " ".join(out.split()))


def test_a_bad_json_field_value_is_still_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        engine_config(["serve", "--speculative-config", "{not json", "--spec-tokens", "3"])
    assert exit_info.value.code == 2 and "--speculative-config" in capsys.readouterr().err
