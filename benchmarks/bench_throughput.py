"""Offline throughput side by side in one run: minicore LLM.generate vs transformers model.generate.

Workloads (greedy, EOS ignored, same model and dtype for both engines):
  uniform  64 prompts of 128 random token ids, 128 output tokens each
  varied   64 prompts, input and output lengths drawn from 16..256 (seeded)
transformers runs each workload as one left-padded batch with max_new_tokens set to the longest
requested output, so padding and sequences that are done but still batched cost it time; only
requested output tokens are counted for either engine. transformers runs in a fresh process of
its own, with torch's defaults, as its users run it.

Roofline: the workload's matmul FLOPs (every linear layer for every token fed, attention scores
and values over each token's context, the LM head for each sampled token), over the fp32 (or
--dtype) matmul rate this script measures on the model's own layer shapes. Load time is that of
the weights plus the engine (KV cache allocation included). --gather also runs minicore with decode
attention gathering each sequence's KV blocks every step (the path before per-request KV rows,
minicore/model/decode_kv.py), side by side; --torch-kernels also runs it with its C kernels off
(minicore/model/native.py: decode attention and linear layers on torch only). --vllm also runs
vLLM's CPU build on the same workload, in its own virtualenv (benchmarks/vllm_side.py), with its
default dtype (bfloat16 on every x86 CPU; --vllm-dtype to choose); minicore and transformers run
with --dtype (default: minicore's auto). minicore runs with its defaults (batch invariance on
CPU); --no-batch-invariant also runs it with --no-batch-invariant, on its own engine. The workload
batch1 is single-stream decode: its prompts
(128 random ids, 128 output tokens) one at a time, reported as milliseconds per output token too.
The CPU's model and bfloat16 flags are printed.

    python benchmarks/bench_throughput.py [--workloads uniform varied batch1] [--num-prompts 64] \
        [--device cpu] [--dtype auto] [--gather] [--torch-kernels] [--no-batch-invariant] [--vllm]
"""

import argparse
import json
import multiprocessing
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import cpu_description  # noqa: E402
from vllm_side import run_vllm  # noqa: E402

from minicore.llm import LLM  # noqa: E402
from minicore.model.attention import GATHERED_DECODE, attn_implementation  # noqa: E402
from minicore.model.cpu_linear import use_cpu_linear  # noqa: E402
from minicore.model.decode_kv import DecodeKVBuffers  # noqa: E402
from minicore.model.loader import load_model, resolve_model_dir  # noqa: E402
from minicore.sampling_params import SamplingParams  # noqa: E402


