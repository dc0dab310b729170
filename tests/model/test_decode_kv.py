"""Per-request KV pools (minicore/model/decode_kv.py) under random traffic, on a bare attention
layer: arrivals (some with prefix-cache hits), chunked prefills, decodes, departures from the
middle of the pools, and, with a tight cache, steps where the pools do not fit (the gather runs);
every token's attention output must equal dense causal attention over its sequence's history,
with decode attention in torch and in the native kernel (minicore/model/native.py)."""

import random
from types import SimpleNamespace

import pytest
import torch
from test_native import native_kernel

from minicore.model.attention import AttentionMetadata, kv_cache_shape, paged_attention_forward
from minicore.model.decode_kv import DecodeKVBuffers, _is_whole

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4


def _dense(q, k, v):
    """Causal attention of the last len(q) positions over all of k, v ([L, heads, dim])."""
    k, v = (x.repeat_interleave(HEADS // KV_HEADS, dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * DIM**-0.5
    first = k.shape[0] - q.shape[0]
    mask = torch.arange(k.shape[0]) <= first + torch.arange(q.shape[0])[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)


class Traffic:
    def __init__(self, num_blocks: int, chunk_size: int, seed: int, kernel=None):
        self.rng = random.Random(seed)
        self.cache = [torch.zeros(kv_cache_shape(num_blocks, BLOCK, KV_HEADS, DIM))]
        self.free = list(range(1, num_blocks))
        self.pools = DecodeKVBuffers(self.cache, chunk_size=chunk_size, kernel=kernel)
        self.seqs: dict[str, dict] = {}
        self.refs = [0] * num_blocks
        self.fallbacks = self.pool_steps = self.whole_steps = 0

    def arrive(self, name: str) -> None:
        prompt = self.rng.randint(1, 40)
        donors = [s for s in self.seqs.values() if s["done"] >= BLOCK]
        seq = {"prompt": prompt, "done": 0, "table": [],
               "k": torch.empty(0, KV_HEADS, DIM), "v": torch.empty(0, KV_HEADS, DIM)}
        if donors and self.rng.random() < 0.4:  # a prefix-cache hit on a donor's full blocks
            donor = self.rng.choice(donors)
            shared = self.rng.randint(1, donor["done"] // BLOCK)
            seq["table"], seq["done"] = donor["table"][:shared], shared * BLOCK
            for block in seq["table"]:
                self.refs[block] += 1
            seq["k"], seq["v"] = donor["k"][:seq["done"]], donor["v"][:seq["done"]]
            seq["prompt"] = max(prompt, seq["done"] + 1)
        self.seqs[name] = seq

    def leave(self, name: str) -> None:
        for block in self.seqs.pop(name)["table"]:
            self.refs[block] -= 1
            if not self.refs[block]:
                self.free.append(block)

    def step(self) -> None:
        batch = {}
        for name, seq in self.seqs.items():
            left = seq["prompt"] - seq["done"]
            batch[name] = min(left, self.rng.randint(1, 9)) if left > 0 else 1
            while len(seq["table"]) * BLOCK < seq["done"] + batch[name]:
                seq["table"].append(self.free.pop())  # a shared block is never written again
                self.refs[seq["table"][-1]] = 1
        computed = [self.seqs[s]["done"] for s in batch]
        new = list(batch.values())
        rows = self.pools.plan(list(batch), computed, [c + n for c, n in zip(computed, new)],
                               [i for i, n in enumerate(new) if n == 1], set(self.seqs))
        self.fallbacks += rows is None
        self.pool_steps += rows is not None
        decodes = new.count(1)
        self.whole_steps += bool(rows and len(rows.views) == 1 and _is_whole(rows.views[0], decodes))
        meta = AttentionMetadata.build([self.seqs[s]["table"] for s in batch], computed, new,
                                       self.cache, rows)
        q, k, v = (torch.randn(sum(new), h, DIM) for h in (HEADS, KV_HEADS, KV_HEADS))
        out, _ = paged_attention_forward(SimpleNamespace(layer_idx=0), *(
            x.transpose(0, 1)[None] for x in (q, k, v)), None, DIM**-0.5, minicore_meta=meta)
        for (name, n), q_s, k_s, v_s, out_s in zip(batch.items(), q.split(new), k.split(new),
                                                   v.split(new), out[0].split(new)):
            seq = self.seqs[name]
            seq["k"], seq["v"] = torch.cat([seq["k"], k_s]), torch.cat([seq["v"], v_s])
            seq["done"] += n
            torch.testing.assert_close(out_s, _dense(q_s, seq["k"], seq["v"]),
                                       atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_blocks,chunk_size,expect_fallback",
                         [(4096, 8, False), (40, 8, True), (4096, 64, False)],
                         ids=["roomy", "tight", "one-chunk"])
@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_pools_under_random_traffic(num_blocks, chunk_size, expect_fallback, native):
    traffic = Traffic(num_blocks, chunk_size, seed=num_blocks + chunk_size,
                      kernel=native_kernel() if native else None)
    names = iter(range(10**6))
    for _ in range(6):
        traffic.arrive(str(next(names)))
    for _ in range(60):
        traffic.step()
        for name in list(traffic.seqs):
            if traffic.rng.random() < 0.08:  # leaves, freeing a slot inside each of its pools
                traffic.leave(name)
        while len(traffic.free) < 3 * len(traffic.seqs):  # preempted: no blocks for a step
            traffic.leave(traffic.rng.choice(list(traffic.seqs)))
        while len(traffic.seqs) < 3 or (traffic.rng.random() < 0.15 and len(traffic.free) > 16):
            traffic.arrive(str(next(names)))
    assert traffic.pool_steps > 20
    assert (traffic.fallbacks > 0) == expect_fallback
    if not native:
        # Small chunks: requests span several pools; one large chunk: some steps take the fast
        # path (every decoding request in pool 0, in order) and some the general one.
        assert (traffic.whole_steps > 0) == (chunk_size == 64)
        assert traffic.whole_steps < traffic.pool_steps
