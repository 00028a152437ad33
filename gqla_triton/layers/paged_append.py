"""Write plan of one paged-cache append, on the device: where the next ``T`` tokens of each slot go.

For slot ``s`` (``slots[b]``, or ``b`` without ``slots``) token ``t`` sits at position ``pos = cache_seqlens[s] + t``
and is written to flat storage row ``block_table[s, pos // page_size] * page_size + pos % page_size``. A token
without a reserved page (block-table entry outside ``[0, num_pages)``, page past the table, or
``pos >= max_seqlen``) goes to row ``scratch * page_size + t % page_size`` of the scratch page
(``scratch = num_pages``). Reserved pages are a prefix of each row, so the tokens that got a page are the first
``n`` of them: ``cache_seqlens[s] += n`` and ``overflow[s]`` is set when ``n < T``.

``append_rows`` runs one Triton kernel (CUDA, or the CPU interpreter) in eager mode and inside a CUDA-graph
capture; ``append_rows_torch`` is the same plan in torch ops, used under ``torch.compile`` (the compiler fuses
it) and for CPU tensors outside the interpreter.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import triton
import triton.language as tl

from ..dispatch import is_interpreter
from ..ops._common.alloc import empty

__all__ = ["append_rows", "append_rows_torch"]


@triton.jit(do_not_specialize=["T", "max_seqlen", "max_pages", "num_pages"])
def paged_append_rows_kernel(slots, seqlens, block_table, overflow, rows, T, max_seqlen, max_pages, num_pages, s_bt,
                             PAGE_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, HAS_SLOTS: tl.constexpr):
    """One program per batch entry: rows of its ``T`` tokens, then its length and overflow flag."""
    b = tl.program_id(0).to(tl.int64)
    if HAS_SLOTS:
        s = tl.load(slots + b).to(tl.int64)
    else:
        s = b
    L = tl.load(seqlens + s).to(tl.int64)
    scratch = num_pages.to(tl.int64) * PAGE_SIZE
    landed = tl.zeros([BLOCK_T], dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        live = t < T
        pos = L + t
        page = pos // PAGE_SIZE
        ok = live & (pos >= 0) & (pos < max_seqlen) & (page < max_pages)
        blk = tl.load(block_table + s * s_bt + tl.where(ok, page, 0), mask=ok, other=-1)
        ok = ok & (blk >= 0) & (blk < num_pages)
        row = tl.where(ok, blk.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE, scratch + t % PAGE_SIZE)
        tl.store(rows + b * T + t, row, mask=live)
        landed += ok.to(tl.int32)
    n = tl.sum(landed, axis=0)
    tl.store(seqlens + s, (L + n).to(tl.int32))
    tl.store(overflow + s, n < T, mask=n < T)


def _check(block_table, cache_seqlens, overflow, slots, batch, T):
    if block_table.dtype != torch.int32 or cache_seqlens.dtype != torch.int32 or overflow.dtype != torch.bool:
        raise TypeError("append_rows: expected int32 block_table / cache_seqlens and a bool overflow tensor")
    if slots is not None and (slots.dtype != torch.long or tuple(slots.shape) != (batch,)):
        raise ValueError(f"slots: expected int64 [{batch}], got {slots.dtype} {list(slots.shape)}")
    if slots is None and batch > cache_seqlens.shape[0]:
        raise ValueError(f"batch: {batch} > {cache_seqlens.shape[0]} slots")
    if T < 1:
        raise ValueError(f"num_tokens: expected >= 1, got {T}")


def append_rows(block_table: torch.Tensor, cache_seqlens: torch.Tensor, overflow: torch.Tensor,
                slots: torch.Tensor | None, batch: int, num_tokens: int, *, max_seqlen: int, num_pages: int,
                page_size: int) -> torch.Tensor:
    """Flat storage rows ``[batch * num_tokens]`` int64 of the next ``num_tokens`` tokens of each slot;
    advances ``cache_seqlens [max_batch] int32`` and sets ``overflow [max_batch] bool`` in place.

    ``block_table [max_batch, max_pages] int32``; ``slots [batch] int64`` (distinct) or None for ``0 .. batch-1``.
    """
    _check(block_table, cache_seqlens, overflow, slots, batch, num_tokens)
    if block_table.device.type != "cuda" and not is_interpreter():
        return append_rows_torch(block_table, cache_seqlens, overflow, slots, batch, num_tokens,
                                 max_seqlen=max_seqlen, num_pages=num_pages, page_size=page_size)
    dev = block_table.device
    rows = empty(batch * num_tokens, dtype=torch.long, device=dev)
    BLOCK_T = min(1024, triton.next_power_of_2(max(num_tokens, 16)))
    # Triton launches on the current device: make it the tables' one
    with torch.cuda.device(dev) if dev.type == "cuda" and dev.index != torch.cuda.current_device() else nullcontext():
        paged_append_rows_kernel[(batch,)](
            slots if slots is not None else cache_seqlens, cache_seqlens, block_table, overflow, rows, num_tokens,
            max_seqlen, block_table.shape[1], num_pages, block_table.stride(0), PAGE_SIZE=page_size,
            BLOCK_T=BLOCK_T, HAS_SLOTS=slots is not None, num_warps=1 if BLOCK_T <= 256 else 4)
    return rows


def append_rows_torch(block_table: torch.Tensor, cache_seqlens: torch.Tensor, overflow: torch.Tensor,
                      slots: torch.Tensor | None, batch: int, num_tokens: int, *, max_seqlen: int, num_pages: int,
                      page_size: int) -> torch.Tensor:
    """``append_rows`` in torch ops (same results, same in-place updates)."""
    _check(block_table, cache_seqlens, overflow, slots, batch, num_tokens)
    T, dev = num_tokens, block_table.device
    if slots is None:
        bt, past = block_table[:batch], cache_seqlens[:batch]
    else:
        bt, past = block_table.index_select(0, slots), cache_seqlens.index_select(0, slots)
    t = torch.arange(T, device=dev)
    pos = past[:, None].long() + t  # [B, T]
    page = pos.div(page_size, rounding_mode="floor")
    ok = (pos >= 0) & (pos < max_seqlen) & (page < block_table.shape[1])
    blk = bt.gather(1, page.clamp(0, block_table.shape[1] - 1)).long()
    ok &= (blk >= 0) & (blk < num_pages)
    rows = torch.where(ok, blk * page_size + pos % page_size, num_pages * page_size + t % page_size).reshape(-1)
    n = ok.sum(1, dtype=torch.int32)
    bad = n < T
    if slots is None:
        cache_seqlens[:batch].add_(n)
        overflow[:batch].logical_or_(bad)
    else:
        cache_seqlens.index_copy_(0, slots, past + n)
        overflow.index_copy_(0, slots, overflow.index_select(0, slots) | bad)
    return rows
