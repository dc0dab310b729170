"""KV cache manager: chained block hashes (parent + tokens + cache salt on the first block), prefix
hits (longest cached run, at least one token recomputed), allocate_slots failing without side
effects, decode-filled blocks becoming cacheable, ref counts of shared blocks, usage, and
reset_prefix_cache."""

import pytest

from minicore.request import RequestStatus
from minicore.testing import block, free_ids, make_request, make_scheduler, num_free, step


def _free_hashes(s):
    return {b.block_id: b.block_hash for b in
            s.kv_cache_manager.block_pool.free_block_queue.get_all_free_blocks()}


def _run_one(s, req):
    """Add req (max_tokens=1 expected), run one step; returns the scheduler output."""
    s.add_request(req)
    out = step(s).out
    return out


# ---------------------------------------------------------------- prefix hits


def test_block_aligned_full_hit_recomputes_last_block():
    s = make_scheduler(block_size=16, num_blocks=20)
    prompt = list(range(32))
    _run_one(s, make_request("a", prompt, max_tokens=1))
    b = make_request("b", prompt, max_tokens=1)
    out = _run_one(s, b)
    # both blocks are cached, but at least one token must be computed: hit 16, not 32
    assert b.num_cached_tokens == 16
    assert out.num_scheduled_tokens == {"b": 16}


def test_one_token_past_cached_blocks_hits_all_of_them():
    s = make_scheduler(block_size=16, num_blocks=20)
    prompt = list(range(32))
    _run_one(s, make_request("a", prompt, max_tokens=1))
    b = make_request("b", prompt + [7], max_tokens=1)
    out = _run_one(s, b)
    assert b.num_cached_tokens == 32
    assert out.num_scheduled_tokens == {"b": 1}


def test_partial_match_hits_only_whole_matching_blocks():
    s = make_scheduler(block_size=16, num_blocks=20)
    _run_one(s, make_request("a", list(range(48)), max_tokens=1))
    # same first block, second block matches in its first 8 tokens only
    b = make_request("b", list(range(24)) + list(range(900, 924)), max_tokens=1)
    out = _run_one(s, b)
    assert b.num_cached_tokens == 16
    assert out.num_scheduled_tokens == {"b": 32}


def test_short_prompt_no_full_block_no_hit():
    s = make_scheduler(block_size=16, num_blocks=20)
    _run_one(s, make_request("a", list(range(10)), max_tokens=1))
    b = make_request("b", list(range(10)), max_tokens=1)
    out = _run_one(s, b)
    assert b.num_cached_tokens == 0
    assert out.num_scheduled_tokens == {"b": 10}


def test_same_tokens_different_parent_different_hash_and_no_hit():
    s = make_scheduler(block_size=4, num_blocks=20)
    x, w, y = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    a = make_request("a", x + y + [0], max_tokens=1)
    s.add_request(a)
    step(s)
    a_blocks_hashes = _free_hashes(s)
    c = make_request("c", w + y + [0], max_tokens=1)
    s.add_request(c)
    out = step(s).out
    # c's second block has the same tokens as a's, but a different parent: no hit at all
    assert c.num_cached_tokens == 0
    assert out.num_scheduled_tokens == {"c": 9}
    hashes = _free_hashes(s)
    # a held blocks [1, 2, 3]; its partial block 3 went to the head of the free queue, so c
    # took [3, 4, 5]
    assert a_blocks_hashes[1] is not None and a_blocks_hashes[2] is not None
    assert hashes[3] is not None and hashes[4] is not None
    assert hashes[3] != a_blocks_hashes[1]
    assert hashes[4] != a_blocks_hashes[2]  # same tokens y, different parent


def test_same_prefix_same_hash_is_shared():
    s = make_scheduler(block_size=4, num_blocks=20)
    x, y = [1, 2, 3, 4], [9, 10, 11, 12]
    s.add_request(make_request("a", x + y + [0], max_tokens=1))
    step(s)
    b = make_request("b", x + [7, 7, 7, 7, 7], max_tokens=1)
    s.add_request(b)
    out = step(s).out
    assert b.num_cached_tokens == 4
    assert out.num_scheduled_tokens == {"b": 5}


