"""Multi-head latent attention against multi-head attention: decode tokens/s and KV bytes per token
of a small random DeepSeek-V3 (MLA, DeepSeek's MoE) and a same-size MHA mixture of experts, side
by side in one run of minicore's LLM.

The MHA model is a Qwen2-MoE with the DeepSeek model's hidden size, layers, heads, dense first
layer, routed experts, top-k, expert width and a shared expert of that width; each head keeps a key
and a value of DeepSeek's query-key width (qk_nope_head_dim + qk_rope_head_dim). Per dtype and
batch-invariance mode both engines are built; each context's prompts are prefilled once (prefix
caching keeps them), then the engines alternate --repeat runs of --output-tokens greedy tokens at
each batch size. Only engine steps that are all decodes are timed; the median step over the runs
is reported. KV bytes per token: from the runner's caches and the formula, the tokens minicore's
default 1 GiB of CPU KV cache holds, and DeepSeek-V3's published config against the same model as
MHA. Left out: prefill speed, CUDA, trained weights (the text is noise), expert parallelism.

    python benchmarks/bench_mla.py [--batches 1 4 16] [--contexts 256 2048] [--repeat 3] \
        [--dtypes float32 bfloat16] [--threads N]
"""

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import cpu_description  # noqa: E402

from minicore.llm import LLM  # noqa: E402
from minicore.model.kv_cache_interface import kv_cache_spec  # noqa: E402
from minicore.model.loader import load_tokenizer, resolve_model_dir  # noqa: E402
from minicore.sampling_params import SamplingParams  # noqa: E402

_COMMON = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=8, moe_intermediate_size=128,
               num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=4096,
               bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
# DeepSeek-V3's proportions, scaled down: v_head_dim = qk_nope_head_dim = 2 * qk_rope_head_dim,
# kv_lora_rank = 4 * v_head_dim, q_lora_rank = 3 * kv_lora_rank, first layer dense, grouped
# sigmoid routing with a shared expert.
MLA_MODEL = ("deepseek_v3", dict(
    _COMMON, q_lora_rank=384, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
    v_head_dim=32, n_routed_experts=16, n_shared_experts=1, n_group=4, topk_group=2,
    first_k_dense_replace=1, routed_scaling_factor=2.5))
MHA_MODEL = ("qwen2_moe", dict(
    _COMMON, head_dim=48, qkv_bias=False, num_experts=16, shared_expert_intermediate_size=128,
    mlp_only_layers=[0]))
# DeepSeek-V3's published config (huggingface.co/deepseek-ai/DeepSeek-V3, config.json).
DEEPSEEK_V3 = dict(num_hidden_layers=61, num_attention_heads=128, kv_lora_rank=512,
                   qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
DEFAULT_KV_MEMORY = 1 << 30  # minicore's --kv-cache-memory on CPU
BLOCK = 16


def build(family: str, settings: dict, path: Path, tokenizer) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **settings),
                                             dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def decode_timer(llm: LLM) -> list[tuple[float, int]]:
    """Wrap the engine's step: each step whose scheduled tokens are all decodes (one a request)
    appends (seconds, tokens) to the list returned."""
    engine, record = llm.llm_engine, []
    schedule, step = engine.scheduler.schedule, engine.step_fn
    last = {}

    def scheduling():
        last["out"] = out = schedule()
        return out

    def stepping():
        start = time.perf_counter()
        result = step()
        out = last.pop("out", None)
        if out is not None and out.num_scheduled_tokens and (
                out.total_num_scheduled_tokens == len(out.num_scheduled_tokens)):
            record.append((time.perf_counter() - start, out.total_num_scheduled_tokens))
        return result

    engine.scheduler.schedule, engine.step_fn = scheduling, stepping
    return record


def decode_steps(llm: LLM, record: list, prompts: list[list[int]], out_tokens: int) -> list:
    """One timed run: (seconds, tokens) of each of its all-decode steps."""
    record.clear()
    params = SamplingParams(max_tokens=out_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == out_tokens for o in outs)
    assert all(o.num_cached_tokens > 0 for o in outs), "the prompts were not cached"
    return list(record)


