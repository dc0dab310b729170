"""KV cache blocks, the LRU free queue, prefix-cache hashing and the pool that owns them.

Mirrors vllm/v1/core/block_pool.py and vllm/v1/core/kv_cache_utils.py (KVCacheBlock,
FreeKVCacheBlockQueue, BlockHashToBlockMap, hash_block_tokens), as of vLLM 0.32: several blocks may
be cached under one hash (a block computed twice stays cached: block tables are append-only, so
nothing is de-duplicated), and freed blocks without a hash go to the front of the free queue (reused
first) while hashed ones go to the tail (evicted last, least recently used first). Left out: KV
events, multiple KV cache groups.
"""

import hashlib
from array import array
from collections.abc import Iterable
from dataclasses import dataclass

BlockHash = bytes


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while the block is full and cached; kept after the block is freed (lazy eviction) until
    # the block is handed out again.
    block_hash: BlockHash | None = None
    prev_free_block: "KVCacheBlock | None" = None
    next_free_block: "KVCacheBlock | None" = None
    is_null: bool = False

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks: O(1) pop from the head, append to the tail, and removal
    from the middle (a prefix hit on a free cached block). The head is evicted first."""

    def __init__(self, blocks: list[KVCacheBlock]):
        self.num_free_blocks = len(blocks)
        # Sentinels keep every operation free of None checks.
        self.head = KVCacheBlock(block_id=-1)
        self.tail = KVCacheBlock(block_id=-1)
        prev = self.head
        for block in blocks:
            prev.next_free_block, block.prev_free_block = block, prev
            prev = block
        prev.next_free_block, self.tail.prev_free_block = self.tail, prev

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free_block
        if block is self.tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        blocks, block = [], self.head.next_free_block
        for _ in range(n):
            blocks.append(block)
            block.prev_free_block, block = None, block.next_free_block
            blocks[-1].next_free_block = None
        self.head.next_free_block, block.prev_free_block = block, self.head
        self.num_free_blocks -= n
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block, nxt.prev_free_block = nxt, prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self.tail.prev_free_block, block)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put blocks at the head, in the given order: the first given is the first handed out."""
        prev = self.head
        for block in blocks:
            self._insert_after(prev, block)
            prev = block

    def _insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        nxt = prev.next_free_block
        prev.next_free_block, block.prev_free_block = block, prev
        block.next_free_block, nxt.prev_free_block = nxt, block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        blocks, block = [], self.head.next_free_block
        while block is not self.tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks


def hash_block_tokens(parent_hash: BlockHash | None, token_ids,
                      extra_keys: bytes = b"") -> BlockHash:
    """Chain hash of one full block: it names the block's tokens and everything before them, so two
    requests share a block only if their whole prefixes match. sha256, not hash(): a collision would
    silently serve another prompt's KV."""
    h = hashlib.sha256(parent_hash or b"")
    h.update(array("q", token_ids).tobytes())
    h.update(extra_keys)
    return h.digest()


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
