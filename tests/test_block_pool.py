"""Block pool: the O(1) free-block queue (FreeKVCacheBlockQueue), the reserved null block, lazy
eviction of cached blocks, and reverse-order freeing to the tail of the LRU free queue."""

import time

import pytest

from minicore.scheduler import FreeKVCacheBlockQueue, KVCacheBlock
from minicore.testing import free_ids, make_request, make_scheduler, num_free, step


def _queue(n):
    blocks = [KVCacheBlock(block_id=i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def _ids(q):
    return [b.block_id for b in q.get_all_free_blocks()]


# ---------------------------------------------------------------- FreeKVCacheBlockQueue


def test_block_defaults():
    b = KVCacheBlock(block_id=7)
    assert (b.block_id, b.ref_cnt, b.block_hash) == (7, 0, None)


def test_queue_initial_order_and_count():
    _, q = _queue(5)
    assert q.num_free_blocks == 5
    assert _ids(q) == [0, 1, 2, 3, 4]


def test_popleft_order_then_empty_raises():
    blocks, q = _queue(3)
    assert q.popleft() is blocks[0]
    assert q.popleft() is blocks[1]
    assert q.num_free_blocks == 1
    assert q.popleft() is blocks[2]
    assert q.num_free_blocks == 0
    assert _ids(q) == []
    with pytest.raises(ValueError):
        q.popleft()
    assert q.num_free_blocks == 0


def test_remove_middle_head_tail():
    blocks, q = _queue(6)
    q.remove(blocks[3])  # middle
    assert _ids(q) == [0, 1, 2, 4, 5]
    q.remove(blocks[0])  # head
    assert _ids(q) == [1, 2, 4, 5]
    q.remove(blocks[5])  # tail
    assert _ids(q) == [1, 2, 4]
    assert q.num_free_blocks == 3
    assert q.popleft() is blocks[1]
    assert _ids(q) == [2, 4]


def test_remove_everything_then_append():
    blocks, q = _queue(3)
    for b in (blocks[1], blocks[0], blocks[2]):
        q.remove(b)
    assert q.num_free_blocks == 0
    assert _ids(q) == []
    q.append(blocks[2])
    q.append(blocks[0])
    assert _ids(q) == [2, 0]
    assert q.popleft() is blocks[2]


def test_append_goes_to_tail():
    blocks, q = _queue(4)
    b0 = q.popleft()
    b1 = q.popleft()
    q.append(b1)
    q.append(b0)
    assert _ids(q) == [2, 3, 1, 0]
    assert q.num_free_blocks == 4
    q.remove(blocks[3])
    q.append(blocks[3])
    assert _ids(q) == [2, 1, 0, 3]


def _time_middle_removals(n, k):
    blocks, q = _queue(n)
    mid = n // 2 - k // 2
    victims = blocks[mid : mid + k]
    t0 = time.perf_counter()
    for b in victims:
        q.remove(b)
    dt = time.perf_counter() - t0
    assert q.num_free_blocks == n - k
    return dt


def test_remove_is_constant_time():
    # Removing 2000 blocks from the middle must not cost more in a 100x longer queue
    # (a list-based O(n) remove scans ~100k entries per call there).
    small = min(_time_middle_removals(4_000, 2_000) for _ in range(3))
    big = min(_time_middle_removals(200_000, 2_000) for _ in range(2))
    assert big < 10 * small + 0.05, (small, big)


# ---------------------------------------------------------------- null block


def test_null_block_reserved():
    s = make_scheduler(num_blocks=10, block_size=4)
    assert num_free(s) == 9
    assert free_ids(s) == list(range(1, 10))
    assert s.kv_cache_manager.usage == pytest.approx(0.0)
    # Fill every usable block: block 0 is never handed out.
    reqs = [make_request(f"r{i}", 12) for i in range(3)]  # 3 blocks each = 9
    for r in reqs:
        s.add_request(r)
    step(s)
    held = sorted(b for r in reqs for b in s.kv_cache_manager.get_block_ids(r.request_id))
    assert held == list(range(1, 10))
    assert num_free(s) == 0
    assert s.kv_cache_manager.usage == pytest.approx(1.0)


def test_num_blocks_required():
    with pytest.raises(ValueError):
        make_scheduler(num_blocks=None)


# ---------------------------------------------------------------- freeing order and lazy eviction


@pytest.mark.parametrize("prefix_caching, expected", [(True, [4, 5, 3, 2, 1]),
                                                      (False, [3, 2, 1, 4, 5])])
def test_freed_blocks_go_in_reverse_hashed_to_the_tail_others_to_the_head(prefix_caching,
                                                                          expected):
    s = make_scheduler(num_blocks=6, block_size=4, enable_prefix_caching=prefix_caching)
    a = make_request("a", 12, max_tokens=1)
    s.add_request(a)
    out = step(s).out
    assert out.num_scheduled_tokens == {"a": 12}
    assert a.is_finished()
    assert num_free(s) == 5
    # a held [1, 2, 3], freed in reverse. Cached (hashed) blocks go to the tail, 3 evicted
    # before 1; blocks without a hash can never be hit and go to the head, reused first
    # (vLLM 0.32's BlockPool.free_blocks).
    assert free_ids(s) == expected


def test_a_partly_filled_block_is_reused_before_the_cached_ones():
    s = make_scheduler(num_blocks=6, block_size=4)
    s.add_request(make_request("a", 10, max_tokens=1))
    step(s)
    # Blocks 1 and 2 are full and cached (to the tail, 2 first); 3 holds 2 tokens, no hash.
    assert free_ids(s) == [3, 4, 5, 2, 1]


def test_new_blocks_come_from_head():
    s = make_scheduler(num_blocks=6, block_size=4)
    s.add_request(make_request("a", 12, max_tokens=1))
    step(s)
    s.add_request(make_request("c", 12, max_tokens=4))
    step(s)
    assert s.kv_cache_manager.get_block_ids("c") == [4, 5, 3]
    assert free_ids(s) == [2, 1]


def test_freed_block_keeps_hash_and_is_still_hit():
    s = make_scheduler(num_blocks=6, block_size=4)
    prompt = list(range(9))
    a = make_request("a", prompt, max_tokens=1)
    s.add_request(a)
    step(s)
    assert a.is_finished()
    # the partial block 3 has no hash: to the head; the cached 1, 2 to the tail
    assert free_ids(s) == [3, 4, 5, 2, 1]
    hashes = {b.block_id: b.block_hash for b in
              s.kv_cache_manager.block_pool.free_block_queue.get_all_free_blocks()}
    assert hashes[1] is not None and hashes[2] is not None  # full blocks: cached
    assert hashes[3] is None  # partial block (1 token): not cached
    assert hashes[1] != hashes[2]

    b = make_request("b", prompt, max_tokens=1)
    s.add_request(b)
    out = step(s).out
    # hit blocks 1, 2 (8 tokens; max hit = (9-1)//4 = 2 blocks), 1 new block from the head (3)
    assert b.num_cached_tokens == 8
    assert out.num_scheduled_tokens == {"b": 1}


def test_hit_block_is_removed_from_free_queue_while_used():
    s = make_scheduler(num_blocks=6, block_size=4)
    prompt = list(range(9))
    s.add_request(make_request("a", prompt, max_tokens=1))
    step(s)
    s.add_request(make_request("b", prompt, max_tokens=5))
    step(s)
    assert s.kv_cache_manager.get_block_ids("b") == [1, 2, 3]
    assert free_ids(s) == [4, 5]
    assert num_free(s) == 2


def test_block_evicted_only_when_reused():
    s = make_scheduler(num_blocks=6, block_size=4)
    prompt = list(range(12))
    s.add_request(make_request("a", prompt, max_tokens=1))
    step(s)  # a: blocks [1, 2, 3], all full and cached; free queue [4, 5, 3, 2, 1]
    # c (other tokens) takes 4, 5, 3 from the head: block 3 is evicted, 1 and 2 are not.
    c = make_request("c", 12, max_tokens=1)
    s.add_request(c)
    step(s)
    assert c.is_finished()
    assert free_ids(s) == [2, 1, 3, 5, 4]
    # b = a's prompt + 1: could hit 3 blocks, but block 3 was reused -> only 1, 2 hit.
    b = make_request("b", prompt + [99], max_tokens=1)
    s.add_request(b)
    out = step(s).out
    assert b.num_cached_tokens == 8
    assert out.num_scheduled_tokens == {"b": 5}


def test_all_cached_blocks_reused_means_no_hit():
    s = make_scheduler(num_blocks=6, block_size=4)
    prompt = list(range(9))
    s.add_request(make_request("a", prompt, max_tokens=1))
    step(s)
    c = make_request("c", 20, max_tokens=1)  # needs all 5 blocks
    s.add_request(c)
    step(s)
    assert sorted(free_ids(s)) == [1, 2, 3, 4, 5]
    d = make_request("d", prompt, max_tokens=1)
    s.add_request(d)
    out = step(s).out
    assert d.num_cached_tokens == 0
    assert out.num_scheduled_tokens == {"d": 9}
