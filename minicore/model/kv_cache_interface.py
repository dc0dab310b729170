"""What one layer's paged KV cache holds per token, and so its shape and its bytes.

Mirrors ``vllm/v1/kv_cache_interface.py`` (``FullAttentionSpec``, ``MLAAttentionSpec`` and their
``page_size_bytes``) for the two layouts minicore runs: a key and a value per KV head, or
multi-head latent attention's one row per token (DeepSeek-V2/V3: the compressed latent
``kv_lora_rank`` and the rotated shared key ``qk_rope_head_dim``, the same for every head;
minicore/model/mla.py). Both are ``[entries, num_blocks, block_size, kv_heads, head_size]``: MLA's
is vLLM's ``(num_blocks, block_size, head_size)`` with a K/V axis and a head axis of one, so that
block gathers, the CPU decode pools and the NIXL descriptors take either. Left out: sliding-window
and hybrid (Mamba) specs, fp8 caches.
"""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_entries: int  # 2: keys and values; 1: MLA's latent row, which is its own value
    num_kv_heads: int
    head_size: int

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return kv_cache_shape(num_blocks, block_size, self.num_kv_heads, self.head_size,
                              self.num_entries)

    def bytes_per_token(self, dtype_size: int) -> int:
        """One layer's cache bytes for one token (vLLM's page_size_bytes / block_size)."""
        return self.num_entries * self.num_kv_heads * self.head_size * dtype_size


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                   num_entries: int = 2) -> tuple[int, ...]:
    """One layer's cache: keys at index 0, values at index 1 (a one-entry cache: the keys)."""
    return (num_entries, num_blocks, block_size, num_kv_heads, head_size)


def kv_cache_spec(config) -> KVCacheSpec:
    """The spec of a transformers config's attention layers."""
    if (rank := getattr(config, "kv_lora_rank", None)) is not None:
        return KVCacheSpec(1, 1, rank + config.qk_rope_head_dim)
    head_dim = (getattr(config, "head_dim", None)
                or config.hidden_size // config.num_attention_heads)
    return KVCacheSpec(2, getattr(config, "num_key_value_heads", None)
                       or config.num_attention_heads, head_dim)
