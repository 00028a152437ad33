"""Write plan of one paged-cache append, on the device: where the next ``T`` tokens of each slot go.

For slot ``s`` (``slots[b]``, or ``b`` without ``slots``) token ``t`` sits at position ``pos = cache_seqlens[s] + t``
and is written to flat storage row ``block_table[s, pos // page_size] * page_size + pos % page_size``. A token
without a reserved page (block-table entry outside ``[0, num_pages)``, page past the table, or
``pos >= max_seqlen``) goes to row ``scratch * page_size + t % page_size`` of the scratch page
(``scratch = num_pages``). Reserved pages are a prefix of each row, so the tokens that got a page are the first
``n`` of them: ``cache_seqlens[s] += n`` and ``overflow[s]`` is set when ``n < T``.

Bounds: whatever the values of ``block_table``, ``cache_seqlens`` and ``slots``, every address read or written lies
inside the tensors given, and every row returned lies in ``[0, (num_pages + 1) · page_size)``. Slots on the CPU are
checked on the host (inside ``[0, max_batch)``, distinct). Slots on a device are not read on the host (no sync): an
entry outside ``[0, max_batch)`` writes no slot (its tokens go to the scratch page); two entries naming one slot race
on its length and flag (each reads the length, plans its rows and writes the length back: the final length and which
rows the entries share are unspecified), all in bounds.

``append_rows`` runs one Triton kernel (CUDA, or the CPU interpreter) in eager mode and inside a CUDA-graph
capture; ``append_rows_torch`` is the same plan in torch ops, used under ``torch.compile`` (the compiler fuses
it) and for tensors on other devices (CPU outside the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import is_interpreter
from ..ops._common.alloc import empty
from ..ops._common.host import on_device
from ..ops._common.validation import (
    INDEX_DTYPES,
    INT32_MAX,
    check_disjoint,
    check_inference_mode,
    check_int_in,
    check_positive_int,
    check_same_device,
    check_tensor,
)

__all__ = ["append_rows", "append_rows_torch"]


@triton.jit(do_not_specialize=["T", "max_seqlen", "max_pages", "num_pages", "max_batch"])
def paged_append_rows_kernel(slots, seqlens, block_table, overflow, rows, T, max_seqlen, max_pages, num_pages,
                             max_batch, s_slot, s_sl, s_bt, s_bp, s_ov, PAGE_SIZE: tl.constexpr,
                             BLOCK_T: tl.constexpr, HAS_SLOTS: tl.constexpr):
    """One program per batch entry: rows of its ``T`` tokens, then its length and overflow flag. A slot outside
    ``[0, max_batch)`` is never dereferenced: its tokens go to the scratch page."""
    b = tl.program_id(0).to(tl.int64)
    if HAS_SLOTS:
        s = tl.load(slots + b * s_slot).to(tl.int64)
    else:
        s = b
    sv = (s >= 0) & (s < max_batch)
    s = tl.where(sv, s, 0)  # a slot out of range reads slot 0's length and lands no token
    L = tl.load(seqlens + s * s_sl).to(tl.int64)
    T_ok = tl.where(sv, T, 0)
    scratch = num_pages.to(tl.int64) * PAGE_SIZE
    landed = tl.zeros([BLOCK_T], dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        live = t < T
        pos = L + t
        page = pos // PAGE_SIZE
        ok = (t < T_ok) & (pos >= 0) & (pos < max_seqlen) & (page < max_pages)
        blk = tl.load(block_table + s * s_bt + tl.where(ok, page, 0) * s_bp, mask=ok, other=-1)
        ok = ok & (blk >= 0) & (blk < num_pages)
        row = tl.where(ok, blk.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE, scratch + t % PAGE_SIZE)
        tl.store(rows + b * T + t, row, mask=live)
        landed += ok.to(tl.int32)
    n = tl.sum(landed, axis=0)
    tl.store(seqlens + s * s_sl, (L + n).to(tl.int32), mask=sv)
    tl.store(overflow + s * s_ov, n < T, mask=sv & (n < T))


def _check(block_table, cache_seqlens, overflow, slots, batch, num_tokens, max_seqlen, num_pages, page_size):
    """Validates every argument of ``append_rows``; returns ``(batch, num_tokens, max_seqlen, num_pages, page_size,
    host_checked)`` as ints (``host_checked``: the slot values were checked here)."""
    check_tensor("block_table", block_table, ndim=2, dtypes=INDEX_DTYPES)
    mb, mp = block_table.shape
    if mb == 0 or mp == 0:
        raise ValueError(f"block_table: expected shape [max_batch >= 1, max_pages >= 1], got {list(block_table.shape)}")
    check_tensor("cache_seqlens", cache_seqlens, shape=(mb,), dtypes=INDEX_DTYPES)
    check_tensor("overflow", overflow, shape=(mb,), dtypes=(torch.bool,))
    dev = check_same_device(block_table=block_table, cache_seqlens=cache_seqlens, overflow=overflow, slots=slots)
    if dev.type == "meta":
        raise ValueError("block_table: expected tensors with storage, got ones on meta")
    for name, t in (("cache_seqlens", cache_seqlens), ("overflow", overflow)):
        if mb > 1 and t.stride(0) == 0:
            raise ValueError(f"{name}: written in place, so its {mb} entries need their own memory (got stride 0)")
        check_inference_mode(name, t)  # both are written: refused before either changes
    batch = check_int_in("batch", batch, 0)
    # the kernel's int32 token loop steps by up to 1024: its last step must not pass int32
    T = check_positive_int("num_tokens", num_tokens, hi=INT32_MAX - 1024)
    max_seqlen = check_positive_int("max_seqlen", max_seqlen)
    num_pages = check_positive_int("num_pages", num_pages)
    page_size = check_positive_int("page_size", page_size)
    host_checked = True
    if slots is None:
        if batch > mb:
            raise ValueError(f"batch: expected at most {mb} (cache_seqlens' slots) without slots, got {batch}")
    else:
        check_tensor("slots", slots, shape=(batch,), dtypes=(torch.long,))
        host_checked = slots.device.type == "cpu" and not torch.compiler.is_compiling()
        if host_checked and batch:
            ids = slots.tolist()
            lo, hi = min(ids), max(ids)
            if lo < 0 or hi >= mb:
                raise ValueError(f"slots: slot {lo if lo < 0 else hi} outside [0, {mb}) (cache_seqlens' slots)")
            if len(set(ids)) < batch:
                seen = set()
                dup = next(s for s in ids if s in seen or seen.add(s))
                raise ValueError(f"slots: slot {dup} named more than once")
    check_disjoint("cache_seqlens", cache_seqlens, block_table=block_table, overflow=overflow, slots=slots)
    check_disjoint("overflow", overflow, block_table=block_table, slots=slots)
    return batch, T, max_seqlen, num_pages, page_size, host_checked


def append_rows(block_table: torch.Tensor, cache_seqlens: torch.Tensor, overflow: torch.Tensor,
                slots: torch.Tensor | None, batch: int, num_tokens: int, *, max_seqlen: int, num_pages: int,
                page_size: int) -> torch.Tensor:
    """Flat storage rows ``[batch * num_tokens]`` int64 of the next ``num_tokens`` tokens of each slot;
    advances ``cache_seqlens [max_batch] int32`` and sets ``overflow [max_batch] bool`` in place.

    ``block_table [max_batch, max_pages] int32`` (any strides; ``max_batch``, ``max_pages`` >= 1); ``slots
    [batch] int64``, distinct, in ``[0, max_batch)`` (checked when on the CPU; on a device see the module
    docstring), or None for ``0 .. batch-1``. ``num_tokens``, ``max_seqlen``, ``num_pages``, ``page_size``:
    positive ints. A refused call changes nothing.
    """
    args = _check(block_table, cache_seqlens, overflow, slots, batch, num_tokens, max_seqlen, num_pages, page_size)
    dev = block_table.device
    if dev.type == "cuda" or (dev.type == "cpu" and is_interpreter()):
        return _rows_kernel(block_table, cache_seqlens, overflow, slots, *args[:-1])
    return _rows_torch(block_table, cache_seqlens, overflow, slots, *args)


def append_rows_torch(block_table: torch.Tensor, cache_seqlens: torch.Tensor, overflow: torch.Tensor,
                      slots: torch.Tensor | None, batch: int, num_tokens: int, *, max_seqlen: int, num_pages: int,
                      page_size: int) -> torch.Tensor:
    """``append_rows`` in torch ops (same arguments, checks, results, in-place updates and bounds)."""
    args = _check(block_table, cache_seqlens, overflow, slots, batch, num_tokens, max_seqlen, num_pages, page_size)
    return _rows_torch(block_table, cache_seqlens, overflow, slots, *args)


def cache_rows(block_table, cache_seqlens, overflow, slots, batch: int, num_tokens: int, *, max_seqlen: int,
               num_pages: int, page_size: int) -> torch.Tensor:
    """``append_rows`` for the caches' own tables and validated slot ids (``layers/cache.py``), whose arguments hold
    by construction: no checks on the decode step's path. The torch plan under torch.compile."""
    dev = block_table.device
    if not torch.compiler.is_compiling() and (dev.type == "cuda" or (dev.type == "cpu" and is_interpreter())):
        return _rows_kernel(block_table, cache_seqlens, overflow, slots, batch, num_tokens, max_seqlen, num_pages,
                            page_size)
    return _rows_torch(block_table, cache_seqlens, overflow, slots, batch, num_tokens, max_seqlen, num_pages,
                       page_size, True)


