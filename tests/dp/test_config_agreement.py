"""The ranks of a DP group agree on their engine fingerprint (minicore/dp/fingerprint.py) or none
of them starts:

- end to end: `serve` (rank 0, --dtype float32) and `serve --headless` (rank 1, --dtype auto on
  a CPU with native bfloat16, played through MINICORE_CPU_FLAGS): both stop as soon as rank 1 has
  joined the group, each with the same one line naming --dtype and both values, both with a
  non-zero exit; nothing of theirs is left running. (Before the check, such a pair started, and
  rank 0 died in the first expert-parallel collective of the first request.)
- a model, a block size, balance scheduling and max_num_seqs that differ, in process: two threads
  join a real 2-rank gloo DP group and run the startup check, as each rank's DPEngineCoreProc
  does; both fail with the same line. A pair that agrees passes.
- the fingerprint itself: what it holds, what it leaves out, the model files' identity, and the
  message for the first difference, whatever the number of ranks.
- ranks that disagree on --data-parallel-size, which no fingerprint can carry (the group forms
  from it): both fail at once in the rendezvous, naming it.
- a headless rank that agrees but fails to start: the frontend stops at once, naming the rank
  and the cause (the engine's FAILED handshake message).
A matching frontend and headless pair still serves: tests/dp/test_dp_server.py.
"""

import contextlib
import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from dp_helpers import free_port, free_port_pair
from safetensors.torch import save_file
from server_helpers import MINICORE, start_minicore

from minicore.config import create_engine_config
from minicore.dp.fingerprint import (
    check_dp_ranks_agree,
    check_same_fingerprint,
    engine_fingerprint,
    weights_identity,
)
from minicore.dp.group import DPGroup
from minicore.engine.launch import resolve_model

# A CPU with native bfloat16 (AVX512-BF16), where --dtype auto is bfloat16.
BF16_CPU_FLAGS = "fpu sse2 avx avx2 fma avx512f avx512bw avx512vl avx512_bf16"
# Both processes start Python, torch and an engine process each on 2 shared cores; the check
# itself takes milliseconds once the group has formed.
STOP_TIMEOUT_S = 120
DTYPE_MISMATCH = "DP ranks disagree on --dtype: rank 0 has float32, rank 1 has bfloat16"


def _tiny_model(path: Path, seed: int = 0) -> str:
    """A model directory as the fingerprint reads it: config.json and one safetensors file (never
    loaded: the check runs before any weight is read)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 8, "transformers_version": "4.57.0"}))
    save_file({"w": torch.randn(4096, generator=torch.Generator().manual_seed(seed))},
              str(path / "model.safetensors"))
    return str(path)


def _config(model: str, **engine_args):
    """A resolved DP config, as each rank has it when it joins the group."""
    engine_args = {"dtype": "float32", "device": "cpu", **engine_args}
    return resolve_model(create_engine_config(model=model, data_parallel_size=2, **engine_args))


# ------------------------------------------------------------------ end to end


def _start(args: list[str], env: dict[str, str] | None = None):
    log = Path(tempfile.mkstemp(prefix="minicore-agreement-", suffix=".log")[1])
    return start_minicore([*MINICORE, "serve", *args], log, env), log


def _left_running(pgid: int, timeout: float = 10.0) -> list[str]:
    """What of process group pgid still runs after timeout (a zombie runs nothing: an orphan
    waits there to be reaped by init)."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for proc in psutil.process_iter(["status", "name"]):
            with contextlib.suppress(OSError, psutil.Error):
                if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                    left.append(f"{proc.pid} {proc.info['name']}")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


