"""Per-request KV pools (minicore/model/decode_kv.py) under random traffic, on a bare attention
layer: arrivals (some with prefix-cache hits), chunked prefills, decodes, departures from the
middle of the pools, and, with a tight cache, steps where the pools fit only built afresh or not at
all (the gather runs);
every token's attention output must equal dense causal attention over its sequence's history,
with decode attention in torch and in the native kernel (minicore/model/native.py)."""

import random
from types import SimpleNamespace

import pytest
import torch
from test_native import native_kernel

from minicore.model.attention import (
    GATHERED_DECODE,
    AttentionMetadata,
    GatheredDecode,
    paged_attention_forward,
)
from minicore.model.decode_kv import DecodeKVBuffers, RowKV, _is_whole
from minicore.model.kv_cache_interface import kv_cache_shape

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
        rows = self.pools.plan(list(batch), computed, new, self.seqs)
        planned = isinstance(rows, RowKV)
        self.fallbacks += not planned
        self.pool_steps += planned
        decodes = new.count(1)
        self.whole_steps += planned and len(rows.views) == 1 and _is_whole(rows.views[0], decodes)
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


# A tight cache with chunks of two blocks: pools that keep the room of requests gone stop fitting,
# and built afresh they fit again; with chunks of eight blocks even fresh ones do not, and the
# gather runs.
@pytest.mark.parametrize("num_blocks,chunk_size,expect_fallback",
                         [(4096, 8, False), (40, 8, False), (40, 32, True), (4096, 64, False)],
                         ids=["roomy", "tight", "too-tight", "one-chunk"])
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
    if not native and chunk_size in (8, 64):
        # Small chunks: requests span several pools; one large chunk: some steps take the fast
        # path (every decoding request in pool 0, in order) and some the general one.
        assert (traffic.whole_steps > 0) == (chunk_size == 64)
        assert traffic.whole_steps < traffic.pool_steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_the_rows_plugged_in_attend_as_the_default_gather_does(native, dtype):
    """The attention function with the runner's CPU rows plugged in (decode_kv.py) and with its
    default (GatheredDecode): the same steps, the same outputs (in bfloat16, within its rounding:
    the kernel sums in float32, torch in bfloat16); and rows past the pools' bound plan the
    default for that step."""
    torch.manual_seed(0)
    tables = {"a": [3, 1, 5], "b": [2, 4, 6]}
    caches = [[torch.zeros(kv_cache_shape(8, BLOCK, KV_HEADS, DIM), dtype=dtype)]
              for _ in range(2)]
    backends = [GatheredDecode(), DecodeKVBuffers(caches[1], chunk_size=BLOCK,
                                                  kernel=native_kernel() if native else None)]
    for step in ({"a": (0, 7), "b": (0, 5)}, {"a": (7, 8), "b": (5, 6)},
                 {"b": (6, 7), "a": (8, 9)}):
        computed, new = [a for a, _ in step.values()], [b - a for a, b in step.values()]
        q, k, v = (torch.randn(sum(new), h, DIM, dtype=dtype) for h in (HEADS, KV_HEADS, KV_HEADS))
        outs = []
        for backend, cache in zip(backends, caches):
            meta = AttentionMetadata.build([tables[s] for s in step], computed, new, cache,
                                           backend.plan(list(step), computed, new, tables))
            outs.append(paged_attention_forward(SimpleNamespace(layer_idx=0), *(
                x.transpose(0, 1)[None] for x in (q, k, v)), None, DIM**-0.5,
                minicore_meta=meta)[0])
        assert isinstance(meta.decode_attention, RowKV)
        assert outs[1].dtype == dtype
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(outs[1], outs[0], atol=tolerance, rtol=tolerance)
    small = DecodeKVBuffers([torch.zeros(kv_cache_shape(2, BLOCK, KV_HEADS, DIM))],
                            chunk_size=BLOCK)
    assert small.plan(["x"], [0], [9], {"x"}) is GATHERED_DECODE  # 3 chunks, 2 blocks' slots
