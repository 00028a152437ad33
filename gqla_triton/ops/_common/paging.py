"""Paged-cache math (one place for it): logical token position -> physical cache row, for the kernels
(``@triton.jit`` helpers) and the references (``page_rows``, ``gather_pages``) alike.

A paged cache is ``[num_pages, page_size, ...]``; sequence ``b`` stores its token ``p`` at row
``block_table[b, p // page_size] * page_size + p % page_size``. A position whose page lies beyond the block
table, or whose block-table entry is outside ``[0, num_pages)``, has no row: every lookup here is masked so
that no position, page index or block-table entry can address memory outside the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .alloc import empty
from .host import on_device


@triton.jit
def logical_to_physical(bt_row_ptr, pos, valid, max_pages, num_pages, PAGE_SIZE: tl.constexpr):
    """Physical row (int64) of logical positions ``pos`` for one sequence's block-table row.

    Returns ``(row, ok)``. ``ok`` is ``valid`` and'ed with: page index inside ``[0, max_pages)`` and block id
    inside ``[0, num_pages)``; rows where ``ok`` is false are 0, so a masked load there is always in bounds.
    """
    page = pos // PAGE_SIZE
    ok = valid & (pos >= 0) & (page < max_pages)
    blk = tl.load(bt_row_ptr + tl.where(ok, page, 0), mask=ok, other=0)
    ok = ok & (blk >= 0) & (blk < num_pages)
    row = tl.where(ok, blk.to(tl.int64) * PAGE_SIZE + (pos % PAGE_SIZE), 0)
    return row, ok


@triton.jit
def table_keys(seqlen, max_pages, PAGE_SIZE: tl.constexpr):
    """Key positions a dense loop covers for a length ``seqlen >= 0``: at most the block table's capacity
    ``max_pages · PAGE_SIZE`` (positions past it have no page, so a length beyond it neither reads nor loops
    there; the validated capacity is <= 2**30)."""
    return tl.minimum(seqlen, max_pages * PAGE_SIZE)


@triton.jit
def split_bounds(seqlen, split_id, num_splits, BLOCK_N: tl.constexpr):
    """Token range ``[start, end)`` of split ``split_id``: equal shares rounded up to ``BLOCK_N``. In int32 for
    ``0 <= seqlen <= 2**30`` and ``num_splits <= 1024`` (the validated bounds: no overflow)."""
    per = tl.cdiv(tl.cdiv(seqlen, num_splits), BLOCK_N) * BLOCK_N
    start = split_id * per
    end = tl.minimum(start + per, seqlen)
    return start, end


def key_capacity(max_pages: int, page_size: int, topk: int | None = None) -> int:
    """Most keys one sequence can attend to, from shapes only: its index row (``topk``, sparse) or what its
    block table addresses (``max_pages · page_size``, dense; ``table_keys`` on the device)."""
    return topk if topk is not None else max_pages * page_size


def page_rows(block_table: torch.Tensor, num_pages: int, page_size: int, length: int):
    """Torch twin of ``logical_to_physical`` for positions ``0 .. length-1``: ``(rows, ok)``, both ``[B, length]``
    (rows int64, 0 where ``ok`` is false)."""
    max_pages = block_table.shape[1]
    pos = torch.arange(length, device=block_table.device)
    page = pos // page_size
    blk = block_table[:, page.clamp(max=max_pages - 1)].long()  # [B, length]
    ok = (page < max_pages)[None, :] & (blk >= 0) & (blk < num_pages)
    return torch.where(ok, blk * page_size + pos % page_size, torch.zeros_like(blk)), ok


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Reference gather: ``cache [num_pages, page_size, ...]`` -> ``[B, length, ...]`` in logical order.

    Positions without a row (``page_rows``) give zeros (the kernels mask them).
    """
    num_pages, page_size = cache.shape[:2]
    B = block_table.shape[0]
    rows, ok = page_rows(block_table.to(cache.device), num_pages, page_size, length)
    flat = cache.reshape(num_pages * page_size, *cache.shape[2:])
    out = flat[rows.reshape(-1)].reshape(B, length, *cache.shape[2:])
    mask = ok.reshape(B, length, *([1] * (cache.dim() - 2)))
    return torch.where(mask, out, torch.zeros((), dtype=out.dtype, device=out.device))