def test_a_block_computed_twice_stays_cached_under_its_hash():
    """vLLM 0.32 caches every block under its hash (block tables are append-only, so nothing is
    de-duplicated): when one copy is evicted, the other still hits."""
    s = make_scheduler(block_size=4, num_blocks=20)
    prompt = list(range(8))
    _run_one(s, make_request("a", prompt, max_tokens=1))  # caches blocks [1, 2]
    # The same prompt hits one block (one token is always recomputed) and computes its second
    # block again, into a new block: now two blocks are cached under that hash.
    b = make_request("b", prompt, max_tokens=1)
    _run_one(s, b)
    assert b.num_cached_tokens == 4
    pool = s.kv_cache_manager.block_pool
    second_hash = b.block_hashes[1]
    copies = list(pool.cached_block_hash_to_block[second_hash].values())
    assert [blk.block_id for blk in copies] == [2, 3]
    assert pool.get_cached_block(second_hash) is copies[0]  # the first cached is the one hit
    pool.evict_cached_block(copies[0])
    c = make_request("c", prompt + [99], max_tokens=1)
    _run_one(s, c)
    assert c.num_cached_tokens == 8  # 4 if only the first copy had been cached


def test_cache_salt():
    s = make_scheduler(block_size=4, num_blocks=40)
    prompt = list(range(9))
    a = make_request("a", prompt, max_tokens=1, cache_salt="s1")
    _run_one(s, a)
    salted = _free_hashes(s)  # a held blocks 1, 2 (full) and 3

    b = make_request("b", prompt, max_tokens=1)  # no salt: no hit
    _run_one(s, b)
    assert b.num_cached_tokens == 0
    c = make_request("c", prompt, max_tokens=1, cache_salt="s2")  # other salt: no hit
    _run_one(s, c)
    assert c.num_cached_tokens == 0
    d = make_request("d", prompt, max_tokens=1, cache_salt="s1")  # same salt: hit
    _run_one(s, d)
    assert d.num_cached_tokens == 8
    # same salt, same first block, different second block: the first block still hits
    e = make_request("e", prompt[:4] + [50, 51, 52, 53, 54], max_tokens=1, cache_salt="s1")
    _run_one(s, e)
    assert e.num_cached_tokens == 4

    # b's blocks (unsalted) were the next ones from the head: 4, 5 full
    hashes = _free_hashes(s)
    assert hashes[4] is not None and hashes[5] is not None
    # the salt changes the first block's hash and, through the chain, the second one's
    assert hashes[4] != salted[1]
    assert hashes[5] != salted[2]


def test_prefix_caching_disabled_never_hits():
    s = make_scheduler(block_size=4, num_blocks=20, enable_prefix_caching=False)
    prompt = list(range(9))
    _run_one(s, make_request("a", prompt, max_tokens=1))
    b = make_request("b", prompt, max_tokens=1)
    out = _run_one(s, b)
    assert b.num_cached_tokens == 0
    assert out.num_scheduled_tokens == {"b": 9}


# ---------------------------------------------------------------- allocate_slots failure


def test_failed_allocate_slots_changes_nothing():
    s = make_scheduler(block_size=4, num_blocks=5)
    a = make_request("a", 8, max_tokens=10)
    s.add_request(a)
    step(s)
    ids_before = s.kv_cache_manager.get_block_ids("a")
    free_before = free_ids(s)
    assert ids_before == [1, 2] and free_before == [3, 4]
    assert s.kv_cache_manager.allocate_slots(a, 100) is None
    assert s.kv_cache_manager.get_block_ids("a") == ids_before
    assert free_ids(s) == free_before
    assert num_free(s) == 2
    # a fitting allocation still works afterwards and takes from the head
    assert s.kv_cache_manager.allocate_slots(a, 1) is not None  # 9 tokens -> 3 blocks
    assert s.kv_cache_manager.get_block_ids("a") == [1, 2, 3]


def test_failed_admission_with_prefix_hit_leaves_cached_blocks_free():
    s = make_scheduler(block_size=4, num_blocks=5, max_model_len=64)
    prompt = list(range(9))
    _run_one(s, make_request("a", prompt, max_tokens=1))  # blocks [1,2,3]; free [3,4,2,1]
    assert free_ids(s) == [3, 4, 2, 1]
    # b would hit blocks 1, 2 but needs 7 blocks in all: only 4 usable -> cannot be admitted
    b = make_request("b", prompt[:8] + list(range(500, 520)), max_tokens=1)
    s.add_request(b)
    out = step(s).out
    assert out.num_scheduled_tokens == {}
    assert b.status == RequestStatus.WAITING
    assert b.num_computed_tokens == 0
    assert b.num_cached_tokens == -1  # never admitted
    assert free_ids(s) == [3, 4, 2, 1]
    assert num_free(s) == 4
    assert all(blk.ref_cnt == 0 for blk in
               s.kv_cache_manager.block_pool.free_block_queue.get_all_free_blocks())
    assert s.get_request_counts() == (0, 1)
    # the cached blocks are intact: after b is aborted, a's prompt still hits 8 tokens
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    c = make_request("c", prompt, max_tokens=1)
    _run_one(s, c)
    assert c.num_cached_tokens == 8


