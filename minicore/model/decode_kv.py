"""Per-request KV rows, pooled by chunk, so that CPU decode attention reads keys without a gather.

vLLM's CPU backend reads the paged cache in place with its own kernels
(``vllm/v1/attention/backends/cpu_attn.py`` and csrc/cpu); torch has no paged attention op, and
gathering every decoding sequence's blocks into one padded batch copies the whole live KV cache
once per layer per step. Instead the KV of each running request is also kept in rows that batched
matmuls read as views, like vLLM's persistent ``InputBatch`` keeps a row per request. A request's
positions are cut into chunks of ``chunk_size`` (256); chunk ``j`` of every request lives in pool
``j``, a per-layer buffer ``[2, slots, kv_heads, chunk_size, head_dim]`` (MLA's latent rows: one
entry, not two) whose used slots are kept
dense (a leaving request's slot takes the pool's last one). Decode attention reads each request's
live rows in place: with the native kernel (native.py) where it builds, else in torch, chunk by
chunk, one matmul over the used slots of that pool, up to the end of each request's last chunk,
whatever the mix of lengths (one padded buffer per step would read every row to the longest
sequence's length). Scores of all chunks meet in one softmax; when one pool holds every decoding
request in order (contexts within one chunk, the common case at 256), the torch path is just two
matmuls and a softmax.

The paged cache stays the source of truth (prefix caching, chunked prefill and prefill attention
read it); every new token is written to both. A request that arrives with tokens already computed
(a prefix-cache hit) has them copied from the paged cache once. The pools never hold more slots
than the paged cache, so they at most double the KV memory; a step that would need more builds
them afresh (they keep the room of requests gone), and only if even those do not fit drops them
for the gather. CPU only: on CUDA the KV cache is sized from the free
memory and has nothing to spare. The runner plugs DecodeKVBuffers in on CPU at construction as the
decode attention of minicore/model/attention.py (DecodeAttention): its plan for a step, a RowKV,
updates the rows and attends; the kernel or torch is chosen once, when the buffers are built.
With token_queries (batch invariance, --batch-invariant) every token of the step, prefill and
drafts included, is a query of the kernel over its own prefix (its softmax too is the kernel's,
over that prefix alone).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Container
from dataclasses import dataclass

import torch

from minicore.model.attention import GATHERED_DECODE, AttentionMetadata, GatheredDecode
from minicore.model.native import KERNEL_DTYPES, decode_attention

CHUNK_SIZE = 256


@dataclass(slots=True)
class ChunkView:
    """What decode attention reads of one pool this step."""
    chunk: int  # pool index: positions [chunk * chunk_size, ... + width)
    num_slots: int  # slots 0..num_slots-1 are read
    width: int  # positions read, up to the longest decoding request's end in this chunk
    decode_index: torch.Tensor | None  # [num_slots] each slot's decode row (Bd: not decoding);
    # None when slot i is decode row i
    mask: torch.Tensor | None  # [num_slots, 1, 1, width] bool, True below the request's length;
    # None when every position read is valid


@dataclass(slots=True)
class RowKV:
    """One step's plan: the DecodeAttention (attention.py) the runner's AttentionMetadata
    carries while the pools fit."""
    pools: list[list[torch.Tensor]]  # per chunk, per layer [entries, capacity, heads, chunk, dim]
    chunk_size: int
    writes: list[tuple[int, torch.Tensor | None, torch.Tensor]]  # (chunk, token rows or None
    # for all of them, [tokens, kv_heads] flat index of each token's heads in the pool)
    fills: list[tuple[int, list[int], int]]  # (sequence, its slots, its computed tokens): to
    # copy from the paged cache
    max_len: int  # longest decoding sequence
    attention: Callable[..., torch.Tensor]  # kernel_decode_attention or pooled_decode_attention
    views: list[ChunkView]  # the pools decode attention reads (empty when the kernel reads)
    kernel: ctypes.CDLL | None  # native.py's decode attention, which reads through:
    slots: torch.Tensor | None  # [decoding sequences, chunks] each one's slot in each pool
    pointers: torch.Tensor | None  # [layers, 2, chunks] addresses of the key and value pools

    def update_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor,
                  kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        pools = [chunk[layer] for chunk in self.pools]
        write_rows(pools, key, value, self)
        fill_rows(pools, kv_cache, meta.block_tables, self)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, layer: int,
               meta: AttentionMetadata, scaling: float, window: int | None,
               softcap: float | None) -> torch.Tensor:
        return self.attention(q, layer, self, meta.decode_seq_lens, scaling, window, softcap)


class DecodeKVBuffers:
    """The pools, and which request holds which slot of each."""

    def __init__(self, kv_caches: list[torch.Tensor], chunk_size: int = CHUNK_SIZE,
                 kernel: ctypes.CDLL | None = None, token_queries: bool = False):
        # A one-entry cache (MLA's latent rows) gets one-entry pools: its keys are its values.
        self.num_entries, num_blocks, block_size, self.num_kv_heads, self.head_dim = (
            kv_caches[0].shape)
        self.num_layers, self.dtype = len(kv_caches), kv_caches[0].dtype
        self.kernel = kernel if self.dtype in KERNEL_DTYPES else None
        # How decode attention reads the pools, chosen once: the kernel, else torch over views.
        self._reads = self._kernel_reads if self.kernel is not None else self._view_reads
        # Which sequences' tokens are queries (chosen once): those decoding, or every token.
        self._queries = _every_token if token_queries else _decoding
        self.max_slots = num_blocks * block_size
        # Every token's attention must read the pools, never the gather: in chunks of a block
        # they hold what the paged cache holds, so that built afresh they always fit.
        self.chunk_size = block_size if token_queries else chunk_size
        self._drop_pools()

    def _drop_pools(self) -> None:
        self.pools: list[list[torch.Tensor]] = []
        # Per pool, [layers, 2] addresses of its key and value buffers, kept as the pools are
        # (rebuilt each step they cost a data_ptr() per layer and pool).
        self.addresses: list[torch.Tensor] = []
        self.owners: list[list[str]] = []  # per pool, the request of each used slot
        self.slots: dict[str, list[int]] = {}  # per request, its slot in pool 0, 1, ...

    def plan(self, req_ids: list[str], computed: list[int], num_new: list[int],
             live: Container[str]) -> RowKV | GatheredDecode:
        """This step's writes and reads (sequences in batch order; live: every request the
        runner holds), or, when the pools do not fit even built afresh, the gather for this
        step."""
        seq_lens = [c + n for c, n in zip(computed, num_new)]
        decodes = self._queries(num_new)
        for req_id in [r for r in self.slots if r not in live]:
            self._release(req_id)
        fills = self._place(req_ids, computed, seq_lens)
        if not self._reserve():
            # The pools keep the room of requests gone: built afresh, they may fit. The step's
            # requests are filled from the paged cache now, the others when next scheduled.
            self._drop_pools()
            fills = self._place(req_ids, computed, seq_lens)
            if not self._reserve():
                self._drop_pools()  # refilled when they fit again
                return GATHERED_DECODE
        return RowKV(self.pools, self.chunk_size, self._writes(req_ids, computed, seq_lens),
                     [(seq, self.slots[req_ids[seq]], computed[seq]) for seq in fills],
                     max((seq_lens[seq] for seq in decodes), default=0),
                     *self._reads(req_ids, seq_lens, decodes))

    def _place(self, req_ids: list[str], computed: list[int], seq_lens: list[int]) -> list[int]:
        """Give each sequence slots up to its length; the ones to fill from the paged cache (new
        here, with tokens already computed)."""
        fills = []
        for seq, (req_id, done, seq_len) in enumerate(zip(req_ids, computed, seq_lens)):
            if req_id not in self.slots and done:
                fills.append(seq)
            self._extend(req_id, -(-seq_len // self.chunk_size))
        return fills

    def _kernel_reads(self, req_ids: list[str], seq_lens: list[int], decodes: list[int]):
        """RowKV's reads for the kernel: each decoding sequence's slots, the pools' addresses."""
        return (kernel_decode_attention, [], self.kernel, self._decode_slots(req_ids, decodes),
                self._pointers())

    def _view_reads(self, req_ids: list[str], seq_lens: list[int], decodes: list[int]):
        """RowKV's reads for torch: one view per pool that a decoding sequence reaches."""
        return pooled_decode_attention, self._views(req_ids, seq_lens, decodes), None, None, None

    def _extend(self, req_id: str, num_chunks: int) -> None:
        slots = self.slots.setdefault(req_id, [])
        for chunk in range(len(slots), num_chunks):
            if chunk == len(self.owners):
                self.owners.append([])
            slots.append(len(self.owners[chunk]))
            self.owners[chunk].append(req_id)

    def _release(self, req_id: str) -> None:
        """Free the request's slots, moving each pool's last slot into the hole."""
        for chunk, slot in enumerate(self.slots.pop(req_id)):
            owners = self.owners[chunk]
            last = len(owners) - 1
            if slot != last and chunk < len(self.pools):
                for pool in self.pools[chunk]:
                    pool[:, slot] = pool[:, last]
            owners[slot] = owners[last]
            owners.pop()
            if slot != last:
                self.slots[owners[slot]][chunk] = slot

    def _reserve(self) -> bool:
        """Grow each pool to its used slots (doubling when that fits); False past the paged
        cache's slots."""
        caps = [pools[0].shape[1] if pools else 0 for pools in self.pools]
        caps += [0] * (len(self.owners) - len(caps))
        needed = [max(cap, len(owners)) for cap, owners in zip(caps, self.owners)]
        if sum(needed) * self.chunk_size > self.max_slots:
            return False
        grown = [2 * cap if used > cap else cap for cap, used in zip(caps, needed)]
        new_caps = ([max(g, n) for g, n in zip(grown, needed)]
                    if sum(map(max, grown, needed)) * self.chunk_size <= self.max_slots
                    else needed)
        for chunk, (cap, new_cap) in enumerate(zip(caps, new_caps)):
            if new_cap > cap:
                self._grow(chunk, new_cap)
        return True

    def _grow(self, chunk: int, capacity: int) -> None:
        shape = (self.num_entries, capacity, self.num_kv_heads, self.chunk_size, self.head_dim)
        new = [torch.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)]
        addresses = torch.tensor([[p.data_ptr(), p[-1].data_ptr()] for p in new])
        if chunk < len(self.pools):
            for pool, old in zip(new, self.pools[chunk]):
                pool[:, :old.shape[1]] = old
            self.pools[chunk], self.addresses[chunk] = new, addresses
        else:
            self.pools.append(new)
            self.addresses.append(addresses)

    def _writes(self, req_ids, computed, seq_lens):
        """Per pool: which of the step's tokens go there, at which flat index of each head."""
        chunk_size, heads = self.chunk_size, self.num_kv_heads
        per_chunk: dict[int, tuple[list[int], list[int]]] = {}
        token = 0
        for req_id, start, end in zip(req_ids, computed, seq_lens):
            slots = self.slots[req_id]
            for pos in range(start, end):
                chunk, offset = divmod(pos, chunk_size)
                rows, flat = per_chunk.setdefault(chunk, ([], []))
                rows.append(token)
                flat.append(slots[chunk] * heads * chunk_size + offset)
                token += 1
        head_offsets = torch.arange(heads) * chunk_size
        return [(chunk, None if len(rows) == token else torch.tensor(rows),
                 torch.tensor(flat)[:, None] + head_offsets)
                for chunk, (rows, flat) in per_chunk.items()]

    def _decode_slots(self, req_ids: list[str], decodes: list[int]) -> torch.Tensor:
        slots = [self.slots[req_ids[seq]] for seq in decodes]
        width = max(map(len, slots), default=0)
        return torch.tensor([s + [0] * (width - len(s)) for s in slots], dtype=torch.int64)

    def _pointers(self) -> torch.Tensor:
        """Per layer, the addresses of each chunk's key pool and value pool."""
        if not self.addresses:
            return torch.empty(self.num_layers, 2, 0, dtype=torch.int64)
        return torch.stack(self.addresses, dim=-1)

    def _views(self, req_ids, seq_lens, decodes) -> list[ChunkView]:
        decode_of = {req_ids[seq]: (row, seq_lens[seq]) for row, seq in enumerate(decodes)}
        views = []
        for chunk, owners in enumerate(self.owners):
            start = chunk * self.chunk_size
            rows = [decode_of.get(r, (len(decodes), 0)) for r in owners]
            width = min(self.chunk_size, max((length for _, length in rows), default=0) - start)
            if width <= 0:
                continue  # no decoding request reaches this chunk
            index = [row for row, _ in rows]
            lens = torch.tensor([length - start for _, length in rows])
            mask = (torch.arange(width) < lens[:, None])[:, None, None, :]
            views.append(ChunkView(
                chunk, len(owners), width,
                None if index == list(range(len(owners))) else torch.tensor(index),
                None if bool(mask.all()) else mask))
        return views


