"""Property-based tests (hypothesis) for minicore's scheduler and KV block manager.

Random traces drive a ``Scheduler`` the way the engine core does (schedule -> fake forward ->
update_from_output): random prompts that often share prefixes, random lengths, arrivals, aborts
(between steps and while a step runs), cache salts, both policies, chunked prefill and prefix
caching on/off, tiny budgets and tiny KV caches that force preemption, scheduler_reserve_full_isl
on/off, and requests tied on (priority, arrival_time).

The fake model is a paged "KV cache" of token ids: every scheduled token is written into the slot
its block table gives it, and a request samples by *reading its whole sequence back from its
blocks* and hashing it.  So a wrong prefix-cache hit, a block shared across cache salts, a block
overwritten while still in use, or a wrong ``num_computed_tokens`` all change the generated tokens
(or trip the read-back check) instead of going unnoticed.

After every step: budget, ``max_num_seqs``, ref counts == number of running holders, free queue and
held blocks disjoint and together all usable blocks, the null block never handed out, per-request
token counters within bounds, output bookkeeping (new/cached/preempted/finished ids), the prefix
cache map (several blocks may be cached under one hash), the exact free-queue order after a finish
or abort (freed blocks without a hash at the head, reused first; hashed ones at the tail; a
request's blocks in reverse), long_prefill_token_threshold (applied only when more than one request
is unfinished at the start of schedule()), and the admission rule (with scheduler_reserve_full_isl
an admitted request's whole current sequence fits the free blocks; the request that stopped
admission could not get its blocks).  Every trace finishes (no livelock) under both policies.  At
the end: every request that was not aborted finished with exactly the tokens (and finish reason)
the fake model gives it when run alone without preemption, and every block is free again.

The fake model's sampler masks EOS and the stop ids until min_tokens outputs exist (as vLLM's and
minicore's samplers do; the scheduler's stop check no longer looks at min_tokens), or, in traces
drawn with ``sampler_masks=False``, does not: then an early EOS or stop id stops the request.

A stateful test also checks ``FreeKVCacheBlockQueue`` against a plain list model.

Written against the semantics of vLLM's v1 scheduler (vllm/v1/core/sched/scheduler.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minicore.config import CacheConfig, SchedulerConfig
from minicore.request import FinishReason, Request, RequestStatus
from minicore.sampling_params import SamplingParams
from minicore.scheduler import FreeKVCacheBlockQueue, KVCacheBlock, Scheduler
from minicore.scheduler.output import ModelRunnerOutput

VOCAB = 40  # output vocab of the fake model; prompt tokens are drawn from the same range
MAX_PROMPT = 80


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def note(value: str) -> None:
    """hypothesis.event; a no-op outside a hypothesis test (run_trace from a pinned test)."""
    try:
        event(value)
    except InvalidArgument:
        pass


# ----------------------------------------------------------------------------- fake model


def fake_next_token(seq: list[int]) -> int:
    """Deterministic next token: a function of the whole sequence so far (its length and tail)."""
    n = len(seq)
    a = seq[-1]
    b = seq[-2] if n >= 2 else 7
    c = seq[-3] if n >= 3 else 3
    return (a * 31 + b * 17 + c * 7 + n * 13 + (a * b) % 11) % VOCAB


def fake_sample(seq: list[int], num_output_tokens: int, sp: dict, eos: int | None,
                masks: bool) -> int:
    """The fake model's sampled token. With ``masks``, EOS (unless ignore_eos) and the stop ids
    are blocked until min_tokens outputs exist, as vLLM's MinTokensLogitsProcessor does: the next
    unblocked id is taken instead."""
    t = fake_next_token(seq)
    if masks and num_output_tokens < sp["min_tokens"]:
        blocked = set(sp["stop_token_ids"])
        if eos is not None and not sp["ignore_eos"]:
            blocked.add(eos)
        while t in blocked:
            t = (t + 1) % VOCAB
    return t


def reference_generation(spec: ReqSpec, max_model_len: int, eos: int | None,
                         masks: bool = True):
    """What the fake model generates for ``spec`` run alone, with vLLM's check_stop: EOS (unless
    ignore_eos), then the stop ids, then max_tokens / max_model_len; min_tokens is the sampler's
    business (``masks``).

    Returns (output_token_ids, finish_reason, stop_reason).
    """
    sp = spec.params
    tokens = list(spec.prompt)
    out: list[int] = []
    max_tokens = sp["max_tokens"] if sp["max_tokens"] is not None else float("inf")
    while True:
        t = fake_sample(tokens, len(out), sp, eos, masks)
        tokens.append(t)
        out.append(t)
        if eos is not None and not sp["ignore_eos"] and t == eos:
            return out, FinishReason.STOP, None
        if t in sp["stop_token_ids"]:
            return out, FinishReason.STOP, t
        if len(out) >= max_tokens or len(tokens) >= max_model_len:
            return out, FinishReason.LENGTH, None


# ----------------------------------------------------------------------------- introspection


def _block_pool(s):
    return s.kv_cache_manager.block_pool


def _all_blocks(s) -> list:
    """All KVCacheBlock objects of the pool, index == block id (vLLM: BlockPool.blocks)."""
    bp = _block_pool(s)
    for name in ("blocks", "_blocks", "all_blocks"):
        blocks = getattr(bp, name, None)
        if blocks is not None:
            return list(blocks)
    raise AssertionError("cannot find the block list on BlockPool (expected .blocks)")


def _block_ids(s, req_id: str) -> list[int]:
    try:
        return list(s.kv_cache_manager.get_block_ids(req_id))
    except KeyError:
        return []


def _hash_of(block):
    h = getattr(block, "block_hash", None)
    return h


def check_free_queue(q, expected_count: int | None = None) -> list:
    """Walk the free list head->tail: no duplicates, count matches, links consistent."""
    free = list(q.get_all_free_blocks())
    ids = [b.block_id for b in free]
    assert len(ids) == len(set(ids)), f"free queue has duplicates: {ids}"
    assert len(free) == q.num_free_blocks, (len(free), q.num_free_blocks)
    if expected_count is not None:
        assert len(free) == expected_count
    # If the list exposes vLLM-style links, check them both ways.
    if free and hasattr(free[0], "prev_free_block") and hasattr(free[0], "next_free_block"):
        for i, b in enumerate(free):
            prev = free[i - 1] if i > 0 else None
            nxt = free[i + 1] if i + 1 < len(free) else None
            bp, bn = b.prev_free_block, b.next_free_block
            # Sentinel nodes (fake head/tail) are allowed at the ends.
            if prev is not None:
                assert bp is prev, f"block {b.block_id}: prev link broken"
            if nxt is not None:
                assert bn is nxt, f"block {b.block_id}: next link broken"
    return free


# ----------------------------------------------------------------------------- traces


@dataclass
class ReqSpec:
    req_id: str
    prompt: list[int]
    params: dict
    arrival_step: int
    priority: int
    salt: str | None
    # None: the driver's counter (1.0, 2.0, ... in arrival order); a number ties requests.
    arrival_time: float | None = None


@dataclass
class Trace:
    block_size: int
    num_blocks: int
    max_model_len: int
    budget: int
    max_num_seqs: int
    chunked: bool
    prefix_caching: bool
    policy: str
    threshold: int
    eos: int | None
    reqs: list[ReqSpec]
    # (step, index into reqs or -1 for an unknown id, "before" | "during")
    aborts: list[tuple[int, int, str]] = field(default_factory=list)
    reserve_full_isl: bool = True
    sampler_masks: bool = True


@st.composite
def traces(draw) -> Trace:
    # "pressure" traces: many requests at once, a KV cache just big enough for one of them.
    pressure = draw(st.booleans())
    block_size = draw(st.sampled_from([4, 8]))
    max_model_len = draw(st.integers(8, MAX_PROMPT + 24))
    max_prompt = min(MAX_PROMPT, max_model_len)
    chunked = draw(st.booleans())
    prefix_caching = draw(st.sampled_from([True, True, False]))
    policy = draw(st.sampled_from(["fcfs", "priority"]))
    if chunked:
        budget = draw(st.integers(2, 48))
    else:
        # A resumed request recomputes prompt + outputs (up to max_model_len) in one go.
        budget = draw(st.integers(max_model_len, max_model_len + 40))
    threshold = draw(st.sampled_from([0, 0, 0, 1, 3, 5, 6, 16]))
    max_num_seqs = draw(st.integers(3, 8) if pressure else st.integers(1, 6))
    # Enough for one max-length request, and only a little more: preemption is common.
    num_blocks = cdiv(max_model_len, block_size) + 1 + draw(
        st.integers(0, 2) if pressure else st.integers(0, 12))
    eos = draw(st.sampled_from([None, None, 5, 11]))

    # A few shared "documents" so prompts share (block-aligned and unaligned) prefixes often.
    docs = [draw(st.lists(st.integers(0, VOCAB - 1), min_size=MAX_PROMPT, max_size=MAX_PROMPT))
            for _ in range(2)]
    n_req = draw(st.integers(5, 12) if pressure else st.integers(1, 8))
    salts = draw(st.sampled_from([[None], [None], [None, "x"], ["x", "y", None]]))
    reserve_full_isl = draw(st.booleans())
    sampler_masks = draw(st.sampled_from([True, True, False]))
    # "later-better": later arrivals get better priorities, so a running request's victim is
    # often one scheduled earlier in the same step.
    later_better = policy == "priority" and draw(st.booleans())
    # "tied": every request has the same arrival_time, and under the priority policy few distinct
    # priorities, so (priority, arrival_time) ties are common: the issue-11 livelock (two tied
    # requests evicting each other forever) needs them. Only with reserve_full_isl: without it,
    # two tied requests can still evict each other forever, as in minicore before issue 11 (the
    # case of test_tied_priority_requests_finish, prefix caching off: 995 preemptions in 3,000
    # steps), and vLLM has no other rule against it.
    tied = not later_better and reserve_full_isl and draw(st.booleans())
    reqs = []
    for i in range(n_req):
        length = draw(st.integers(1, max_prompt))
        kind = draw(st.sampled_from(["doc", "doc", "doc", "doc+tail", "doc+tail", "random",
                                     "tiny-vocab"]))
        if kind == "doc":
            d = docs[draw(st.integers(0, len(docs) - 1))]
            prompt = d[:length]
        elif kind == "doc+tail":
            d = docs[draw(st.integers(0, len(docs) - 1))]
            head = draw(st.integers(0, length))
            tail = draw(st.lists(st.integers(0, VOCAB - 1), min_size=length - head,
                                 max_size=length - head))
            prompt = d[:head] + tail
        elif kind == "random":
            prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=length, max_size=length))
        else:
            prompt = draw(st.lists(st.integers(0, 1), min_size=length, max_size=length))
        max_tokens = draw(st.one_of(st.integers(1, 24), st.integers(1, 24), st.none()))
        min_tokens = draw(st.sampled_from([0, 0, 0, 1, 3, 6]))
        if max_tokens is not None:
            min_tokens = min(min_tokens, max_tokens)
        params = dict(
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            ignore_eos=draw(st.booleans()) if eos is not None else False,
            stop_token_ids=draw(st.one_of(
                st.sampled_from([[], [], [3], [2, 17]]),
                st.lists(st.integers(0, VOCAB - 1), min_size=3, max_size=10, unique=True))),
        )
        arrival_step = draw(st.integers(0, 3) if pressure else st.integers(0, 12))
        if later_better:
            priority = -arrival_step
        elif tied:
            priority = draw(st.sampled_from([0, 0, 0, 1])) if policy == "priority" else 0
        else:
            priority = draw(st.integers(-2, 2)) if policy == "priority" else 0
        reqs.append(ReqSpec(
            req_id=f"r{i}",
            prompt=prompt,
            params=params,
            arrival_step=arrival_step,
            priority=priority,
            salt=draw(st.sampled_from(salts)),
            arrival_time=0.0 if tied else None,
        ))
    aborts = draw(st.lists(
        st.tuples(st.integers(0, 60), st.integers(-1, n_req - 1),
                  st.sampled_from(["before", "during"])),
        max_size=3))
    return Trace(block_size, num_blocks, max_model_len, budget, max_num_seqs, chunked,
                 prefix_caching, policy, threshold, eos, reqs, aborts, reserve_full_isl,
                 sampler_masks)


# ----------------------------------------------------------------------------- invariants


def check_invariants(s, t: Trace, where: str) -> None:
    bp = _block_pool(s)
    blocks = _all_blocks(s)
    assert len(blocks) == t.num_blocks, (len(blocks), t.num_blocks)
    assert all(b.block_id == i for i, b in enumerate(blocks)), "blocks[i].block_id != i"

    running_ids = [r.request_id for r in s.running]
    waiting_ids = [r.request_id for r in s.waiting]
    assert len(running_ids) == len(set(running_ids)), f"{where}: duplicate in running"
    assert len(waiting_ids) == len(set(waiting_ids)), f"{where}: duplicate in waiting"
    assert not set(running_ids) & set(waiting_ids), f"{where}: request both running and waiting"
    assert set(running_ids) | set(waiting_ids) == set(s.requests), (
        f"{where}: running+waiting != requests: {running_ids} {waiting_ids} {list(s.requests)}")
    assert len(s.running) <= t.max_num_seqs, f"{where}: {len(s.running)} > max_num_seqs"
    assert s.get_request_counts() == (len(s.running), len(s.waiting))
    assert s.get_num_unfinished_requests() == len(s.requests)
    assert s.has_unfinished_requests() == bool(s.requests)

    holders: dict[int, int] = {}
    held: set[int] = set()
    for r in s.running:
        assert r.status == RequestStatus.RUNNING, (
            f"{where}: {r.request_id} in running is {r.status}")
        assert 0 <= r.num_computed_tokens <= r.num_tokens, (
            f"{where}: {r.request_id} computed {r.num_computed_tokens} > tokens {r.num_tokens}")
        assert r.num_computed_tokens <= t.max_model_len
        assert r.num_tokens <= t.max_model_len, (
            f"{where}: unfinished {r.request_id} has {r.num_tokens} tokens > max_model_len")
        ids = _block_ids(s, r.request_id)
        assert 0 not in ids, f"{where}: null block handed to {r.request_id}"
        assert len(ids) == len(set(ids)), f"{where}: {r.request_id} holds a block twice: {ids}"
        assert len(ids) == cdiv(r.num_computed_tokens, t.block_size), (
            f"{where}: {r.request_id} holds {len(ids)} blocks for {r.num_computed_tokens} "
            f"computed tokens (block_size {t.block_size})")
        for b in ids:
            holders[b] = holders.get(b, 0) + 1
            held.add(b)
    for r in s.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), (
            f"{where}: {r.request_id} in waiting is {r.status}")
        assert r.num_computed_tokens == 0, f"{where}: waiting {r.request_id} has computed tokens"
        assert _block_ids(s, r.request_id) == [], f"{where}: waiting {r.request_id} holds blocks"
        assert r.num_tokens <= t.max_model_len

    free = check_free_queue(bp.free_block_queue)
    free_ids = {b.block_id for b in free}
    assert bp.get_num_free_blocks() == len(free)
    assert 0 not in free_ids, f"{where}: null block in the free queue"
    assert not free_ids & held, f"{where}: blocks both free and held: {sorted(free_ids & held)}"
    assert free_ids | held == set(range(1, t.num_blocks)), (
        f"{where}: leaked blocks {sorted(set(range(1, t.num_blocks)) - free_ids - held)}")
    for b in blocks[1:]:
        assert b.ref_cnt == holders.get(b.block_id, 0), (
            f"{where}: block {b.block_id} ref_cnt {b.ref_cnt} but held by "
            f"{holders.get(b.block_id, 0)} running requests")
    usage = s.kv_cache_manager.usage
    assert abs(usage - (1 - len(free) / (t.num_blocks - 1))) < 1e-9

    # The prefix cache map: hash -> {block id: block}, several blocks per hash allowed; exactly
    # the blocks that carry a hash are in it, under that hash; a lookup gives the first cached.
    cache_map = bp.cached_block_hash_to_block
    in_map = set()
    for h, by_id in cache_map.items():
        assert by_id, f"{where}: empty entry for a hash in the prefix cache map"
        for bid, b in by_id.items():
            assert b is blocks[bid] and b.block_hash == h, (
                f"{where}: block {bid} is cached under a hash it does not carry")
            in_map.add(bid)
        assert bp.get_cached_block(h) is next(iter(by_id.values())), where
    hashed = {b.block_id for b in blocks if b.block_hash is not None}
    assert hashed == in_map, (
        f"{where}: blocks with a hash {sorted(hashed)} != blocks in the prefix cache map "
        f"{sorted(in_map)}")
    if not t.prefix_caching:
        assert not hashed, f"{where}: blocks hashed with prefix caching disabled"
    else:
        # Every full block a running request has computed (or is computing this step) is cached
        # under its hash, even when another block is already cached under the same hash (vLLM
        # 0.32 keeps them all: the recomputed copy stays a hit when the first copy is evicted).
        for r in s.running:
            ids = _block_ids(s, r.request_id)
            num_full = r.num_computed_tokens // t.block_size
            assert len(r.block_hashes) >= num_full, where
            for i in range(num_full):
                assert blocks[ids[i]].block_hash == r.block_hashes[i], (
                    f"{where}: {r.request_id}'s full block {i} (block {ids[i]}) is not cached "
                    f"under its hash")

    stats = s.kv_cache_manager.prefix_cache_stats
    assert 0 <= stats.hits <= stats.queries
    if not t.prefix_caching:
        assert stats.hits == 0, f"{where}: prefix hits with prefix caching disabled"


def check_admission(s, t: Trace, out, where: str, free_prev: set[int], threshold: int) -> None:
    """The waiting pass's KV rule, replayed from the step's result. Admitting a request takes its
    prefix-hit blocks and its new blocks out of the free queue; with reserve_full_isl the free
    blocks left must still be able to hold the rest of its whole current sequence. And the
    request at the head of the waiting queue that was not admitted, with budget and a seat left,
    must have been refused its blocks (or, without chunked prefill, the budget)."""
    if out.preempted_req_ids:
        return  # nothing is admitted in a step that preempted
    bs = t.block_size
    kv = s.kv_cache_manager
    new_ids = [d.req_id for d in out.scheduled_new_reqs]
    # No preemption: the running pass only took blocks from the free queue.
    free = set(free_prev)
    for rid in out.scheduled_cached_reqs.req_ids:
        free -= set(_block_ids(s, rid))
    for rid in new_ids:
        r = s.requests[rid]
        held = _block_ids(s, rid)
        free -= set(held)
        if t.reserve_full_isl:
            assert cdiv(r.num_tokens, bs) - len(held) <= len(free), (
                f"{where}: {rid} admitted with {len(held)} blocks, {len(free)} free, but its "
                f"whole sequence ({r.num_tokens} tokens) needs {cdiv(r.num_tokens, bs)}")
    assert len(free) == _block_pool(s).get_num_free_blocks(), where
    budget_left = t.budget - out.total_num_scheduled_tokens
    if not s.waiting or budget_left <= 0 or len(s.running) >= t.max_num_seqs:
        return
    head = s.waiting.peek_request()
    hits, num_computed = kv.get_computed_blocks(head)
    num_new = head.num_tokens - num_computed
    if 0 < threshold < num_new:
        num_new = threshold
    if not t.chunked and num_new > budget_left:
        note("admission stopped: prompt over the budget without chunking")
        return
    num_new = min(num_new, budget_left)
    free_eff = len(free) - sum(1 for b in hits if b.ref_cnt == 0)
    chunk_short = cdiv(num_computed + num_new, bs) - len(hits) > free_eff
    whole_short = t.reserve_full_isl and cdiv(head.num_tokens, bs) - len(hits) > free_eff
    assert chunk_short or whole_short, (
        f"{where}: {head.request_id} ({head.num_tokens} tokens, {num_computed} hit) not admitted "
        f"with {budget_left} budget, {free_eff} usable free blocks and a seat left")
    if whole_short and not chunk_short:
        note("admission stopped: whole sequence does not fit, its chunk would")


# ----------------------------------------------------------------------------- driver


def run_trace(t: Trace, step_cap: int = 4000):
    s = Scheduler(
        SchedulerConfig(max_num_seqs=t.max_num_seqs, max_num_batched_tokens=t.budget,
                        max_model_len=t.max_model_len, long_prefill_token_threshold=t.threshold,
                        enable_chunked_prefill=t.chunked, policy=t.policy,
                        scheduler_reserve_full_isl=t.reserve_full_isl),
        CacheConfig(block_size=t.block_size, num_blocks=t.num_blocks,
                    enable_prefix_caching=t.prefix_caching),
    )
    bs = t.block_size
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == t.num_blocks - 1
    check_invariants(s, t, "init")
    # Priority victims unscheduled after being scheduled in the same step: the scheduler calls
    # uncache_blocks_after for exactly those.
    unscheduled_victims: list[str] = []
    uncache = s.kv_cache_manager.uncache_blocks_after

    def spy_uncache(request, num_computed_tokens):
        unscheduled_victims.append(request.request_id)
        return uncache(request, num_computed_tokens)

    s.kv_cache_manager.uncache_blocks_after = spy_uncache

    by_step: dict[int, list[ReqSpec]] = {}
    for spec in t.reqs:
        by_step.setdefault(spec.arrival_step, []).append(spec)
    aborts: dict[tuple[int, str], list[int]] = {}
    for step, idx, when in t.aborts:
        aborts.setdefault((step, when), []).append(idx)

    reqs: dict[str, Request] = {}
    spec_params = {spec.req_id: spec.params for spec in t.reqs}
    aborted: set[str] = set()
    streamed: dict[str, list[int]] = {}        # concatenated EngineCoreOutput.new_token_ids
    final_out: dict[str, object] = {}          # last EngineCoreOutput with a finish_reason
    # Fake paged KV: block id -> slots of (token id, cache salt) as written by the forward.
    kv: dict[int, list] = {b: [None] * bs for b in range(t.num_blocks)}
    finished_since_schedule: set[str] = set()
    preempt_events = 0
    arrival = 0.0
    # Shadow of the waiting queue in spec order (FCFS: arrival order, preempted to the front).
    shadow_waiting: list[str] = []

    def prio_key(rid: str):
        """Victim order: the victim is the running request with the largest key."""
        r = reqs[rid]
        return (r.priority, r.arrival_time)

    def queue_key(rid: str):
        """Priority waiting-queue order: the request id breaks exact (priority, arrival) ties."""
        return (*prio_key(rid), rid)

    def free_snapshot():
        """(free queue ids head to tail, ref_cnt of every block)."""
        return ([b.block_id for b in _block_pool(s).free_block_queue.get_all_free_blocks()],
                [b.ref_cnt for b in _all_blocks(s)])

    def check_freed(snapshot, freed: list[tuple[str, list[int]]], where: str) -> None:
        """The free queue after finishing requests in the given order, each holding the given
        blocks: a request's blocks are released in reverse (its last block first); those no
        longer used go to the free queue, without a hash to the head (the first released first,
        reused first), with a hash to the tail (the first released first, evicted first)."""
        queue, ref_cnt = list(snapshot[0]), list(snapshot[1])
        blocks = _all_blocks(s)
        for _, held in freed:
            head = []
            for b in reversed(held):
                ref_cnt[b] -= 1
                if ref_cnt[b] == 0:
                    (head if _hash_of(blocks[b]) is None else queue).append(b)
            queue[:0] = head
        got = free_snapshot()[0]
        assert got == queue, (
            f"{where}: free queue {got}, expected {queue} after freeing "
            f"{[(rid, held) for rid, held in freed]} (hashed: "
            f"{[b for _, held in freed for b in held if _hash_of(blocks[b]) is not None]})")

    def abort(idx: int) -> None:
        rid = t.reqs[idx].req_id if idx >= 0 else "no-such-request"
        r = reqs.get(rid)
        was_finished = r is None or r.is_finished()
        before = (r.status, list(r.output_token_ids)) if r is not None else None
        held_before = _block_ids(s, rid)
        snapshot = free_snapshot()
        s.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
        if r is None:
            return
        if was_finished:  # finished ids are ignored: nothing changes
            assert (r.status, list(r.output_token_ids)) == before
            return
        assert r.status == RequestStatus.FINISHED_ABORTED
        assert r.get_finished_reason() == FinishReason.ABORT
        assert rid not in s.requests
        aborted.add(rid)
        if rid in shadow_waiting:
            shadow_waiting.remove(rid)
        check_freed(snapshot, [(rid, held_before)], f"abort of {rid}")
        assert _block_ids(s, rid) == []
        finished_since_schedule.add(rid)

    step = 0
    last_arrival = max(spec.arrival_step for spec in t.reqs)
    while step <= last_arrival or s.has_unfinished_requests():
        assert step < step_cap, (
            f"no progress: {step} steps, running={[r.request_id for r in s.running]} "
            f"waiting={[r.request_id for r in s.waiting]}")
        for spec in by_step.get(step, []):
            arrival += 1.0
            r = Request(request_id=spec.req_id, prompt_token_ids=list(spec.prompt),
                        sampling_params=SamplingParams(**spec.params), eos_token_id=t.eos,
                        arrival_time=arrival if spec.arrival_time is None else spec.arrival_time,
                        priority=spec.priority, cache_salt=spec.salt)
            s.add_request(r)
            shadow_waiting.append(spec.req_id)
            reqs[spec.req_id] = r
        for idx in aborts.get((step, "before"), []):
            abort(idx)
        check_invariants(s, t, f"step {step} before schedule")

        status_before = {rid: r.status for rid, r in s.requests.items()}
        computed_before = {rid: r.num_computed_tokens for rid, r in s.requests.items()}
        preempt_total_before = s.num_preemptions
        running_before = [r.request_id for r in s.running]
        held_prev = {rid: set(_block_ids(s, rid)) for rid in running_before}
        free_prev = {b.block_id for b in _block_pool(s).free_block_queue.get_all_free_blocks()}
        hash_prev = [_hash_of(b) for b in _all_blocks(s)]
        if t.policy == "priority":
            expected_admission = sorted(shadow_waiting, key=queue_key)
        else:
            expected_admission = list(shadow_waiting)
        # vLLM applies long_prefill_token_threshold only when more than one request is unfinished
        # at the start of schedule(): a lone request has nobody to starve.
        lone = s.get_num_unfinished_requests() == 1
        threshold = 0 if lone else t.threshold

        out = s.schedule()
        where = f"step {step} after schedule"

        # --- scheduler output bookkeeping
        nst = out.num_scheduled_tokens
        assert out.total_num_scheduled_tokens == sum(nst.values()), where
        assert out.total_num_scheduled_tokens <= t.budget, (
            f"{where}: {out.total_num_scheduled_tokens} tokens > budget {t.budget}")
        assert all(n > 0 for n in nst.values()), f"{where}: zero-token entry {nst}"
        new_ids = [d.req_id for d in out.scheduled_new_reqs]
        cached_ids = list(out.scheduled_cached_reqs.req_ids)
        assert len(new_ids) == len(set(new_ids)) and len(cached_ids) == len(set(cached_ids))
        assert not set(new_ids) & set(cached_ids), where
        assert set(new_ids) | set(cached_ids) == set(nst), (
            f"{where}: new {new_ids} + cached {cached_ids} != scheduled {list(nst)}")
        for rid in new_ids:
            assert status_before[rid] in (RequestStatus.WAITING, RequestStatus.PREEMPTED), (
                f"{where}: {rid} listed as new but was {status_before[rid]}")
        for rid in cached_ids:
            assert status_before[rid] == RequestStatus.RUNNING, (
                f"{where}: {rid} listed as cached but was {status_before[rid]}")
        preempted = list(out.preempted_req_ids)
        assert len(preempted) == len(set(preempted))
        preempt_events += len(preempted)
        assert s.num_preemptions - preempt_total_before == len(preempted), where
        if preempted:
            assert not new_ids, f"{where}: admitted {new_ids} in a step that preempted {preempted}"
        # Victims: FCFS takes them from the end of running; priority the worst (priority, arrival).
        if preempted:
            if t.policy == "fcfs":
                tail = running_before[len(running_before) - len(preempted):]
                assert set(tail) == set(preempted), (
                    f"{where}: FCFS preempted {preempted}, running was {running_before}")
                preempted_in_order = [rid for rid in running_before if rid in set(preempted)]
            else:
                worst_kept = max((prio_key(r.request_id) for r in s.running), default=None)
                for rid in preempted:
                    assert worst_kept is None or prio_key(rid) >= worst_kept, (
                        f"{where}: priority preempted {rid} {prio_key(rid)} but kept {worst_kept}")
                preempted_in_order = sorted(preempted, key=queue_key)
            shadow_waiting[:0] = preempted_in_order
        # Admission order: the head of the waiting queue, in policy order.
        assert new_ids == expected_admission[: len(new_ids)], (
            f"{where}: admitted {new_ids}, queue order was {expected_admission}")
        for rid in new_ids:
            shadow_waiting.remove(rid)
        # RUNNING pass: the previously running requests that got tokens form a prefix of
        # s.running (nothing is skipped); a tail left out with budget to spare means the pass
        # stopped on preempting the request it was scheduling.
        prev_running_now = [r.request_id for r in s.running if r.request_id in set(running_before)]
        flags = [rid in nst for rid in prev_running_now]
        assert flags == sorted(flags, reverse=True), (
            f"{where}: running pass skipped a request: running {prev_running_now}, "
            f"scheduled {list(nst)}")
        if not all(flags) and out.total_num_scheduled_tokens < t.budget:
            assert preempted, (
                f"{where}: running requests left unscheduled with budget left "
                f"({out.total_num_scheduled_tokens}/{t.budget}) and no preemption")
        for rid in preempted:
            r = s.requests[rid]
            assert rid not in nst, f"{where}: preempted {rid} still scheduled"
            assert r.status == RequestStatus.PREEMPTED and r.num_computed_tokens == 0, where
            assert status_before[rid] == RequestStatus.RUNNING, where
        assert set(out.finished_req_ids) == finished_since_schedule, (
            f"{where}: finished_req_ids {set(out.finished_req_ids)} != "
            f"{finished_since_schedule}")
        finished_since_schedule = set()
        if threshold > 0:
            assert all(n <= threshold for n in nst.values()), f"{where}: threshold {nst}"
        for rid, n in nst.items():
            r = s.requests[rid]
            assert r.status == RequestStatus.RUNNING, where
            start = r.num_computed_tokens - n
            if lone:
                # Alone: as many tokens as it has left, up to the budget (no threshold cut).
                assert n == min(r.num_tokens - start, t.budget), (
                    f"{where}: lone {rid} got {n} of {r.num_tokens - start} tokens left "
                    f"(budget {t.budget}, threshold {t.threshold})")
                if t.threshold and n > t.threshold:
                    note("lone request past long_prefill_token_threshold")
            if rid in cached_ids:
                assert r.num_computed_tokens == computed_before[rid] + n, (
                    f"{where}: {rid} computed {computed_before[rid]} + {n} != "
                    f"{r.num_computed_tokens}")
            else:
                start = r.num_computed_tokens - n
                assert start >= 0 and start % bs == 0, (
                    f"{where}: {rid} admitted with a prefix hit of {start} tokens "
                    f"(not block aligned)")
                assert start <= r.num_tokens - 1, f"{where}: {rid} full hit computes nothing"
                if start and not t.prefix_caching:
                    raise AssertionError(f"{where}: prefix hit {start} with caching off")
                if not t.chunked and threshold == 0:
                    assert r.num_computed_tokens == r.num_tokens, (
                        f"{where}: {rid} chunked without chunked prefill")
            if not t.chunked and threshold == 0 and rid in cached_ids:
                assert r.num_computed_tokens == r.num_tokens, where
        check_admission(s, t, out, where, free_prev, threshold)
        check_invariants(s, t, where)

        # --- fake forward: write scheduled tokens into the paged KV, then sample by reading back.
        # A block handed out afresh this step holds garbage for its new owner: clear it first.
        # Fresh = a scheduled request's block past its prefix hit that it did not hold before, or
        # a block that was free before this step and got a new hash (taken, then freed again by
        # a preemption within the step).
        blocks_now = _all_blocks(s)
        fresh: set[int] = set()
        for rid, n in nst.items():
            ids = _block_ids(s, rid)
            if rid in held_prev:
                fresh.update(b for b in ids if b not in held_prev[rid])
            else:
                fresh.update(ids[(s.requests[rid].num_computed_tokens - n) // bs:])
        for b in free_prev:
            h = _hash_of(blocks_now[b])
            if h is not None and h != hash_prev[b]:
                fresh.add(b)
        for b in fresh:
            kv[b] = [None] * bs
        sampled: dict[str, list[int]] = {}
        for rid, n in nst.items():
            r = s.requests[rid]
            ids = _block_ids(s, rid)
            toks = r.all_token_ids
            for p in range(r.num_computed_tokens - n, r.num_computed_tokens):
                kv[ids[p // bs]][p % bs] = (toks[p], r.cache_salt)
        # Every block in the prefix cache must hold computed KV once this step's forward is done:
        # a hit on it skips computing those positions.
        for b in blocks_now[1:]:
            if _hash_of(b) is not None and None in kv[b.block_id]:
                raise AssertionError(
                    f"{where}: block {b.block_id} is in the prefix cache (ref_cnt {b.ref_cnt}) "
                    f"but its KV was never computed: {kv[b.block_id]}")
        for rid in nst:
            r = s.requests[rid]
            if r.num_computed_tokens < r.num_tokens:
                sampled[rid] = []
                continue
            ids = _block_ids(s, rid)
            seen = [kv[ids[p // bs]][p % bs] for p in range(r.num_computed_tokens)]
            expect = [(tok, r.cache_salt) for tok in r.all_token_ids[: r.num_computed_tokens]]
            if seen != expect:
                bad = next(p for p in range(len(seen)) if seen[p] != expect[p])
                raise AssertionError(
                    f"{where}: KV of {rid} is wrong at position {bad} (block "
                    f"{ids[bad // bs]}): read {seen[bad]}, expected {expect[bad]}; "
                    f"num_cached_tokens={r.num_cached_tokens}")
            sampled[rid] = [fake_sample([tok for tok, _ in seen], r.num_output_tokens,
                                        spec_params[rid], t.eos, t.sampler_masks)]

        for idx in aborts.get((step, "during"), []):
            abort(idx)

        req_ids = list(nst)
        mro = ModelRunnerOutput(req_ids=req_ids,
                                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=[sampled[r] for r in req_ids])
        alive_before = {rid for rid in nst if rid in s.requests}
        held_before = {rid: _block_ids(s, rid) for rid in alive_before}
        snapshot = free_snapshot()
        outputs = s.update_from_output(out, mro)
        got = set()
        for o in outputs:
            assert o.request_id not in got, f"step {step}: two outputs for {o.request_id}"
            got.add(o.request_id)
            assert o.request_id not in aborted, f"step {step}: output for aborted {o.request_id}"
            assert o.new_token_ids, f"step {step}: empty output for {o.request_id}"
            streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                final_out[o.request_id] = o
        expected_out = {rid for rid in alive_before if sampled[rid]}
        assert got == expected_out, f"step {step}: outputs for {got}, expected {expected_out}"
        for rid in alive_before:
            r = reqs[rid]
            if r.is_finished():
                finished_since_schedule.add(rid)
                assert rid not in s.requests
                assert _block_ids(s, rid) == []
        # Finished requests are freed in the order of their outputs (the runner's order).
        finished_order = [o.request_id for o in outputs if o.finish_reason is not None]
        assert set(finished_order) == {rid for rid in alive_before if reqs[rid].is_finished()}
        check_freed(snapshot, [(rid, held_before[rid]) for rid in finished_order],
                    f"step {step} update")
        check_invariants(s, t, f"step {step} after update")
        step += 1

    # --- end state
    bp = _block_pool(s)
    assert bp.get_num_free_blocks() == t.num_blocks - 1, "blocks still held after all finished"
    check_free_queue(bp.free_block_queue, t.num_blocks - 1)
    assert all(b.ref_cnt == 0 for b in _all_blocks(s))
    assert not s.running and not len(s.waiting) and not s.requests
    assert s.num_preemptions == preempt_events == sum(r.num_preemptions for r in reqs.values())

    for spec in t.reqs:
        r = reqs[spec.req_id]
        ref, reason, stop_reason = reference_generation(spec, t.max_model_len, t.eos,
                                                        t.sampler_masks)
        out_ids = list(r.output_token_ids)
        assert r.all_token_ids == list(spec.prompt) + out_ids
        assert streamed.get(spec.req_id, []) == out_ids, (
            f"{spec.req_id}: streamed {streamed.get(spec.req_id)} != output {out_ids}")
        if spec.req_id in aborted:
            assert r.status == RequestStatus.FINISHED_ABORTED
            assert out_ids == ref[: len(out_ids)], (
                f"aborted {spec.req_id}: {out_ids} is not a prefix of {ref}")
            continue
        assert out_ids == ref, (
            f"{spec.req_id} (prompt len {len(spec.prompt)}, params {spec.params}, preempted "
            f"{r.num_preemptions}x): got {out_ids}, reference {ref}")
        assert r.get_finished_reason() == reason, (
            f"{spec.req_id}: finish reason {r.get_finished_reason()} != {reason}, tokens {ref}")
        assert r.stop_reason == stop_reason, (spec.req_id, r.stop_reason, stop_reason)
        if t.sampler_masks and reason == FinishReason.STOP:
            assert len(out_ids) >= spec.params["min_tokens"], (spec.req_id, out_ids)
        expected_status = (RequestStatus.FINISHED_STOPPED if reason == FinishReason.STOP
                           else RequestStatus.FINISHED_LENGTH_CAPPED)
        assert r.status == expected_status
        o = final_out[spec.req_id]
        assert o.finish_reason == reason and o.stop_reason == stop_reason
        assert r.num_cached_tokens >= 0 and r.num_cached_tokens % bs == 0
        assert r.num_cached_tokens <= r.num_prompt_tokens - 1
        if not t.prefix_caching:
            assert r.num_cached_tokens == 0
    if unscheduled_victims:
        note("a priority victim was unscheduled in the step that scheduled it")
    return s, step, unscheduled_victims


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(traces())
def test_random_traces(t: Trace) -> None:
    s, steps, _ = run_trace(t)
    # Coverage of the interesting corners (pytest --hypothesis-show-statistics).
    event(f"preempted: {'yes' if s.num_preemptions else 'no'}")
    event(f"prefix hits: {'yes' if s.kv_cache_manager.prefix_cache_stats.hits else 'no'}")
    event(f"policy {t.policy}, chunked {t.chunked}, prefix caching {t.prefix_caching}")
    event(f"reserve_full_isl {t.reserve_full_isl}, sampler masks {t.sampler_masks}")
    if len({(r.priority, r.arrival_time) for r in t.reqs if r.arrival_time is not None}) < sum(
            r.arrival_time is not None for r in t.reqs):
        event(f"{t.policy}: requests tied on (priority, arrival_time)")


# Pinned configurations, so that the hard corners are always visited whatever hypothesis draws.
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_pinned_heavy_preemption(policy: str, chunked: bool, prefix_caching: bool) -> None:
    import random

    rng = random.Random(1234)
    doc = [rng.randrange(VOCAB) for _ in range(MAX_PROMPT)]
    max_model_len = 64
    reqs = []
    for i in range(10):
        n = rng.randint(1, max_model_len)
        prompt = doc[:n] if i % 2 else [rng.randrange(VOCAB) for _ in range(n)]
        reqs.append(ReqSpec(f"r{i}", prompt,
                            dict(max_tokens=rng.randint(1, 24), min_tokens=0, ignore_eos=False,
                                 stop_token_ids=[]),
                            arrival_step=rng.randint(0, 4),
                            priority=rng.randint(-2, 2) if policy == "priority" else 0,
                            salt=rng.choice([None, None, "s"])))
    t = Trace(block_size=4, num_blocks=cdiv(max_model_len, 4) + 3, max_model_len=max_model_len,
              budget=24 if chunked else max_model_len, max_num_seqs=4, chunked=chunked,
              prefix_caching=prefix_caching, policy=policy, threshold=0, eos=None, reqs=reqs,
              aborts=[(6, 3, "during"), (9, 4, "before")])
    s, _, _ = run_trace(t)
    assert s.num_preemptions > 0, "pinned trace was meant to preempt"


def test_unscheduled_priority_victim_leaves_no_uncomputed_block_cached() -> None:
    """A priority victim that was already scheduled this step is unscheduled and freed; blocks
    its (now cancelled) chunk would have filled must not stay in the prefix cache, or a later hit
    (here: the victim itself on resume) reads KV that was never computed.

    7 usable blocks of 4, chunks of 6 (long_prefill_token_threshold; D, one token, is there at
    step 0 so that V is not alone, which would lift the threshold).  Step 0: V (priority 1,
    18-token prompt) computes 0..5, D its token (D finishes).  Step 1: V computes 6..11 (3 blocks);
    C (priority 0, 12 tokens: 3 blocks, and 4 are free, so scheduler_reserve_full_isl admits it)
    is admitted with 0..5.  Step 2: V is scheduled for 12..17 (its block 3, positions 12..15,
    becomes full and is hashed; the pool is now empty), then C cannot get a block, V is the worst
    running request and is preempted, its tokens handed back.  C finishes (max_tokens=1).
    Step 3: V resumes; a prefix hit on block 3 would skip positions 12..15, never computed.
    """
    params = dict(min_tokens=0, ignore_eos=False, stop_token_ids=[])
    v = ReqSpec("V", list(range(1, 19)), dict(max_tokens=4, **params),
                arrival_step=0, priority=1, salt=None)
    d = ReqSpec("D", [33], dict(max_tokens=1, **params), arrival_step=0, priority=0, salt=None)
    c = ReqSpec("C", list(range(20, 32)), dict(max_tokens=1, **params),
                arrival_step=1, priority=0, salt=None)
    t = Trace(block_size=4, num_blocks=8, max_model_len=24, budget=64, max_num_seqs=4,
              chunked=True, prefix_caching=True, policy="priority", threshold=6, eos=None,
              reqs=[v, d, c], reserve_full_isl=True)
    s, _, unscheduled_victims = run_trace(t)
    assert unscheduled_victims == ["V"], "the victim was meant to be scheduled in that step"
    assert s.num_preemptions == 1


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_tied_priority_requests_finish(policy: str, prefix_caching: bool) -> None:
    """Issue 11's livelock: under the priority policy two requests with equal (priority,
    arrival_time) used to evict each other forever (without prefix caching: 995 preemptions in
    3,000 steps; vLLM 0.32 finishes in 28 steps).  The victim is the first running request with
    the worst key; the preempted one is admitted again behind the other as soon as its chunk
    fits, so the next time a block is short the victim is the other one, and so on.
    scheduler_reserve_full_isl admits a request only once its whole sequence fits, which breaks
    the cycle (minicore: 27 steps, one preemption, under both policies).
    Block size 4, 8 usable blocks, budget 8, threshold 4; r0: 2 tokens, max_tokens 20; r1: 12
    tokens, max_tokens 14."""
    params = dict(min_tokens=0, ignore_eos=False, stop_token_ids=[])
    r0 = ReqSpec("r0", list(range(1, 3)), dict(max_tokens=20, **params),
                 arrival_step=0, priority=0, salt=None, arrival_time=0.0)
    r1 = ReqSpec("r1", list(range(3, 15)), dict(max_tokens=14, **params),
                 arrival_step=0, priority=0, salt=None, arrival_time=0.0)
    t = Trace(block_size=4, num_blocks=9, max_model_len=64, budget=8, max_num_seqs=8,
              chunked=True, prefix_caching=prefix_caching, policy=policy, threshold=4, eos=None,
              reqs=[r0, r1], reserve_full_isl=True)
    s, steps, _ = run_trace(t, step_cap=100)  # asserts that both finish within 100 steps
    assert steps <= 28 and s.num_preemptions <= 1, (steps, s.num_preemptions)


# ----------------------------------------------------------------------------- free queue


class FreeQueueMachine(RuleBasedStateMachine):
    """FreeKVCacheBlockQueue against a plain list: popleft / remove / append / prepend_n keep the
    same order."""

    @initialize(n=st.integers(0, 12))
    def setup(self, n: int) -> None:
        self.blocks = [KVCacheBlock(block_id=i) for i in range(n)]
        self.q = FreeKVCacheBlockQueue(list(self.blocks))
        self.model = list(self.blocks)
        self.out: list = []

    @precondition(lambda self: bool(self.model))
    @rule()
    def popleft(self) -> None:
        b = self.q.popleft()
        assert b is self.model.pop(0)
        self.out.append(b)

    @precondition(lambda self: not self.model)
    @rule()
    def popleft_empty(self) -> None:
        with pytest.raises(ValueError):
            self.q.popleft()

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def remove(self, data) -> None:
        b = data.draw(st.sampled_from(self.model))
        self.q.remove(b)
        self.model.remove(b)
        self.out.append(b)

    @precondition(lambda self: bool(self.out))
    @rule(data=st.data())
    def append(self, data) -> None:
        b = data.draw(st.sampled_from(self.out))
        self.out.remove(b)
        self.q.append(b)
        self.model.append(b)

    @precondition(lambda self: bool(self.out))
    @rule(data=st.data())
    def prepend_n(self, data) -> None:
        """Blocks freed without a hash go to the head, the first given first (reused first)."""
        blocks = data.draw(st.lists(st.sampled_from(self.out), min_size=1, unique_by=id))
        for b in blocks:
            self.out.remove(b)
        self.q.prepend_n(blocks)
        self.model[:0] = blocks

    @invariant()
    def same_order(self) -> None:
        if not hasattr(self, "q"):
            return
        assert self.q.num_free_blocks == len(self.model)
        got = check_free_queue(self.q, len(self.model))
        assert [b.block_id for b in got] == [b.block_id for b in self.model]


FreeQueueMachine.TestCase.settings = settings(max_examples=60, deadline=None,
                                              stateful_step_count=40)
TestFreeKVCacheBlockQueue = FreeQueueMachine.TestCase
