"""BlockPool: the KV cache's blocks, the free ones in eviction order, the cached ones by hash.

Mirrors vllm/v1/core/block_pool.py (BlockPool; BlockHashToBlockMap is a dict here), as of vLLM
0.32: several blocks may be cached under one hash (a block computed twice stays cached: block
tables are append-only, so nothing is de-duplicated), and freed blocks without a hash go to the
front of the free queue (reused first) while hashed ones go to the tail (evicted last, least
recently used first). The block, the free queue and the hash are in kv_cache_utils.py, as in vLLM.
Left out: KV events, multiple KV cache groups.
"""

from collections.abc import Iterable

from minicore.scheduler.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock


class BlockPool:
    """Owns every block: hands out free ones, tracks the cached ones by hash, takes them back."""

    def __init__(self, num_blocks: int, enable_caching: bool):
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.enable_caching = enable_caching
        # hash -> the blocks cached under it, by block id, in the order they were cached.
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        # Block 0 is never handed out: the model runner points padding slots at it.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / (len(self.blocks) - 1)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The first block cached under the hash, if any (vLLM's get_one_block)."""
        blocks = self.cached_block_hash_to_block.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        blocks = self.free_block_queue.popleft_n(n)
        for block in blocks:
            if block.block_hash is not None:
                self.evict_cached_block(block)
            block.ref_cnt = 1
        return blocks

    def evict_cached_block(self, block: KVCacheBlock) -> None:
        blocks = self.cached_block_hash_to_block[block.block_hash]
        del blocks[block.block_id]
        if not blocks:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        block.block_hash = block_hash
        self.cached_block_hash_to_block.setdefault(block_hash, {})[block.block_id] = block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks; a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference, in eviction order (the first given is the first to go). Blocks no
        longer used without a hash can never be hit: they go to the head of the free queue, to be
        reused first; hashed ones to the tail, so the prefix cache loses its least recently used
        blocks first."""
        reuse_first = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    reuse_first.append(block)
                else:
                    self.free_block_queue.append(block)
        self.free_block_queue.prepend_n(reuse_first)

    def reset_prefix_cache(self) -> bool:
        if self.get_num_free_blocks() != len(self.blocks) - 1:
            return False
        for blocks in self.cached_block_hash_to_block.values():
            for block in blocks.values():
                block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True
