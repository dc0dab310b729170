"""Per-request contiguous copies of the KV cache, so that decode attention needs no per-step gather.

vLLM's CPU backend reads the paged cache in place with its own kernels
(``vllm/v1/attention/backends/cpu_attn.py`` and csrc/cpu); torch has no paged attention op, and
gathering every decoding sequence's blocks into one padded batch each step copied the whole live
KV cache once per layer per step (10% of a 64-sequence decode step, and the same memory traffic
again as the attention itself). Instead each running request keeps a row of a per-layer buffer
``[2, rows, max_len, kv_heads, head_dim]`` (the paged cache's layout with a row as one long
block), like vLLM's persistent ``InputBatch`` keeps a row per request: the step's new keys and
values are written into both caches, and decode attention reads the rows as a view, padded to the
longest decoding sequence, over every row in use (an idle row attends to its position 0 and its
output is dropped).

The paged cache stays the source of truth (prefix caching, chunked prefill, prefill attention
read it). A row whose request arrives with tokens already computed (a prefix-cache hit) is filled
from the paged cache once. The buffers never hold more slots than the paged cache, so they at most
double the KV memory; a step that would need more drops them and falls back to the gather. CPU
only: on CUDA the KV cache is sized from the free memory and has nothing to spare.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class RowKV:
    """One step's view of the buffers, handed to the attention through AttentionMetadata."""
    buffers: list[torch.Tensor]  # per layer [2, rows_cap, max_len, kv_heads, head_dim]
    slots: torch.Tensor  # [T] int64, row * max_len + position of each new token
    fills: list[tuple[int, int]]  # (sequence, row): rows to copy from the paged cache first
    decode_rows: torch.Tensor  # [Bd] int64, the rows of the decoding sequences, in their order
    num_rows: int  # rows attended: every row below the highest in use
    mask: torch.Tensor  # [rows, 1, 1, S] bool, True below a decoding row's seq_len
    seq_lens: torch.Tensor  # [rows, 1, 1, 1] int64 (1 for rows not decoding), for windows
    in_order: bool  # decode_rows is 0..rows-1: the queries need no scatter, the outputs no gather


class DecodeKVBuffers:
    """Rows of per-request KV, assigned to requests as they come and freed as they leave."""

    def __init__(self, kv_caches: list[torch.Tensor], max_model_len: int):
        _, num_blocks, block_size, self.num_kv_heads, self.head_dim = kv_caches[0].shape
        self.num_layers, self.dtype = len(kv_caches), kv_caches[0].dtype
        self.max_slots = num_blocks * block_size
        self.max_model_len = max_model_len
        self.buffers: list[torch.Tensor] | None = None
        self.rows: dict[str, int] = {}
        self.free: list[int] = []  # heap of freed rows below len(self.rows) + len(self.free)

    def plan(self, req_ids: list[str], computed: list[int], seq_lens: list[int],
             decodes: list[int], live: set[str]) -> RowKV | None:
        """Rows for this step's sequences (in batch order), or None: use the gather this step."""
        self._release([r for r in self.rows if r not in live])
        fills = []
        for seq, (req_id, done) in enumerate(zip(req_ids, computed)):
            if req_id not in self.rows:
                self.rows[req_id] = heapq.heappop(self.free) if self.free else len(self.rows)
                if done:
                    fills.append((seq, self.rows[req_id]))
        rows = [self.rows[r] for r in req_ids]
        num_rows = max(self.rows.values()) + 1
        if not self._reserve(num_rows, max(seq_lens)):
            self.rows.clear()  # rebuilt, and refilled, when they fit again
            self.free.clear()
            return None
        return self._row_kv(rows, computed, seq_lens, decodes, fills, num_rows)

    def _release(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            heapq.heappush(self.free, self.rows.pop(req_id))

    def _reserve(self, num_rows: int, length: int) -> bool:
        """Grow the buffers (rows and length to the next power of two, length up to
        max_model_len) to hold num_rows rows of length; False past the paged cache's slots."""
        old = self.buffers
        have_rows, have_len = (old[0].shape[1], old[0].shape[2]) if old else (0, 0)
        if num_rows <= have_rows and length <= have_len:
            return True
        new_rows = max(have_rows, 1 << (num_rows - 1).bit_length())
        new_len = max(have_len, min(1 << (length - 1).bit_length(), self.max_model_len), length)
        if new_rows * new_len > self.max_slots:
            self.buffers = None
            return False
        shape = (2, new_rows, new_len, self.num_kv_heads, self.head_dim)
        self.buffers = [torch.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)]
        if old:
            for new, prev in zip(self.buffers, old):
                new[:, :have_rows, :have_len] = prev
        return True

    def _row_kv(self, rows: list[int], computed: list[int], seq_lens: list[int],
                decodes: list[int], fills: list[tuple[int, int]], num_rows: int) -> RowKV:
        max_len = self.buffers[0].shape[2]
        slots = [row * max_len + pos for row, start, end in zip(rows, computed, seq_lens)
                 for pos in range(start, end)]
        row_lens = [1] * num_rows
        for seq in decodes:
            row_lens[rows[seq]] = seq_lens[seq]
        lens = torch.tensor(row_lens)
        width = max(seq_lens[seq] for seq in decodes) if decodes else 1
        decode_rows = [rows[seq] for seq in decodes]
        return RowKV(self.buffers, torch.tensor(slots, dtype=torch.int64),
                     fills, torch.tensor(decode_rows, dtype=torch.int64),
                     num_rows, (torch.arange(width) < lens[:, None])[:, None, None, :],
                     lens.view(-1, 1, 1, 1), decode_rows == list(range(num_rows)))


def fill_rows(buffer: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
              seq_lens: list[int], fills: list[tuple[int, int]]) -> None:
    """Copy each fill sequence's keys and values out of the paged cache into its row."""
    block_size = kv_cache.shape[2]
    for seq, row in fills:
        seq_len = seq_lens[seq]
        blocks = block_tables[seq, :-(-seq_len // block_size)]
        kv = kv_cache.index_select(1, blocks).flatten(1, 2)
        buffer[:, row, :seq_len] = kv[:, :seq_len]
