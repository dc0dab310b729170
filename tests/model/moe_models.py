"""Tiny random mixture-of-experts models of each family expert parallelism supports, built from a
config with a fixed seed and saved as safetensors directories (config.json + model.safetensors +
generation_config.json; no tokenizer: these tests feed token ids). build_served_moe makes one that
can be served: the default model's tokenizer and vocabulary, and room for long requests.

The families differ where it matters to expert parallelism: the expert counts split evenly and
unevenly over 2 ranks (8, 6, 5, 4), Qwen2-MoE has a shared expert and a dense layer between its MoE
layers, Mixtral and OLMoE name the count num_local_experts."""

from pathlib import Path

import torch

_COMMON = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, num_experts_per_tok=2,
               bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
               # Wider than the default 0.02, so the router's top-k choices are not near ties
               # that float summation order could flip.
               initializer_range=0.1)

FAMILIES = {
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=16, intermediate_size=64, head_dim=8,
                      norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=6, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                      intermediate_size=48, num_hidden_layers=3, mlp_only_layers=[1]),
    "mixtral": dict(num_local_experts=5, intermediate_size=16),
    "olmoe": dict(num_experts=4, intermediate_size=16),
}


# DeepSeek's MoE (shared experts, grouped top-k routing with the correction bias, dense first
# layers) and multi-head latent attention, V3 with q_lora and V2-Lite's shape without.
MLA_FAMILIES = {
    "deepseek_v3": dict(n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=16,
                        intermediate_size=48, num_hidden_layers=3, first_k_dense_replace=1,
                        n_group=2, topk_group=1, routed_scaling_factor=2.5, num_key_value_heads=4,
                        kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
                        v_head_dim=8),
    "deepseek_v2": dict(n_routed_experts=6, n_shared_experts=2, moe_intermediate_size=16,
                        intermediate_size=48, num_hidden_layers=3, first_k_dense_replace=1,
                        n_group=3, topk_group=2, topk_method="group_limited_greedy",
                        num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
}
EP_FAMILIES = {**FAMILIES, **MLA_FAMILIES}


def tiny_moe_config(family: str, **overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **{**_COMMON, **EP_FAMILIES[family], **overrides})


def build_tiny_moe(family: str, path: Path, seed: int = 0, **overrides) -> Path:
    """Save a tiny random ``family`` model (float32) under path; returns path."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(family, **overrides),
                                             dtype=torch.float32)
    model.save_pretrained(path)
    return path


# A served model needs a tokenizer: the default model's (SmolLM2's, bos 1 and eos 2 as above), with
# its vocabulary; long streams (the DP tests' 1000 tokens) need the positions.
_SERVED = dict(vocab_size=49152, max_position_embeddings=4096)


def build_served_moe(family: str, path: Path, seed: int = 0, **overrides) -> Path:
    """build_tiny_moe with the default model's tokenizer saved beside it; returns path."""
    from transformers import AutoTokenizer

    from minicore.model.loader import resolve_model_dir

    build_tiny_moe(family, path, seed, **{**_SERVED, **overrides})
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir()), local_files_only=True)
    tokenizer.save_pretrained(path)
    return path