def _decoding(num_new: list[int]) -> list[int]:
    """The query sequences of a step: those with one new token."""
    return [seq for seq, n in enumerate(num_new) if n == 1]


def _every_token(num_new: list[int]) -> list[int]:
    """The sequence of each of the step's tokens, in batch order."""
    return [seq for seq, n in enumerate(num_new) for _ in range(n)]


def write_rows(pools: list[torch.Tensor], key: torch.Tensor, value: torch.Tensor,
               rows: RowKV) -> None:
    """Store the step's ``key``/``value`` (``[T, kv_heads, head_dim]``) of one layer in the
    pools (``pools``: that layer's buffer of each chunk)."""
    head_dim = key.shape[-1]
    for chunk, tokens, flat in rows.writes:
        for buffer, new in zip(pools[chunk], (key, value)):
            new = new if tokens is None else new.index_select(0, tokens)
            buffer.view(-1, head_dim).index_copy_(0, flat.flatten(), new.reshape(-1, head_dim))


def fill_rows(pools: list[torch.Tensor], kv_cache: torch.Tensor, block_tables: torch.Tensor,
              rows: RowKV) -> None:
    """Copy each fill sequence's computed tokens out of the paged cache (that layer's) into its
    slots."""
    block_size, chunk_size = kv_cache.shape[2], rows.chunk_size
    for seq, slots, done in rows.fills:
        blocks = block_tables[seq, :-(-done // block_size)]
        kv = kv_cache.index_select(1, blocks).flatten(1, 2)  # [2, positions, kv_heads, dim]
        for chunk, start in enumerate(range(0, done, chunk_size)):
            width = min(chunk_size, done - start)
            pools[chunk][:, slots[chunk], :, :width] = kv[:, start:start + width].transpose(1, 2)


def kernel_decode_attention(q: torch.Tensor, layer: int, rows: RowKV, seq_lens: torch.Tensor,
                            scaling: float, window: int | None,
                            softcap: float | None) -> torch.Tensor:
    """pooled_decode_attention by the native kernel (native.py; docs/BENCHMARKS.md)."""
    return decode_attention(rows.kernel, q, rows.pointers[layer], rows.slots, seq_lens.view(-1),
                            rows.chunk_size, rows.max_len, scaling, window, softcap,
                            rows.pools[0][layer].dtype)


def pooled_decode_attention(q: torch.Tensor, layer: int, rows: RowKV, seq_lens: torch.Tensor,
                            scaling: float, window: int | None,
                            softcap: float | None) -> torch.Tensor:
    """Decode attention of ``q`` (``[Bd, kv_heads, group, head_dim]``, the decoding sequences in
    order; ``seq_lens`` ``[Bd, 1, 1, 1]``) over the pools of ``layer``, in torch: per chunk, one
    matmul over its used slots for the scores, one softmax over every chunk's scores, per chunk
    one matmul for the values. Slots of requests that are not decoding this step land in an extra
    row, dropped. Plain matmuls rather than SDPA: for decode's few query rows per KV head, SDPA's
    CPU flash kernel is slower (docs/BENCHMARKS.md); and they take the soft-cap, which
    SDPA has not."""
    pools = [chunk[layer] for chunk in rows.pools]
    num_seqs = q.shape[0]
    if window is None and len(rows.views) == 1 and _is_whole(rows.views[0], num_seqs):
        # One pool holds every decoding sequence, in order (the uniform case): no scatter.
        view = rows.views[0]
        rows_kv = pools[0][:, :num_seqs, :, :view.width]
        keys, values = rows_kv[0], rows_kv[-1]
        scores = _chunk_scores(q, keys, view, scaling, softcap)
        return torch.matmul(torch.softmax(scores, dim=-1), values)
    q = torch.cat([q, q.new_zeros(1, *q.shape[1:])])
    scores = q.new_full((*q.shape[:3], rows.max_len), float("-inf"))
    for view in rows.views:
        keys = pools[view.chunk][0, :view.num_slots, :, :view.width]
        part = _chunk_scores(_slot_rows(q, view), keys, view, scaling, softcap)
        columns = scores[..., _positions(view, rows.chunk_size)]
        if view.decode_index is None:
            columns[:view.num_slots] = part
        else:
            columns.index_copy_(0, view.decode_index, part)
    if window is not None:
        kv_pos = torch.arange(rows.max_len)
        scores[:num_seqs].masked_fill_(kv_pos < seq_lens - window, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.zeros_like(q)
    for view in rows.views:
        values = pools[view.chunk][-1, :view.num_slots, :, :view.width]
        part = torch.matmul(_slot_rows(probs[..., _positions(view, rows.chunk_size)], view), values)
        if view.decode_index is None:
            out[:view.num_slots] += part
        else:
            out.index_add_(0, view.decode_index, part)
    return out[:num_seqs]


def _is_whole(view: ChunkView, num_seqs: int) -> bool:
    return view.chunk == 0 and view.decode_index is None and view.num_slots == num_seqs


def _chunk_scores(q: torch.Tensor, keys: torch.Tensor, view: ChunkView, scaling: float,
                  softcap: float | None) -> torch.Tensor:
    """Scaled (and capped) scores of q's rows over a chunk's keys, -inf past each length."""
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if view.mask is not None:
        scores.masked_fill_(~view.mask, float("-inf"))
    return scores


def _slot_rows(x: torch.Tensor, view: ChunkView) -> torch.Tensor:
    """The rows of ``x`` (one per decoding sequence, plus the extra one) of the view's slots."""
    if view.decode_index is None:
        return x[:view.num_slots]
    return x.index_select(0, view.decode_index)


def _positions(view: ChunkView, chunk_size: int) -> slice:
    start = view.chunk * chunk_size
    return slice(start, start + view.width)