@contextlib.contextmanager
def _stopped_pair(server_args: list[str], headless_args: list[str], headless_env=None):
    """A frontend (rank 0) and a headless rank 1, both expected to stop by themselves within
    STOP_TIMEOUT_S: yields their exit statuses and outputs; kills whatever is left after."""
    server, server_log = _start(["--port", str(free_port()), *server_args])
    headless, headless_log = _start(["--headless", "--data-parallel-start-rank", "1",
                                     *headless_args], env=headless_env)
    try:
        server.wait(STOP_TIMEOUT_S)
        headless.wait(STOP_TIMEOUT_S)
        yield ((server.returncode, server_log.read_text()),
               (headless.returncode, headless_log.read_text()))
        # Every engine process went with its launcher (each launcher leads its process group).
        assert _left_running(server.pid) == [] and _left_running(headless.pid) == []
    finally:
        for proc, log in ((server, server_log), (headless, headless_log)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
            log.unlink(missing_ok=True)


def test_a_dtype_mismatch_stops_the_server_and_the_headless_rank_naming_it():
    dp = ["--data-parallel-size", "2", "--data-parallel-size-local", "1",
          "--data-parallel-rpc-port", str(free_port_pair())]
    with _stopped_pair(["--dtype", "float32", *dp], dp,
                       {"MINICORE_CPU_FLAGS": BF16_CPU_FLAGS}) as (server, headless):
        assert server[0] != 0 and headless[0] != 0, (server[1], headless[1])
        for _, out in (server, headless):
            assert out.count(DTYPE_MISMATCH) == 1, out
        assert "minicore: the engine did not start" in server[1]


def test_a_headless_rank_that_fails_to_start_stops_the_frontend_at_once_naming_it():
    """Rank 1 (headless, another machine's) agrees with rank 0 but cannot start (its KV cache
    holds no request): the frontend stops as soon as rank 1 has failed, naming the rank and the
    cause, not at its 300 s start-up timeout."""
    dp = ["--runner", "simulated", "--data-parallel-size", "2", "--data-parallel-size-local", "1",
          "--data-parallel-rpc-port", str(free_port_pair())]
    with _stopped_pair(dp, ["--kv-cache-memory", "1000", *dp]) as (server, headless):
        assert server[0] != 0 and headless[0] != 0, server[1]
        assert ("minicore: the engine did not start: engine core 1 failed to start: "
                "ValueError: the KV cache has room for 0 blocks") in server[1], server[1]


# ------------------------------------------------------------------ in process, on a gloo group


def _check_on_two_ranks(configs) -> list[str | None]:
    """Rank r (a thread each) joins a 2-rank DP group with configs[r] and runs the startup check;
    returns what each raised (None: it passed)."""
    port, raised = free_port(), [None, None]
    both_checked = threading.Barrier(2, timeout=60)

    def rank(r: int) -> None:
        group = DPGroup(r, 2, "127.0.0.1", port, timeout_s=30)
        try:
            check_dp_ranks_agree(configs[r], group.all_gather_json)
        except ValueError as e:
            raised[r] = str(e)
        finally:
            both_checked.wait()  # neither leaves the group while the other still gathers
            group.destroy()

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a rank hung in the check"
    return raised


def test_ranks_on_different_models_both_fail_naming_the_model(tmp_path):
    a, b = _tiny_model(tmp_path / "a", seed=0), _tiny_model(tmp_path / "b", seed=1)
    raised = _check_on_two_ranks([_config(a), _config(b)])
    expected = (f"DP ranks disagree on --model: rank 0 has {a}, rank 1 has {b}; start every "
                "rank with the same engine arguments")
    assert raised == [expected, expected]


@pytest.mark.parametrize("name, flag, values", [
    ("block_size", "--block-size", (16, 32)),
    # Different collectives: a hang once the loop runs.
    ("balance_scheduling", "--balance-scheduling", (True, False)),
    # The balance gate's threshold.
    ("max_num_seqs", "--max-num-seqs", (8, 4)),
], ids=["block-size", "balance-scheduling", "max-num-seqs"])
def test_ranks_that_differ_in_a_setting_both_fail_naming_it(tmp_path, name, flag, values):
    model = _tiny_model(tmp_path / "m")
    raised = _check_on_two_ranks([_config(model, **{name: value}) for value in values])
    expected = f"DP ranks disagree on {flag}: rank 0 has {values[0]}, rank 1 has {values[1]}"
    assert raised[0] == raised[1] and raised[0].startswith(expected), raised


def test_ranks_that_agree_pass_the_check(tmp_path):
    model = _tiny_model(tmp_path / "m")
    # What each rank may choose for itself: its KV cache, how it schedules its own requests.
    configs = [_config(model, kv_cache_memory=1 << 26, enable_prefix_caching=True),
               _config(model, kv_cache_memory=1 << 28, enable_prefix_caching=False,
                       max_num_batched_tokens=4096, seed=7)]
    assert _check_on_two_ranks(configs) == [None, None]


# ------------------------------------------------------------------ the fingerprint


def test_the_fingerprint_holds_the_shared_settings_and_leaves_per_rank_ones_out(tmp_path):
    model = _tiny_model(tmp_path / "m")
    fingerprint = engine_fingerprint(_config(model))
    assert fingerprint["--dtype"] == "float32" and fingerprint["--device"] == "cpu"
    assert fingerprint["--model"] == model and fingerprint["model files"].startswith("sha256:")
    assert {"--runner", "--enable-expert-parallel", "--balance-scheduling", "--balance-threshold",
            "--balance-count-sync", "--max-num-seqs", "--max-model-len", "--block-size",
            "--speculative-config", "--structured-outputs-config", "--kv-transfer-config",
            "--scheduling-policy", "--max-logprobs", "--tokenizer", "--trace-steps"
            } < set(fingerprint)
    assert json.loads(json.dumps(fingerprint)) == fingerprint  # plain values: it travels as JSON
    per_rank = _config(model, kv_cache_memory=1 << 20, gpu_memory_utilization=0.5, seed=3,
                       max_num_batched_tokens=1024, enable_chunked_prefill=True,
                       async_scheduling=False, chat_template="{{ messages }}")
    assert engine_fingerprint(per_rank) == fingerprint
    # auto is the one structured-output backend, xgrammar, by either name.
    named = _config(model, structured_outputs_config={"backend": "xgrammar"})
    assert engine_fingerprint(named) == fingerprint


def test_dtype_auto_is_compared_as_it_resolves_on_each_machine(tmp_path, monkeypatch):
    from minicore.model import loader

    model = _tiny_model(tmp_path / "m")
    monkeypatch.setenv("MINICORE_CPU_FLAGS", BF16_CPU_FLAGS)
    loader.cpu_flags.cache_clear()
    loader.resolve_auto_dtype.cache_clear()
    try:
        auto = engine_fingerprint(_config(model, dtype="auto"))
    finally:
        loader.cpu_flags.cache_clear()
        loader.resolve_auto_dtype.cache_clear()
    assert auto["--dtype"] == "bfloat16"
    assert auto == engine_fingerprint(_config(model, dtype="bfloat16"))


def test_the_model_files_identity_is_their_content_not_their_place_or_time(tmp_path):
    a = _tiny_model(tmp_path / "a")
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("config.json", "model.safetensors"):
        (copy / name).write_bytes((Path(a) / name).read_bytes())
    os.utime(copy / "model.safetensors", (0, 0))
    # Saved by another transformers: the same model.
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "transformers_version": "5.0.0"}))
    assert weights_identity(str(copy)) == weights_identity(a)
    # A fine-tune: the same header and size, other bytes.
    tuned = _tiny_model(tmp_path / "tuned", seed=1)
    assert (Path(tuned) / "model.safetensors").stat().st_size == \
        (Path(a) / "model.safetensors").stat().st_size
    assert weights_identity(tuned) != weights_identity(a)
    # Another config, the same weights.
    (copy / "config.json").write_text(json.dumps({**config, "hidden_size": 16}))
    assert weights_identity(str(copy)) != weights_identity(a)


