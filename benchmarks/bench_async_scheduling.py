"""Async scheduling on against off, side by side in one run: step period, offline, served.

Parts (--parts, default: period model):
  period  the SIMULATED runner (no model: a forward sleeps --step-ms, 2 and 20 by default) in an
          in-process EngineCore driven by its step_fn, at --running 32 / 256 / 1024 requests, all
          decoding (8-token prompts, EOS ignored): once every request is prefilled and the batch
          queue is full, --steps decode steps are timed, the best of --repeat runs of each side
          (order alternated). Reported per forward length and running count, in ms: the
          forward's measured time off ("fwd off") and its CPU time (the runner's Python work,
          inside the sleep), the CPU work per step (period off - fwd off: schedule(),
          update_from_output() and the engine's own bookkeeping), the step period off and on (wall
          time / steps that ran the model), the forward's time on ("fwd on"), and period on over
          the ideal, max(fwd off, CPU work) (1.0: async hides the CPU work behind the forward
          instead of adding it to it), and over the GIL's bound, max(fwd off, CPU work + fwd CPU):
          the forward thread's Python work and the scheduler's share one GIL.
  model   the default model (SmolLM2-135M, float32, CPU), loaded once, through LLM.generate: 64
          prompts of 128 random token ids, 128 greedy tokens, EOS ignored (bench_throughput.py's
          uniform workload); output tok/s off and on after an untimed warm-up of each, in
          alternating order --repeat times (other prompts each time: the prefix cache stays cold).
  served  `python -m minicore serve --no-async-scheduling`, then `--async-scheduling` (the order
          alternates with --repeat): benchmarks/bench_serve.py at --max-concurrency 16, 64 random
          prompts of 128 tokens, 128 output tokens, EOS ignored; output tok/s.
period and model also check that every request's tokens are equal off and on. The CPU model and
flags are printed; results go to benchmarks/results/bench_async_scheduling.json. With
--speculative-config both sides of model and served verify drafts (with async scheduling on, the
runner proposes them as it samples).

    python benchmarks/bench_async_scheduling.py [--parts period model served] [--step-ms 2 20] \
        [--steps 50] [--repeat 2] [--quick]    # quick: 20 steps, 16 prompts
"""

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_disagg import Processes, run_bench  # noqa: E402
from bench_throughput import make_workload  # noqa: E402
from machine import cpu_description  # noqa: E402

from minicore.config import create_engine_config  # noqa: E402
from minicore.engine.components import make_engine_core
from minicore.engine.core import EngineCore  # noqa: E402
from minicore.model.config import SimulatedCost  # noqa: E402
from minicore.model.simulated import NOMINAL_KV_BYTES_PER_TOKEN  # noqa: E402
from minicore.request import Request  # noqa: E402
from minicore.sampling_params import SamplingParams  # noqa: E402

MODES = {"off": False, "on": True}
PROMPT_LEN, BLOCK_SIZE, WARM_STEPS = 8, 16, 4


# ---- period: the simulated runner ----------------------------------------------------------------