# ---------------------------------------------------------------- decode-filled blocks


def test_blocks_filled_by_decoding_become_cacheable():
    s = make_scheduler(block_size=4, num_blocks=20)
    prompt = [1, 2, 3, 4]
    a = make_request("a", prompt, max_tokens=5)
    s.add_request(a)
    for _ in range(5):
        step(s)
    assert a.is_finished()
    # a computed 8 tokens: block 0 = prompt, block 1 = its first 4 outputs (filled by decoding)
    assert len(a.output_token_ids) == 5
    b = make_request("b", prompt + list(a.output_token_ids), max_tokens=1)
    out = _run_one(s, b)
    assert b.num_cached_tokens == 8  # 4 if decode-filled blocks were not cached
    assert out.num_scheduled_tokens == {"b": 1}


# ---------------------------------------------------------------- ref counts, usage, reset


def test_shared_prefix_ref_counts_same_step():
    s = make_scheduler(block_size=4, num_blocks=20)
    shared = list(range(8))
    a = make_request("a", shared + [100], max_tokens=10)
    b = make_request("b", shared + [200], max_tokens=10)
    s.add_request(a)
    s.add_request(b)
    out = step(s).out
    # b hits the blocks a filled in this very step
    assert out.num_scheduled_tokens == {"a": 9, "b": 1}
    assert b.num_cached_tokens == 8
    ids_a = s.kv_cache_manager.get_block_ids("a")
    ids_b = s.kv_cache_manager.get_block_ids("b")
    assert ids_a[:2] == ids_b[:2]
    assert ids_a[2] != ids_b[2]
    assert [block(s, i).ref_cnt for i in ids_a] == [2, 2, 1]
    assert block(s, ids_b[2]).ref_cnt == 1
    free0 = num_free(s)
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    # only a's private block is freed; the shared ones stay held by b
    assert num_free(s) == free0 + 1
    assert [block(s, i).ref_cnt for i in ids_b] == [1, 1, 1]
    assert ids_a[0] not in free_ids(s) and ids_a[1] not in free_ids(s)
    assert free_ids(s)[0] == ids_a[2]  # no hash (1 token): reused first
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert num_free(s) == 19
    assert all(block(s, i).ref_cnt == 0 for i in ids_a + ids_b)


def test_hit_on_free_cached_block_bumps_ref_count():
    s = make_scheduler(block_size=4, num_blocks=20)
    prompt = list(range(9))
    _run_one(s, make_request("a", prompt, max_tokens=1))
    assert block(s, 1).ref_cnt == 0 and block(s, 2).ref_cnt == 0
    b = make_request("b", prompt, max_tokens=5)
    s.add_request(b)
    step(s)
    assert s.kv_cache_manager.get_block_ids("b")[:2] == [1, 2]
    assert block(s, 1).ref_cnt == 1 and block(s, 2).ref_cnt == 1
    assert 1 not in free_ids(s) and 2 not in free_ids(s)


def test_usage():
    s = make_scheduler(block_size=4, num_blocks=11)
    assert s.kv_cache_manager.usage == pytest.approx(0.0)
    s.add_request(make_request("a", 12, max_tokens=3))
    step(s)
    assert s.kv_cache_manager.usage == pytest.approx(0.3)
    step(s)  # 13 tokens -> 4 blocks
    assert s.kv_cache_manager.usage == pytest.approx(0.4)
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.usage == pytest.approx(0.0)


def test_reset_prefix_cache():
    s = make_scheduler(block_size=4, num_blocks=20)
    prompt = list(range(9))
    _run_one(s, make_request("r1", prompt, max_tokens=1))
    s.add_request(make_request("a", 6, max_tokens=10))
    step(s)
    hashes_before = _free_hashes(s)
    assert s.reset_prefix_cache() is False  # a holds blocks
    assert _free_hashes(s) == hashes_before
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert s.reset_prefix_cache() is True
    assert all(h is None for h in _free_hashes(s).values())
    assert num_free(s) == 19
    r2 = make_request("r2", prompt, max_tokens=1)
    _run_one(s, r2)
    assert r2.num_cached_tokens == 0


def test_reset_prefix_cache_keeps_hits_when_refused():
    s = make_scheduler(block_size=4, num_blocks=20)
    prompt = list(range(9))
    _run_one(s, make_request("r1", prompt, max_tokens=1))
    s.add_request(make_request("a", 6, max_tokens=10))
    step(s)
    assert s.reset_prefix_cache() is False
    r2 = make_request("r2", prompt, max_tokens=1)
    s.add_request(r2)
    step(s)
    assert r2.num_cached_tokens == 8
