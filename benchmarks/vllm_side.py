"""vLLM's CPU build as the other side of a benchmark: a workload run by ``vllm.LLM`` in vLLM's
own virtualenv (``benchmarks/vllm_differential.py --setup`` makes it), in a fresh process, with
vLLM's defaults (``--dtype auto``: bfloat16 on every x86 CPU) unless a dtype is given.

The child gets the workload as JSON on stdin and prints one JSON line: the dtype vLLM resolved,
its load time and the seconds of the timed ``generate`` (after a short warm-up), of the whole
workload at once or of its requests one at a time. minicore never
imports vLLM; only this child process does.
"""

import json
import os
import subprocess
from pathlib import Path

from vllm_differential import DEFAULT_VENV

VENV = Path(os.environ.get("MINICORE_VLLM_VENV", str(DEFAULT_VENV)))

CHILD = r"""
import json, sys, time
spec = json.load(sys.stdin)
start = time.perf_counter()
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
          seed=0, max_num_seqs=spec["max_num_seqs"], kv_cache_memory_bytes=spec["kv_bytes"])
load_s = time.perf_counter() - start
work = spec["work"]
prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in work]
params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in work]
llm.generate(prompts[:4], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
batches = [[i] for i in range(len(work))] if spec["one_at_a_time"] else [range(len(work))]
start = time.perf_counter()
outs = [o for b in batches
        for o in llm.generate([prompts[i] for i in b], [params[i] for i in b], use_tqdm=False)]
elapsed = time.perf_counter() - start
assert [len(o.outputs[0].token_ids) for o in outs] == [o for _, o in work]
dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
print("VLLM_RESULT " + json.dumps({"dtype": dtype, "load_s": load_s, "seconds": elapsed}))
"""


def run_vllm(model_dir: Path, work: list[tuple[list[int], int]], dtype: str | None = None,
             max_model_len: int = 1024, max_num_seqs: int = 256, kv_bytes: int = 1 << 30,
             one_at_a_time: bool = False) -> dict:
    """vLLM's time for ``work`` ((prompt ids, output tokens) pairs, greedy, EOS ignored), with a
    KV cache of ``kv_bytes`` (minicore's CPU default: vLLM's own default reserves a fraction of
    the machine's memory and refuses to start when other processes hold it)."""
    python = VENV / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no vLLM virtualenv at {VENV}: run "
                         "`.venv/bin/python benchmarks/vllm_differential.py --setup` first")
    spec = {"model": str(model_dir), "dtype": dtype or "auto", "work": work,
            "max_model_len": max_model_len, "max_num_seqs": max_num_seqs, "kv_bytes": kv_bytes,
            "one_at_a_time": one_at_a_time}
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run([str(python), "-c", CHILD], input=json.dumps(spec), env=env,
                          capture_output=True, text=True)
    line = next((line for line in done.stdout.splitlines() if line.startswith("VLLM_RESULT ")),
                None)
    if done.returncode or line is None:
        raise RuntimeError(f"vLLM failed (exit {done.returncode}):\n{done.stderr[-12000:]}")
    return json.loads(line.removeprefix("VLLM_RESULT "))