def test_the_first_difference_from_rank_0_is_named_with_both_values():
    base = {"--runner": "transformers", "--dtype": "float32", "--block-size": 16,
            "--speculative-config": None}
    check_same_fingerprint([base, dict(base), dict(base)])  # agreement: nothing raised
    with pytest.raises(ValueError) as e:
        check_same_fingerprint([base, dict(base), {**base, "--block-size": 32, "--dtype": "half"}])
    assert str(e.value) == ("DP ranks disagree on --dtype: rank 0 has float32, rank 2 has half; "
                            "start every rank with the same engine arguments")
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match=r'--speculative-config: rank 0 has unset \(the default\), '
                                         r'rank 1 has {"method": "ngram", '
                                         r'"num_speculative_tokens": 3}'):
        check_same_fingerprint([base, {**base, "--speculative-config": spec}])
    # A runner without weights has no --dtype: the runner is what is named.
    simulated = {"--runner": "simulated", "--block-size": 16, "--speculative-config": None}
    with pytest.raises(ValueError, match="on --runner: rank 0 has transformers, rank 1 has "
                                         "simulated"):
        check_same_fingerprint([base, simulated])



def test_ranks_that_disagree_on_the_group_size_both_fail_at_once_naming_it():
    """Not a fingerprint's field, as the group forms from it: compared in the rendezvous store
    before gloo's setup, which would wait for a rank 2 that never comes until its timeout."""
    port, raised = free_port(), {}

    def rank(r: int, size: int) -> None:
        try:
            DPGroup(r, size, "127.0.0.1", port, timeout_s=30).destroy()
        except ValueError as e:
            raised[r] = str(e)

    threads = [threading.Thread(target=rank, args=(r, size), daemon=True)
               for r, size in ((0, 2), (1, 3))]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a rank hung"
    assert time.monotonic() - start < 10
    line = ("DP ranks disagree on --data-parallel-size: rank 0 has 2, rank 1 has 3; start every "
            "rank with the same engine arguments")
    assert raised == {0: line, 1: line}
