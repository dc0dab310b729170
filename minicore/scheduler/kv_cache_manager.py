"""KVCacheManager: which blocks each request holds, prefix-cache lookups, slot allocation.

Mirrors vllm/v1/core/kv_cache_manager.py together with the single full-attention case of
vllm/v1/core/single_type_kv_cache_manager.py, with the two cases of a drafter that writes KV of
its own (MTP): num_lookahead_tokens slots past the scheduled tokens, and use_eagle's prefix hit
one block short. Left out: hybrid models (several KV cache groups), sliding windows, KV events.
"""

from dataclasses import dataclass, field

from minicore.request import Request
from minicore.scheduler.block_pool import BlockPool
from minicore.scheduler.kv_cache_utils import KVCacheBlock, update_block_hashes


@dataclass(slots=True)
class KVCacheBlocks:
    """The blocks one allocation handed out (vLLM wraps a list per KV cache group)."""
    blocks: list[KVCacheBlock] = field(default_factory=list)

    def get_block_ids(self) -> list[int]:
        return [block.block_id for block in self.blocks]

    def get_unhashed_block_ids(self) -> list[int]:
        """The blocks not in the prefix cache: those a KV connector loads into."""
        return [block.block_id for block in self.blocks if block.block_hash is None]


_NO_BLOCKS = KVCacheBlocks()


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found cached


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 max_model_len: int = 0, num_lookahead_tokens: int = 0, use_eagle: bool = False):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len, self.num_lookahead_tokens = max_model_len, num_lookahead_tokens
        self.use_eagle = use_eagle
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of a request's leading blocks are already cached (hashed and registered).
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(list(self.req_to_blocks.get(request_id, ())))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks from the request's start, and its length in
        tokens. The last token is always recomputed: the model must run on at least one token to
        produce the logits the request samples from. None for a request that asked for prompt
        logprobs: the model must compute every prompt position (vLLM: skip_reading_prefix_cache).
        use_eagle: a block less (its drafter KV read the token after it: drop_eagle_block)."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in update_block_hashes(request, self.block_size)[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        hits = hits[:-1] if self.use_eagle else hits
        return hits, len(hits) * self.block_size

    def record_prefix_cache_query(self, num_tokens: int, num_hits: int) -> None:
        self.prefix_cache_stats.queries += num_tokens
        self.prefix_cache_stats.hits += num_hits

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] = (),
                       full_sequence_must_fit: bool = False,
                       delay_cache_blocks: bool = False) -> KVCacheBlocks | None:
        """Make room for num_new_tokens more tokens after the request's computed ones (plus the
        prefix hit being taken now). Returns the newly allocated blocks, or None, having changed
        nothing, when the pool cannot supply them. full_sequence_must_fit: None also unless the
        pool could hold the request's whole current sequence (vLLM's scheduler_reserve_full_isl
        admission check: a chunked prefill is not admitted only to be preempted halfway).
        delay_cache_blocks: leave the new blocks out of the prefix cache: a KV connector has yet
        to load them (cache_blocks once it has)."""
        req_id = request.request_id
        blocks = self.req_to_blocks.get(req_id)
        if blocks is None:
            blocks = []
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        # The drafter's slots too, to max_model_len, unless a KV load runs no forward yet.
        slots = min(num_tokens + (not delay_cache_blocks) * self.num_lookahead_tokens,
                    max(num_tokens, self.max_model_len))
        num_new_blocks = -(-slots // self.block_size) - len(blocks) - len(new_computed_blocks)
        new_blocks = _NO_BLOCKS
        # Most decode steps need no new block and bring no prefix hit: nothing to allocate.
        if num_new_blocks > 0 or new_computed_blocks or full_sequence_must_fit:
            # Cached blocks sitting in the free queue stop being free once this request takes them.
            num_free = self.block_pool.get_num_free_blocks() - sum(
                1 for block in new_computed_blocks if block.ref_cnt == 0)
            if full_sequence_must_fit:
                full_blocks = -(-request.num_tokens // self.block_size)
                if full_blocks - len(blocks) - len(new_computed_blocks) > num_free:
                    return None
            if num_new_blocks > num_free:
                return None
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            if num_new_blocks > 0:
                new_blocks = KVCacheBlocks(self.block_pool.get_new_blocks(num_new_blocks))
                blocks.extend(new_blocks.blocks)
            self.req_to_blocks[req_id] = blocks
        if (self.enable_caching and not delay_cache_blocks
                and num_tokens // self.block_size > self.num_cached_block.get(req_id, 0)):
            # Draft tokens may be rejected: only blocks of known tokens are cached.
            self._cache_full_blocks(request, blocks, min(num_tokens, request.num_tokens))
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the request's full blocks up to num_computed_tokens (blocks a KV connector has
        just loaded, allocated with delay_cache_blocks)."""
        blocks = self.req_to_blocks.get(request.request_id)
        if (self.enable_caching and blocks is not None and num_computed_tokens // self.block_size
                > self.num_cached_block.get(request.request_id, 0)):
            self._cache_full_blocks(request, blocks, num_computed_tokens)

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock],
                           num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        req_id = request.request_id
        start = self.num_cached_block.get(req_id, 0)
        hashes = update_block_hashes(request, self.block_size)
        for i in range(start, num_full):
            if blocks[i].block_hash is None:
                self.block_pool.cache_block(blocks[i], hashes[i])
        self.num_cached_block[req_id] = num_full

    def uncache_blocks_after(self, request: Request, num_computed_tokens: int) -> None:
        """Drop the cache entries of the request's blocks past num_computed_tokens: they were
        hashed when scheduled, but the step that was to compute them will not run them."""
        blocks = self.req_to_blocks.get(request.request_id, ())
        for block in blocks[num_computed_tokens // self.block_size:]:
            if block.block_hash is not None:
                self.block_pool.evict_cached_block(block)

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first, so that under memory pressure the end of its
        sequence is evicted before the prefix other requests are likelier to share."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
