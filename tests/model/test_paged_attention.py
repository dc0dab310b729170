"""Paged attention against the model's own sdpa forward: fp32 logits must agree to ~1e-4.

Covers a packed multi-sequence prefill, decode steps, a chunked prefill mixed with decodes (in
either order), and a prefix-cache hit on blocks that another sequence fills in the same forward.
Block ids are handed out in shuffled order so that no test passes by contiguity. Each runs with
decode attention gathering blocks and reading per-request rows (minicore/model/decode_kv.py), in
torch and with the native kernel (minicore/model/native.py).
"""

import random

import pytest
import torch
from test_native import native_kernel

from minicore.model.attention import (
    AttentionMetadata,
    GatheredDecode,
    attn_implementation,
    use_paged_attention,
)
from minicore.model.decode_kv import DecodeKVBuffers
from minicore.model.kv_cache_interface import kv_cache_shape

pytestmark = pytest.mark.model

BLOCK_SIZE = 16
NUM_BLOCKS = 96
ATOL = 2e-4
DECODE_PATHS = ["gather", "rows", "native"]



class PagedModel:
    """Minimal stand-in for the runner: a block pool, per-sequence block tables, packed forwards."""

    def __init__(self, model, decode: str):
        self.model = model
        cfg = model.config
        shape = kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [torch.zeros(shape) for _ in range(cfg.num_hidden_layers)]
        self.free = random.Random(0).sample(range(NUM_BLOCKS), NUM_BLOCKS)
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.decode_attention = GatheredDecode() if decode == "gather" else DecodeKVBuffers(
            self.kv_caches, chunk_size=16, kernel=native_kernel() if decode == "native" else None)

    def allocate(self, seq: str, num_new_tokens: int) -> None:
        table = self.tables.setdefault(seq, [])
        total = self.computed.setdefault(seq, 0) + num_new_tokens
        while len(table) * BLOCK_SIZE < total:
            table.append(self.free.pop())

    def share_prefix(self, seq: str, donor: str, num_blocks: int) -> None:
        """Prefix-cache hit: ``seq`` starts with ``donor``'s first blocks, counted as computed."""
        self.tables[seq] = self.tables[donor][:num_blocks]
        self.computed[seq] = num_blocks * BLOCK_SIZE

    def step(self, batch: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """One packed forward; ``batch`` maps sequences to their new tokens. Returns their
        logits."""
        for seq, tokens in batch.items():
            self.allocate(seq, len(tokens))
        computed, num_new = [self.computed[s] for s in batch], [len(t) for t in batch.values()]
        decode_attention = self.decode_attention.plan(list(batch), computed, num_new,
                                                      self.tables)
        meta = AttentionMetadata.build([self.tables[s] for s in batch], computed, num_new,
                                       self.kv_caches, decode_attention)
        input_ids = torch.tensor([t for tokens in batch.values() for t in tokens])[None]
        with torch.inference_mode():
            logits = self.model(
                input_ids=input_ids,
                position_ids=meta.positions[None],
                use_cache=False,
                minicore_meta=meta,
            ).logits[0]
        for seq, tokens in batch.items():
            self.computed[seq] += len(tokens)
        return dict(zip(batch, logits.split([len(t) for t in batch.values()])))

    def reference(self, tokens: list[int]) -> torch.Tensor:
        """Logits of the plain (sdpa, no cache) forward over ``tokens``."""
        with attn_implementation(self.model, "sdpa"), torch.inference_mode():
            return self.model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0]


PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea. " * 5,
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22",
    "Hi",
]


@pytest.fixture(scope="module", params=DECODE_PATHS)
def paged(hf_model_and_tokenizer, request):
    model, tokenizer = hf_model_and_tokenizer
    old = model.config._attn_implementation
    use_paged_attention(model)
    yield PagedModel(model, request.param), [tokenizer(p).input_ids for p in PROMPTS]
    model.set_attn_implementation(old)


def test_packed_prefill_then_decode(paged):
    paged, ids = paged
    out = paged.step({f"s{i}": p for i, p in enumerate(ids)})
    ref = [paged.reference(p) for p in ids]
    for i in range(len(ids)):
        torch.testing.assert_close(out[f"s{i}"], ref[i], atol=ATOL, rtol=0)
    nxt = {f"s{i}": [int(ref[i][-1].argmax())] for i in range(len(ids))}
    out = paged.step(nxt)
    for i, p in enumerate(ids):
        expected = paged.reference(p + nxt[f"s{i}"])[-1]
        torch.testing.assert_close(out[f"s{i}"][-1], expected, atol=ATOL, rtol=0)


def test_chunked_prefill_mixed_with_decode(paged):
    paged, ids = paged
    long, short = ids[1], ids[0]
    ref = paged.reference(long)
    paged.step({"c": long[:21], "d": short})
    first = int(paged.reference(short)[-1].argmax())
    # The decode comes first in one batch and last in the other: order must not matter.
    out = paged.step({"d": [first], "c": long[21:40]})
    torch.testing.assert_close(out["c"], ref[21:40], atol=ATOL, rtol=0)
    out = paged.step({"c": long[40:], "d": [7]})
    torch.testing.assert_close(out["c"], ref[40:], atol=ATOL, rtol=0)
    expected = paged.reference(short + [first, 7])[-1]
    torch.testing.assert_close(out["d"][-1], expected, atol=ATOL, rtol=0)