def simulated_engine(num_requests: int, max_tokens: int, step_s: float, on: bool) -> EngineCore:
    # The simulated runner only counts blocks: size the cache for every request's whole length,
    # so nothing is ever preempted, and the batch for one step's prefill of them all.
    blocks = num_requests * (-(-(PROMPT_LEN + max_tokens) // BLOCK_SIZE) + 1) + 8
    return make_engine_core(create_engine_config(
        runner="simulated", simulated_cost=SimulatedCost(step_s=step_s), async_scheduling=on,
        max_num_seqs=num_requests, max_num_batched_tokens=max(8192, num_requests * PROMPT_LEN),
        max_model_len=PROMPT_LEN + max_tokens,
        block_size=BLOCK_SIZE, kv_cache_memory=blocks * BLOCK_SIZE * NOMINAL_KV_BYTES_PER_TOKEN))


def time_forwards(engine: EngineCore) -> list[tuple[float, float]]:
    """Wrap the engine's forward (looked up at each call, on either thread) to time it: (wall,
    CPU) seconds of each, CPU being the runner's own Python work, which holds the GIL."""
    seconds, forward = [], engine.execute_model

    def timed(scheduler_output):
        start, start_cpu = time.perf_counter(), time.thread_time()
        output = forward(scheduler_output)
        seconds.append((time.perf_counter() - start, time.thread_time() - start_cpu))
        return output

    engine.execute_model = timed
    return seconds


def step(engine: EngineCore, tokens: dict[str, list[int]]) -> bool:
    outputs, executed = engine.step_fn()
    for output in outputs:
        tokens[output.request_id] += output.new_token_ids
    return executed


def run_period(num_requests: int, steps: int, step_s: float, on: bool) -> dict:
    max_tokens = WARM_STEPS + steps + 4
    engine = simulated_engine(num_requests, max_tokens, step_s, on)
    rng = random.Random(num_requests)
    tokens: dict[str, list[int]] = {}
    for i in range(num_requests):
        tokens[f"r{i}"] = []
        engine.add_request(Request(f"r{i}", [rng.randrange(100, 40000) for _ in range(PROMPT_LEN)],
                                   SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                   eos_token_id=2))
    for _ in range(WARM_STEPS):  # one step prefills them all; then the batch queue fills
        step(engine, tokens)
    assert len(engine.scheduler.running) == num_requests, "not all requests are running"
    forwards = time_forwards(engine)
    start = time.perf_counter()
    ran = sum(step(engine, tokens) for _ in range(steps))
    elapsed = time.perf_counter() - start
    timed = list(forwards)  # the timed steps' forwards, not the drain's
    while engine.scheduler.has_requests() or engine.batch_queue.has_pending():
        step(engine, tokens)
    engine.shutdown()
    return {"period_s": elapsed / ran, "forward_s": sum(w for w, _ in timed) / len(timed),
            "forward_cpu_s": sum(c for _, c in timed) / len(timed), "tokens": tokens}


def period_row(num_requests: int, steps: int, step_s: float, repeat: int) -> dict:
    runs = {mode: [] for mode in MODES}
    for r in range(repeat):
        for mode in (list(MODES) if r % 2 == 0 else list(reversed(MODES))):
            runs[mode].append(run_period(num_requests, steps, step_s, MODES[mode]))
    # The best run of each side: another process taking a core for a while (or a long GC pause)
    # only ever adds to a period.
    off, on = (min(runs[mode], key=lambda run: run["period_s"]) for mode in MODES)
    reference = runs["off"][0]["tokens"]
    cpu_s = max(off["period_s"] - off["forward_s"], 0.0)
    # Two threads of one process share the GIL: the runner's Python work cannot overlap the
    # scheduler's, so the best async can do is max(forward, CPU work + the forward's CPU).
    gil_bound_s = max(off["forward_s"], cpu_s + off["forward_cpu_s"])
    return {"running": num_requests, "steps": steps, "step_s": step_s,
            "period_off_s": off["period_s"], "period_on_s": on["period_s"],
            "forward_off_s": off["forward_s"], "forward_on_s": on["forward_s"],
            "forward_cpu_s": off["forward_cpu_s"], "cpu_work_s": cpu_s,
            "on_over_ideal": on["period_s"] / max(off["forward_s"], cpu_s),
            "on_over_gil_bound": on["period_s"] / gil_bound_s,
            "tokens_equal": all(run["tokens"] == reference for mode in MODES
                                for run in runs[mode])}


def print_period(rows: list[dict]) -> None:
    print(f"{'forward':>7} {'running':>7} {'fwd off':>7} {'fwd CPU':>7} {'CPU work':>8} "
          f"{'period off':>10} {'period on':>9} {'fwd on':>7} {'on/ideal':>8} {'on/GIL':>6} "
          f"{'on/off':>6} {'equal':>5}   (ms)")
    for r in rows:
        ms = [1000 * r[k] for k in ("step_s", "forward_off_s", "forward_cpu_s", "cpu_work_s",
                                    "period_off_s", "period_on_s", "forward_on_s")]
        print(f"{ms[0]:>7g} {r['running']:>7} {ms[1]:>7.2f} {ms[2]:>7.2f} {ms[3]:>8.2f} "
              f"{ms[4]:>10.2f} {ms[5]:>9.2f} {ms[6]:>7.2f} {r['on_over_ideal']:>8.2f} "
              f"{r['on_over_gil_bound']:>6.2f} {r['period_on_s'] / r['period_off_s']:>6.2f} "
              f"{'yes' if r['tokens_equal'] else 'NO':>5}")


# ---- model: SmolLM2 through LLM.generate ---------------------------------------------------------

def generate(llm, work) -> tuple[float, list[list[int]]]:
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in work]
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in work], params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]