def tok_s(steps: list) -> float:
    """The median step's tokens/s: bursts of other work on the shared cores slow some steps,
    which a median over the steps of all runs leaves out (a mean over a run would not)."""
    return statistics.median(n / s for s, n in steps)


def kv_row(name: str, llm: LLM) -> dict:
    runner = llm.llm_engine.model_runner
    config, caches = runner.model.config, runner.kv_caches
    num_blocks, block_size = caches[0].shape[1], caches[0].shape[2]
    measured = sum(c.numel() * c.element_size() for c in caches) // (num_blocks * block_size)
    spec = kv_cache_spec(config)
    formula = config.num_hidden_layers * spec.bytes_per_token(caches[0].element_size())
    assert measured == formula, (measured, formula)
    per_block = runner._bytes_per_block()
    return {"model": name, "dtype": str(caches[0].dtype).removeprefix("torch."),
            "cache_shape": list(caches[0].shape), "layers": len(caches),
            "elements_per_token_layer": spec.num_entries * spec.num_kv_heads * spec.head_size,
            "bytes_per_token": measured,
            "tokens_in_1GiB": DEFAULT_KV_MEMORY // per_block * block_size}


def deepseek_v3_kv(dtype_size: int = 2) -> dict:
    """DeepSeek-V3's KV bytes per token (bfloat16), MLA against the same model as MHA (each of
    128 heads a key of qk_nope + qk_rope = 192 and a value of v_head_dim = 128)."""
    c = DEEPSEEK_V3
    mla = c["kv_lora_rank"] + c["qk_rope_head_dim"]
    mha = c["num_attention_heads"] * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
                                      + c["v_head_dim"])
    layers = c["num_hidden_layers"]
    return {"config": c, "dtype_bytes": dtype_size,
            "mla_elements_per_token_layer": mla, "mha_elements_per_token_layer": mha,
            "mla_bytes_per_token": layers * mla * dtype_size,
            "mha_bytes_per_token": layers * mha * dtype_size, "ratio": mha / mla,
            "mla_tokens_in_1GiB": DEFAULT_KV_MEMORY // (layers * mla * dtype_size),
            "mha_tokens_in_1GiB": DEFAULT_KV_MEMORY // (layers * mha * dtype_size)}


def engines(paths: dict, dtype: str, invariant: bool | None, max_len: int, blocks: int) -> dict:
    return {name: LLM(str(path), dtype=dtype, batch_invariant=invariant, max_model_len=max_len,
                      block_size=BLOCK, num_blocks=blocks, max_num_seqs=256, device="cpu")
            for name, path in paths.items()}


def run_mode(paths: dict, dtype: str, invariant: bool | None, args, kv_rows: list
             ) -> list[dict]:
    max_len = max(args.contexts) + args.output_tokens + BLOCK
    # Room for the prompts and for the decode pools (minicore/model/decode_kv.py) to hold them
    # all as they grow (past the paged cache's slots a step would take the gather instead).
    blocks = 2 + 2 * max(args.batches) * -(-max_len // BLOCK)
    built = engines(paths, dtype, invariant, max_len, blocks)
    records = {name: decode_timer(llm) for name, llm in built.items()}
    invariant = built["mla"].llm_engine.config.model_config.batch_invariant
    kv_rows += [kv_row(name, llm) for name, llm in built.items()]
    rng, rows = random.Random(0), []
    warm = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for context in args.contexts:
        prompts = [[rng.randrange(100, 4096) for _ in range(context)]
                   for _ in range(max(args.batches))]
        for llm in built.values():  # prefill once (the timed runs hit the prefix cache)
            llm.generate(prompts, warm, use_tqdm=False)
        for batch in args.batches:
            steps = {name: [] for name in built}
            for llm in built.values():  # a few untimed decode steps at this batch
                llm.generate(prompts[:batch], warm, use_tqdm=False)
            for _ in range(args.repeat):
                for name, llm in built.items():
                    steps[name] += decode_steps(llm, records[name], prompts[:batch],
                                                args.output_tokens)
            rows.append({"dtype": dtype, "batch_invariant": invariant, "context": context,
                         "batch": batch,
                         "steps": {n: [(round(t, 6), k) for t, k in s] for n, s in steps.items()},
                         **{f"{name}_tok_s": tok_s(s) for name, s in steps.items()},
                         **{f"{name}_mean_tok_s": sum(n for _, n in s) / sum(t for t, _ in s)
                            for name, s in steps.items()}})
            print(f"  {dtype} invariant={invariant} context {context} batch {batch}: "
                  + ", ".join(f"{n} {rows[-1][n + '_tok_s']:.1f}" for n in built), flush=True)
    for llm in built.values():
        llm.llm_engine.shutdown()
    return rows


def print_tables(rows: list[dict], kv_rows: list[dict], real: dict, args) -> None:
    print(f"\nCPU: {cpu_description()}; torch threads {torch.get_num_threads()}")
    print(f"decode tok/s: the median all-decode step of {args.repeat} alternated runs of "
          f"{args.output_tokens} output tokens each")
    print(f"{'dtype':9} {'invariant':>9} {'context':>7} {'batch':>5} {'MLA tok/s':>10} "
          f"{'MHA tok/s':>10} {'MLA/MHA':>8}")
    for r in rows:
        print(f"{r['dtype']:9} {str(r['batch_invariant']):>9} {r['context']:>7} {r['batch']:>5} "
              f"{r['mla_tok_s']:>10.1f} {r['mha_tok_s']:>10.1f} "
              f"{r['mla_tok_s'] / r['mha_tok_s']:>7.2f}x")
    print(f"\n{'model':5} {'dtype':9} {'cache shape [entries, blocks, block, heads, dim]':>48} "
          f"{'elems/token/layer':>17} {'bytes/token':>11} {'tokens in 1 GiB':>15}")
    for k in kv_rows:
        print(f"{k['model']:5} {k['dtype']:9} {str(k['cache_shape']):>48} "
              f"{k['elements_per_token_layer']:>17} {k['bytes_per_token']:>11} "
              f"{k['tokens_in_1GiB']:>15}")
    print(f"\nDeepSeek-V3 ({real['config']}), bfloat16: MLA "
          f"{real['mla_elements_per_token_layer']} elements a token a layer, "
          f"{real['mla_bytes_per_token']} bytes a token; as MHA "
          f"{real['mha_elements_per_token_layer']}, {real['mha_bytes_per_token']} bytes "
          f"({real['ratio']:.1f}x); tokens in 1 GiB: MLA {real['mla_tokens_in_1GiB']}, MHA "
          f"{real['mha_tokens_in_1GiB']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--contexts", nargs="+", type=int, default=[256, 2048])
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None,
                    help="torch's threads (default: its own; 1 is steadier on a shared machine)")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "bench_mla.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    start, load_before = time.perf_counter(), os.getloadavg()
    tokenizer = load_tokenizer(resolve_model_dir(), vocab_size=False)
    rows, kv_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        paths = {name: build(family, settings, Path(tmp) / name, tokenizer)
                 for name, (family, settings) in (("mla", MLA_MODEL), ("mha", MHA_MODEL))}
        params = {name: sum(t.numel() for t in load_file(p / "model.safetensors").values())
                  for name, p in paths.items()}
        print(f"parameters: MLA {params['mla']:,}, MHA {params['mha']:,}", flush=True)
        for dtype in args.dtypes:
            for invariant in (None, False):  # the CPU's default (on where the kernels build)
                rows += run_mode(paths, dtype, invariant, args, kv_rows)
    kv_rows = list({(k["model"], k["dtype"]): k for k in kv_rows}.values())  # one per dtype
    real = deepseek_v3_kv()
    print_tables(rows, kv_rows, real, args)
    elapsed = time.perf_counter() - start
    load = {"before": load_before, "after": os.getloadavg()}
    print(f"total {elapsed:.0f} s; load average (1, 5, 15 min) before {load['before']}, "
          f"after {load['after']} (other processes share the cores when above ~0)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(
        {"cpu": cpu_description(), "threads": torch.get_num_threads(), "parameters": params,
         "models": {"mla": MLA_MODEL, "mha": MHA_MODEL}, "output_tokens": args.output_tokens,
         "repeat": args.repeat, "results": rows, "kv": kv_rows, "deepseek_v3": real,
         "seconds": elapsed, "load_average": load}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
