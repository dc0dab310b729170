"""The block pool's parts: the KV cache block, the free-block queue and the prefix-cache hash.

Mirrors vllm/v1/core/kv_cache_utils.py (BlockHash, KVCacheBlock, FreeKVCacheBlockQueue,
hash_block_tokens) and Request.update_block_hashes (vllm/v1/request.py). The policy (which blocks
the pool hands out, caches, evicts and frees, in which order) is BlockPool's, in
minicore/scheduler/block_pool.py; here are the data structures it works on and the hash, which a
reader of the engine core can take on trust.
"""

import hashlib
from array import array
from dataclasses import dataclass

from minicore.request import Request

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


def update_block_hashes(request: Request, block_size: int) -> list[BlockHash]:
    """Extend the request's chain hashes over every full block of known tokens, and return them.
    The cache salt enters the first block's hash only: the chain carries it into every later one."""
    hashes, bs, tokens = request.block_hashes, block_size, request.all_token_ids
    for i in range(len(hashes), len(tokens) // bs):
        parent = hashes[i - 1] if i else None
        extra = request.cache_salt.encode() if i == 0 and request.cache_salt else b""
        hashes.append(hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs], extra))
    return hashes