@triton.jit
def sparse_positions(idx_row_ptr, offs, n_valid, seqlen, last_pos):
    """Logical positions of sparse entries ``offs`` of one index row, and which of them count.

    ``n_valid`` = entries of the row that count (``min(topk, topk_length[b])``); an entry counts if it is
    inside that prefix, in ``[0, seqlen)`` and ``<= last_pos`` (the query's position under causal MTP;
    pass ``seqlen - 1`` otherwise). Positions of entries that do not count are 0 (safe to address).
    """
    inside = offs < n_valid
    pos = tl.load(idx_row_ptr + tl.where(inside, offs, 0), mask=inside, other=-1)
    ok = inside & (pos >= 0) & (pos < seqlen) & (pos <= last_pos)
    return tl.where(ok, pos, 0), ok


@triton.jit(do_not_specialize=["topk", "s_q", "NI", "max_pages", "num_pages", "causal", "n_blk"])
def sparse_rows_kernel(indices, block_table, seqlens, topk_length, rows, topk, s_q, NI, max_pages, num_pages, causal,
                       s_btb, n_blk, PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr, HAS_TOPK_LEN: tl.constexpr):
    """One index row (batch entry, query token, index set) x ``BLOCK`` entries: ``rows = page·PAGE_SIZE + slot``
    (int32) of each entry that counts, -1 for the others (``sparse_positions`` then ``logical_to_physical``).
    A 1-D grid of (index rows x ``n_blk`` blocks), so no grid dimension limit applies to the batch."""
    pid = tl.program_id(0)
    pid_k = pid % n_blk
    pid_r = pid // n_blk
    b = pid_r // (s_q * NI)
    qi = (pid_r // NI) % s_q
    offs = pid_k * BLOCK + tl.arange(0, BLOCK)
    n_valid = topk
    if HAS_TOPK_LEN:
        n_valid = tl.maximum(tl.minimum(tl.load(topk_length + b), topk), 0)
    seqlen = tl.maximum(tl.load(seqlens + b), 0)  # a negative length is empty
    last_pos = tl.where(causal != 0, seqlen - s_q + qi, seqlen - 1)
    base = pid_r.to(tl.int64) * topk
    pos, ok = sparse_positions(indices + base, offs, n_valid, seqlen, last_pos)
    row, ok = logical_to_physical(block_table + b.to(tl.int64) * s_btb, pos, ok, max_pages, num_pages, PAGE_SIZE)
    tl.store(rows + base + offs, tl.where(ok, row, -1).to(tl.int32), mask=offs < topk)


def sparse_rows(indices: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                topk_length: torch.Tensor | None, *, page_size: int, num_pages: int, causal: bool) -> torch.Tensor:
    """Translate validated sparse indices once per call, before the attention kernel: ``indices [B, s_q, topk]``
    or ``[B, s_q, g, topk]`` int32 logical positions -> int32 tensor of the same shape holding the physical cache
    row (``page · page_size + slot``) of every entry that counts (``sparse_positions``: inside ``topk_length``,
    in ``[0, seqlen)``, not after the query under ``causal``; page inside the table and the cache) and -1 for
    the others. The kernels then load one row index per key instead of an index and a block-table entry in
    sequence."""
    if num_pages * page_size >= 2**31:
        raise ValueError(f"kv cache: {num_pages} pages x {page_size} tokens exceed int32 row indices (sparse path)")
    idx = indices.contiguous()
    rows = empty(idx.shape, dtype=torch.int32, device=idx.device)
    B, s_q, topk = idx.shape[0], idx.shape[1], idx.shape[-1]
    NI = idx.shape[2] if idx.dim() == 4 else 1
    BLOCK = min(1024, max(16, triton.next_power_of_2(topk)))
    n_blk = triton.cdiv(topk, BLOCK)
    with on_device(idx.device):
        sparse_rows_kernel[(n_blk * B * s_q * NI,)](
            idx, block_table, cache_seqlens, topk_length if topk_length is not None else cache_seqlens, rows, topk, s_q,
            NI, block_table.shape[1], num_pages, int(bool(causal)), block_table.stride(0), n_blk, PAGE_SIZE=page_size,
            BLOCK=BLOCK, HAS_TOPK_LEN=topk_length is not None, num_warps=4)
    return rows