def _rows_kernel(block_table, cache_seqlens, overflow, slots, batch, T, max_seqlen, num_pages, page_size):
    """The plan by ``paged_append_rows_kernel`` on checked arguments (slot values unchecked)."""
    dev = block_table.device
    rows = empty(batch * T, dtype=torch.long, device=dev)
    if batch == 0:
        return rows
    BLOCK_T = min(1024, triton.next_power_of_2(max(T, 16)))
    with on_device(dev):
        paged_append_rows_kernel[(batch,)](
            slots if slots is not None else cache_seqlens, cache_seqlens, block_table, overflow, rows, T,
            max_seqlen, block_table.shape[1], num_pages, block_table.shape[0],
            slots.stride(0) if slots is not None else 0, cache_seqlens.stride(0), *block_table.stride(),
            overflow.stride(0), PAGE_SIZE=page_size, BLOCK_T=BLOCK_T, HAS_SLOTS=slots is not None,
            num_warps=1 if BLOCK_T <= 256 else 4)
    return rows


def _rows_torch(block_table, cache_seqlens, overflow, slots, batch, T, max_seqlen, num_pages, page_size,
                host_checked):
    """The plan in torch ops on checked arguments; ``host_checked`` False: slot values unchecked, masked."""
    dev, (mb, mp) = block_table.device, block_table.shape
    if slots is None:
        bt, past, valid = block_table[:batch], cache_seqlens[:batch], None
    else:
        # unchecked slots: an entry outside [0, max_batch) reads slot 0 and lands nothing
        valid = None if host_checked else (slots >= 0) & (slots < mb)
        idx = slots if valid is None else torch.where(valid, slots, 0)
        bt, past = block_table.index_select(0, idx), cache_seqlens.index_select(0, idx)
    t = torch.arange(T, device=dev)
    pos = past[:, None].long() + t  # [B, T]
    page = pos.div(page_size, rounding_mode="floor")
    ok = (pos >= 0) & (pos < max_seqlen) & (page < mp)
    if valid is not None:
        ok &= valid[:, None]
    blk = bt.gather(1, page.clamp(0, mp - 1)).long()
    ok &= (blk >= 0) & (blk < num_pages)
    rows = torch.where(ok, blk * page_size + pos % page_size, num_pages * page_size + t % page_size).reshape(-1)
    n = ok.sum(1, dtype=torch.int32)
    bad = n < T
    if slots is None:
        cache_seqlens[:batch].add_(n)
        overflow[:batch].logical_or_(bad)
    elif valid is None:
        cache_seqlens.index_copy_(0, slots, past + n)
        overflow.index_copy_(0, slots, overflow.index_select(0, slots) | bad)
    else:  # entries outside [0, max_batch) write one extra element, dropped
        dst = torch.where(valid, slots, mb)
        for tensor, new in ((cache_seqlens, past + n), (overflow, overflow.index_select(0, idx) | bad)):
            ext = torch.cat([tensor, tensor.new_zeros(1)])
            tensor.copy_(ext.index_copy_(0, dst, new)[:mb])
    return rows