def test_prefix_hit_on_blocks_filled_in_same_step(paged):
    paged, ids = paged
    donor, hit = ids[1], 2 * BLOCK_SIZE
    assert len(donor) > hit + 5
    new_tokens = donor[hit : hit + 5] + [42, 43, 44]
    # "p" reuses the donor's first two blocks, which this very forward fills; "p" comes first in
    # the batch, so the whole batch's K/V must be written before any sequence attends.
    paged.allocate("donor", len(donor))
    paged.share_prefix("p", "donor", 2)
    out = paged.step({"p": new_tokens, "donor": donor})
    torch.testing.assert_close(out["donor"], paged.reference(donor), atol=ATOL, rtol=0)
    expected = paged.reference(donor[:hit] + new_tokens)[hit:]
    torch.testing.assert_close(out["p"], expected, atol=ATOL, rtol=0)


def _dense_attention(q, k, v, scaling, window, softcap):
    """Eager attention of one whole sequence (``[L, heads, head_dim]``, GQA by repeat), with
    transformers' sliding-window overlay (key j seen from i when i - window < j <= i) and
    soft-cap."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    pos = torch.arange(q.shape[0])
    mask = pos[None, :] <= pos[:, None]
    if window is not None:
        mask &= pos[None, :] > pos[:, None] - window
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("decode", DECODE_PATHS)
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 0.5), (5, 0.5)])
def test_sliding_window_and_softcap(window, softcap, decode):
    """Two steps on a bare layer: "a" is chunk-prefilled (12 tokens, then 8 read against the
    cache), "b" prefilled whole and then decoded; every row must equal dense eager attention."""
    from types import SimpleNamespace

    from minicore.model.attention import paged_attention_forward

    torch.manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 8, 8
    lens = {"a": 20, "b": 14}
    q = {s: torch.randn(n, heads, dim) * 3 for s, n in lens.items()}
    k = {s: torch.randn(n, kv_heads, dim) * 3 for s, n in lens.items()}
    v = {s: torch.randn(n, kv_heads, dim) for s, n in lens.items()}
    tables = {"a": [3, 1, 5], "b": [2, 4]}
    cache = [torch.zeros(kv_cache_shape(8, block, kv_heads, dim))]
    module, out = SimpleNamespace(layer_idx=0), {"a": [], "b": []}
    decode_attention = GatheredDecode() if decode == "gather" else DecodeKVBuffers(
        cache, chunk_size=8, kernel=native_kernel() if decode == "native" else None)
    for step in ({"a": (0, 12), "b": (0, 13)}, {"b": (13, 14), "a": (12, 20)}):
        spans = list(step.values())
        computed, num_new = [a for a, _ in spans], [b - a for a, b in spans]
        meta = AttentionMetadata.build([tables[s] for s in step], computed, num_new, cache,
                                       decode_attention.plan(list(step), computed, num_new, lens))
        pack = [torch.cat([x[s][a:b] for s, (a, b) in step.items()]) for x in (q, k, v)]
        query, key, value = (t.transpose(0, 1)[None] for t in pack)
        res, _ = paged_attention_forward(module, query, key, value, None, dim**-0.5,
                                         sliding_window=window, softcap=softcap,
                                         minicore_meta=meta)
        rows = res[0].split([b - a for a, b in step.values()])
        for s, r in zip(step, rows):
            out[s].append(r)
    for s in lens:
        expected = _dense_attention(q[s], k[s], v[s], dim**-0.5, window, softcap)
        torch.testing.assert_close(torch.cat(out[s]), expected, atol=1e-5, rtol=1e-5)
        if window is not None or softcap is not None:  # the features change the result
            plain = _dense_attention(q[s], k[s], v[s], dim**-0.5, None, None)
            assert not torch.allclose(expected, plain, atol=1e-3)


@pytest.mark.parametrize("kwarg,value,feature", [
    ("s_aux", torch.zeros(4), "attention sinks"), ("is_causal", False, "non-causal"),
    ("position_bias", torch.zeros(1), "relative position bias"),
])
def test_unsupported_attention_argument_is_an_error(kwarg, value, feature):
    """What the loader's check would miss fails loudly rather than computing a wrong answer."""
    from types import SimpleNamespace

    from minicore.model.attention import paged_attention_forward

    cache = [torch.zeros(kv_cache_shape(2, 4, 2, 8))]
    meta = AttentionMetadata.build([[1]], [0], [3], cache)
    q, kv = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match=feature):
        paged_attention_forward(SimpleNamespace(layer_idx=0), q, kv, kv, None, 0.3,
                                minicore_meta=meta, **{kwarg: value})
