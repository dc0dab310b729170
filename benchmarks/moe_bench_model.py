"""The balance study's benchmark mixture-of-experts model: a Qwen3-MoE of random weights, generated
here (nothing downloaded), big enough that a CPU forward is mostly matrix work rather than Python
and collective overhead, small enough for two engines on two cores. The default model's tokenizer
and vocabulary (SmolLM2's) are saved beside it, as tests/model/moe_models.py's build_served_moe does
for the tests' tiny models (same recipe: AutoConfig.for_model + from_config with a fixed seed,
float32 safetensors; not imported from tests/, which is not a package).

Cached under ~/.cache/minicore/moe-bench-<hash of the config>/, built once.

    python benchmarks/moe_bench_model.py             # build (or find) it, print its directory
    python benchmarks/moe_bench_model.py --time 8    # and time one process's forward of 8 tokens
"""

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch

# Chosen by timing (docs/BALANCE_STUDY.md, "Expert-parallel MoE model, DP=2"): 8 decoding sequences
# a rank give a DP=2 expert-parallel step of about 62 ms on one thread per engine (one process,
# no EP: 17 ms for 1 token, 50 ms for 8, 134 ms for 128). 6 layers x 16 experts of 3 x 384 x 384,
# about 83M parameters, 319 MB of float32.
BENCH_CONFIG = dict(
    vocab_size=49152, hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
    num_key_value_heads=2, head_dim=64, intermediate_size=1024, moe_intermediate_size=384,
    num_experts=16, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=4096,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    # Wider than the default 0.02, so the router's choices are not near ties (as the tests' models).
    initializer_range=0.1)
FAMILY = "qwen3_moe"
SEED = 0


def config_key(overrides: dict | None = None) -> str:
    settings = {"family": FAMILY, "seed": SEED, **BENCH_CONFIG, **(overrides or {})}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def bench_model_dir(overrides: dict | None = None, cache_dir: Path | None = None) -> Path:
    """The benchmark model's directory, built on first use (atomically: a temporary directory
    renamed into place)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from minicore.model.loader import resolve_model_dir

    root = cache_dir or Path.home() / ".cache" / "minicore"
    path = root / f"moe-bench-{config_key(overrides)}"
    if (path / "model.safetensors").is_file():
        return path
    tmp = root / f"{path.name}.tmp{time.time_ns()}"
    torch.manual_seed(SEED)
    config = AutoConfig.for_model(FAMILY, **{**BENCH_CONFIG, **(overrides or {})})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(tmp)
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir()), local_files_only=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(path)
    return path


def time_forward(path: Path, num_tokens: int, repeats: int = 10) -> float:
    """One process, one thread, no expert parallelism: median ms of a forward of num_tokens
    tokens (a rough guide to the size; the study measures the engines themselves)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(100, 49152, (1, num_tokens))
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 2):
            t = time.perf_counter()
            model(ids, logits_to_keep=num_tokens)
            times.append(time.perf_counter() - t)
    return 1000 * sorted(times[2:])[repeats // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time", type=int, nargs="*", default=None,
                    help="time one-process forwards of these token counts")
    args = ap.parse_args()
    path = bench_model_dir()
    print(path)
    for n in args.time or []:
        print(f"{n} tokens: {time_forward(path, n):.1f} ms (one process, one thread, no EP)")


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