def make_workload(name: str, n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    if name in ("uniform", "batch1"):
        lengths = [(128, 128)] * (n if name == "uniform" else 4)
    else:
        lengths = [(rng.randint(16, 256), rng.randint(16, 256)) for _ in range(n)]
    # Token ids away from the special tokens at the start of the vocabulary.
    return [([rng.randrange(100, vocab) for _ in range(i)], o) for i, o in lengths]


def matmul_flops(cfg, work: list[tuple[list[int], int]]) -> float:
    hidden, layers = cfg.hidden_size, cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    per_token_linear = 2 * layers * (hidden * (q + 2 * kv) + q * hidden
                                     + 3 * hidden * cfg.intermediate_size)
    total = 0.0
    for prompt, out in work:
        fed = len(prompt) + out - 1  # the last sampled token is never fed back
        context = fed * (fed + 1) / 2  # sum over fed tokens of the positions each attends to
        total += fed * per_token_linear + 4 * layers * q * context
        total += out * 2 * hidden * cfg.vocab_size
    return total


def measure_matmul_rate(cfg, dtype, device) -> float:
    """Best FLOP/s over the model's linear shapes at a decode-sized and a prefill-sized M."""
    hidden = cfg.hidden_size
    shapes = [(hidden, cfg.intermediate_size), (cfg.intermediate_size, hidden), (hidden, hidden)]
    best = 0.0
    for m in (64, 512):
        for k, n in shapes:
            a = torch.randn(m, k, dtype=dtype, device=device)
            b = torch.randn(k, n, dtype=dtype, device=device)
            for _ in range(3):
                a @ b
            reps = 50
            _sync(device)
            start = time.perf_counter()
            for _ in range(reps):
                a @ b
            _sync(device)
            best = max(best, 2 * m * k * n * reps / (time.perf_counter() - start))
    return best


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_minicore(llm: LLM, work, one_at_a_time: bool = False) -> float:
    batches = [[w] for w in work] if one_at_a_time else [work]
    start = time.perf_counter()
    for batch in batches:
        params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in batch]
        outs = llm.generate([p for p, _ in batch], params, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [o for _, o in batch]
    return time.perf_counter() - start


def run_transformers(work, dtype, device, one_at_a_time: bool = False) -> float:
    """transformers' batched generate on its own load of the model, in the process this runs in
    (a fresh one: see main)."""
    model, tokenizer = load_model(dtype=dtype, device=device)
    with torch.inference_mode(), attn_implementation(model, "sdpa"):
        _generate(model, tokenizer, [(p, 2) for p, _ in work[:4]], model.device)  # warm-up
        batches = [[w] for w in work] if one_at_a_time else [work]
        return sum(_generate(model, tokenizer, batch, model.device) for batch in batches)


def _generate(model, tokenizer, work, device) -> float:
    width = max(len(p) for p, _ in work)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in work], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in work], device=device)
    longest = max(o for _, o in work)
    _sync(device)
    start = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                   min_new_tokens=longest, do_sample=False, pad_token_id=pad)
    _sync(device)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=["uniform", "varied"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="auto",
                    help="minicore's and transformers' (default: auto, minicore's choice)")
    ap.add_argument("--gather", action="store_true",
                    help="also time minicore with the gather decode attention")
    ap.add_argument("--torch-kernels", action="store_true",
                    help="also time minicore with its C kernels off (CPU)")
    ap.add_argument("--no-batch-invariant", action="store_true",
                    help="also time minicore with --no-batch-invariant (its own engine)")
    ap.add_argument("--vllm", action="store_true",
                    help="also time vLLM's CPU build (benchmarks/vllm_differential.py --setup)")
    ap.add_argument("--vllm-dtype", default=None, help="vLLM's --dtype (default: its auto)")
    ap.add_argument("--json",
                    default=str(Path(__file__).parent / "results" / "bench_throughput.json"))
    args = ap.parse_args()

    start = time.perf_counter()
    model, tokenizer = load_model(dtype=args.dtype, device=args.device)
    device, dtype, cfg = model.device, model.dtype, model.config
    llm = LLM(model, tokenizer=tokenizer, max_model_len=1024, max_num_seqs=256)
    load_s = time.perf_counter() - start
    runner = llm.llm_engine.model_runner
    # transformers runs in a fresh process, as its users run it: minicore's runner changes its
    # process (its CPU linear layers, minicore/model/cpu_linear.py; the allocator,
    # minicore/model/cpu_memory.py, which makes transformers faster too).
    reference = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    rate = measure_matmul_rate(cfg, dtype, device)
    plain = (LLM(dtype=args.dtype, device=args.device, max_model_len=1024, max_num_seqs=256,
                 batch_invariant=False) if args.no_batch_invariant else None)
    rows = []
    for name in args.workloads:
        work = make_workload(name, args.num_prompts, cfg.vocab_size)
        num_out, single = sum(o for _, o in work), name == "batch1"
        run_minicore(llm, work[:4])  # warm-up
        t_mini = run_minicore(llm, work, single)
        gather_tok_s = torch_tok_s = plain_tok_s = vllm = None
        if plain is not None:
            run_minicore(plain, work[:4])  # warm-up, as above
            plain_tok_s = num_out / run_minicore(plain, work, single)
        # Other prompts of the same lengths: the first run's are in the prefix cache.
        other = make_workload(name, args.num_prompts, cfg.vocab_size, seed=1)
        # The runner chose its decode path once; each variant swaps in another and back.
        decode_attention = runner.decode_attention
        if args.gather:
            runner.decode_attention = GATHERED_DECODE
            gather_tok_s = sum(o for _, o in other) / run_minicore(llm, other)
            runner.decode_attention = decode_attention
        if args.torch_kernels and isinstance(decode_attention, DecodeKVBuffers):
            runner.decode_attention = DecodeKVBuffers(runner.kv_caches)
            use_cpu_linear(model)
            third = make_workload(name, args.num_prompts, cfg.vocab_size, seed=2)
            torch_tok_s = sum(o for _, o in third) / run_minicore(llm, third)
            runner.decode_attention = decode_attention
            use_cpu_linear(model, decode_attention.kernel)
        t_hf = reference.submit(run_transformers, work, dtype, args.device, single).result()
        if args.vllm:
            vllm = run_vllm(resolve_model_dir(), work, args.vllm_dtype, one_at_a_time=single)
        flops = matmul_flops(cfg, work)
        rows.append({"workload": name, "num_prompts": len(work), "output_tokens": num_out,
                     "minicore_s": t_mini, "transformers_s": t_hf, "gather_tok_s": gather_tok_s,
                     "torch_kernels_tok_s": torch_tok_s, "no_batch_invariant_tok_s": plain_tok_s,
                     "batch_invariant": llm.llm_engine.config.model_config.batch_invariant,
                     "vllm": vllm,
                     "vllm_tok_s": vllm and num_out / vllm["seconds"],
                     "minicore_tok_s": num_out / t_mini, "transformers_tok_s": num_out / t_hf,
                     "speedup": t_hf / t_mini, "roofline_fraction": flops / t_mini / rate})
    print(f"CPU: {cpu_description()}")
    print(f"device {device}, {dtype}, batch invariant "
          f"{llm.llm_engine.config.model_config.batch_invariant}, torch threads "
          f"{torch.get_num_threads()}, "
          f"measured matmul rate {rate / 1e9:.1f} GFLOP/s, load {load_s:.1f} s")
    print(f"{'workload':10} {'out tokens':>10} {'minicore tok/s':>15} {'transformers tok/s':>19} "
          f"{'ratio':>6} {'roofline':>9}")
    for r in rows:
        print(f"{r['workload']:10} {r['output_tokens']:>10} {r['minicore_tok_s']:>15.1f} "
              f"{r['transformers_tok_s']:>19.1f} {r['speedup']:>6.2f} "
              f"{r['roofline_fraction']:>8.0%}"
              + (f"  gather: {r['gather_tok_s']:.1f} tok/s" if r["gather_tok_s"] else "")
              + (f"  torch kernels: {r['torch_kernels_tok_s']:.1f} tok/s"
                 if r["torch_kernels_tok_s"] else "")
              + (f"  --no-batch-invariant: {r['no_batch_invariant_tok_s']:.1f} tok/s"
                 if r["no_batch_invariant_tok_s"] else "")
              + (f"  ms/token: {1e3 / r['minicore_tok_s']:.1f}"
                 + (f", --no-batch-invariant {1e3 / r['no_batch_invariant_tok_s']:.1f}"
                    if r["no_batch_invariant_tok_s"] else "") if r["workload"] == "batch1" else "")
              + (f"  vLLM ({r['vllm']['dtype']}): {r['vllm_tok_s']:.1f} tok/s, minicore / vLLM "
                 f"{r['minicore_tok_s'] / r['vllm_tok_s']:.2f}x" if r["vllm"] else ""))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"cpu": cpu_description(), "device": str(device),
                                           "dtype": str(dtype),
                                           "threads": torch.get_num_threads(), "load_s": load_s,
                                           "matmul_flops_per_s": rate, "results": rows}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