def model_part(args) -> dict:
    from minicore.llm import LLM
    from minicore.model.loader import load_model

    model, tokenizer = load_model(dtype="float32", device="cpu")
    # One loaded model for both engines: each runner swaps in the same paged attention and
    # linear layers, and the KV cache is each runner's own.
    spec = json.loads(args.speculative_config) if args.speculative_config else None
    llms = {mode: LLM(model, tokenizer=tokenizer, async_scheduling=on, max_model_len=1024,
                      max_num_seqs=args.num_prompts, speculative_config=spec)
            for mode, on in MODES.items()}
    vocab = model.config.vocab_size
    for llm in llms.values():  # first allocations and kernel setup: untimed
        generate(llm, [(p, 16) for p, _ in make_workload("uniform", 4, vocab, seed=99)])
    seconds, equal = dict.fromkeys(MODES, 0.0), True
    for r in range(args.repeat):
        work = make_workload("uniform", args.num_prompts, vocab, seed=r)
        order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
        got = {}
        for mode in order:
            elapsed, got[mode] = generate(llms[mode], work)
            seconds[mode] += elapsed
        equal &= got["off"] == got["on"]
    num_out = args.repeat * sum(o for _, o in work)
    return {"num_prompts": args.num_prompts, "input_len": 128, "output_len": 128,
            "repeat": args.repeat, **{f"tok_s_{m}": num_out / seconds[m] for m in MODES},
            "greedy_equal": equal}


# ---- served: python -m minicore serve + bench_serve.py -------------------------------------------

def served_part(args) -> dict:
    bench_args = ["--max-concurrency", "16", "--num-prompts", str(args.num_prompts),
                  "--random-input-len", "128", "--random-output-len", "128"]
    tok_s = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as result_dir:
        for r in range(args.repeat):
            for mode in (list(MODES) if r % 2 == 0 else list(reversed(MODES))):
                procs = Processes()
                try:
                    spec = (["--speculative-config", args.speculative_config]
                            if args.speculative_config else [])
                    url = procs.start("serve", "--async-scheduling" if MODES[mode]
                                      else "--no-async-scheduling", *spec)
                    procs.wait_healthy(url)
                    result = run_bench(url, mode, bench_args, Path(result_dir))
                finally:
                    procs.stop()
                tok_s[mode].append(result["output_throughput"])
    # Each run's figure too: a drifting machine shows as runs of one side that disagree.
    return {"max_concurrency": 16, "num_prompts": args.num_prompts, "input_len": 128,
            "output_len": 128, **{f"tok_s_{m}": sum(v) / len(v) for m, v in tok_s.items()},
            "runs_tok_s": tok_s}


def print_throughput(name: str, r: dict) -> None:
    equal = r.get("greedy_equal")
    print(f"{name:6} {r['num_prompts']:>7} {r['tok_s_off']:>12.1f} {r['tok_s_on']:>11.1f} "
          f"{r['tok_s_on'] / r['tok_s_off']:>6.2f}"
          + ("" if equal is None else f" {'yes' if equal else 'NO':>5}"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", choices=["period", "model", "served"],
                    default=["period", "model"])
    ap.add_argument("--step-ms", type=float, nargs="+", default=[2.0, 20.0],
                    help="period: the forward's lengths (2: about the CPU work at 1024 running)")
    ap.add_argument("--running", type=int, nargs="+", default=[32, 256, 1024])
    ap.add_argument("--steps", type=int, default=None, help="period: timed steps (50; quick 20)")
    ap.add_argument("--num-prompts", type=int, default=None, help="model, served (64; quick 16)")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each side, order alternated")
    ap.add_argument("--quick", action="store_true", help="fewer steps and prompts")
    ap.add_argument("--speculative-config", default=None,
                    help='model, served: both sides verify drafts, e.g. \'{"method": "ngram", '
                         '"num_speculative_tokens": 3}\' (with async scheduling the runner '
                         'proposes them)')
    ap.add_argument("--json",
                    default=str(Path(__file__).parent / "results" / "bench_async_scheduling.json"))
    args = ap.parse_args()
    args.steps = args.steps or (20 if args.quick else 50)
    args.num_prompts = args.num_prompts or (16 if args.quick else 64)

    result = {"cpu": cpu_description(), "args": vars(args)}
    if "period" in args.parts:
        result["period"] = [period_row(n, args.steps, ms / 1000, args.repeat)
                            for ms in args.step_ms for n in args.running]
    if "model" in args.parts:
        result["model"] = model_part(args)
    if "served" in args.parts:
        result["served"] = served_part(args)

    print(f"CPU: {result['cpu']}; torch threads {torch.get_num_threads()}")
    if "period" in result:
        print(f"period: SIMULATED runner, {args.steps} decode steps timed")
        print_period(result["period"])
    if {"model", "served"} & set(result):
        print(f"{'part':6} {'prompts':>7} {'off tok/s':>12} {'on tok/s':>11} {'on/off':>6} "
              f"{'equal':>5}")
        for name in ("model", "served"):
            if name in result:
                print_throughput(name, result[name])
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
