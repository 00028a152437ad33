"""The varlen plan built on the device (``plan.device_plan``): sequence bounds, chunk programs and segments from
``cu_seqlens`` without a host read, and the zeroing of padding rows (tokens outside every sequence).

One program builds the whole plan in passes separated by barriers (each pass reads what the one before stored; the
reads bypass L1). Every index it writes lies in its buffer whatever ``cu_seqlens`` holds: the bounds are clamped to
``[0, T]`` and made non-decreasing first, so the sequences are disjoint spans of the tokens and hold at most
``NTT`` chunks together (the launcher's bound), and the binary searches only read entries ``[0, N]``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _max2(a, b):
    return tl.maximum(a, b)


@triton.jit
def _owner(offs, N, j, STEPS):
    """For each j (int32 tensor): the largest m in [0, N] with offs[m] <= j (offs ``[N+1]`` non-decreasing from 0),
    i.e. the m whose span [offs[m], offs[m+1]) holds j, and N where j >= offs[N]. STEPS >= bit_length(N)."""
    lo = tl.zeros_like(j)
    hi = lo + N
    for _ in range(STEPS):
        mid = (lo + hi + 1) // 2  # in [lo, hi] ⊆ [0, N]
        ok = tl.load(offs + mid, cache_modifier=".cg") <= j
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit(do_not_specialize=["stride", "N", "T", "NTT", "NSEG", "STEPS", "L"])
def gdn_plan_kernel(cu_in, stride, cu, coff, cidx, seg_cu, seg_coff, soff, N, T, NTT, NSEG, STEPS, L,
                    BT: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """One program. cu_in ``[N+1]`` int32/int64 (element stride ``stride``): the caller's cu_seqlens. Writes
    cu ``[N+1]`` int64: cu_in clamped to [0, T] and made non-decreasing (running maximum), sequence n owning
    tokens [cu[n], cu[n+1]); coff ``[N+1]`` int32: first chunk of each sequence (chunks of BT tokens); cidx
    ``[NTT, 2]`` int32: (sequence, chunk within it) of each chunk program, (-1, 0) for the programs past the last
    chunk. SPLIT (segments of L chunks, sequences cut as ``plan._seg_plan`` cuts them): soff ``[N+1]`` int32
    first segment of each sequence, seg_cu ``[NSEG+1]`` int64 token bounds of the segments and seg_coff ``[NSEG]``
    int32 their first chunk; the segments past the last one are empty, at cu[N]."""
    r = tl.arange(0, BLOCK)
    run = tl.full([], 0, tl.int64)
    for b0 in range(0, N + 1, BLOCK):
        i = b0 + r
        m = i <= N
        c = tl.load(cu_in + i.to(tl.int64) * stride, mask=m, other=0).to(tl.int64)
        c = tl.minimum(tl.maximum(c, 0), T)
        c = tl.maximum(tl.associative_scan(c, 0, _max2), run)
        tl.store(cu + i, c, mask=m)
        run = tl.maximum(run, tl.max(c, 0))
    tl.debug_barrier()
    nco = tl.full([], 0, tl.int32)
    nso = tl.full([], 0, tl.int32)
    for b0 in range(0, N, BLOCK):
        i = b0 + r
        m = i < N
        a = tl.load(cu + i, mask=m, other=0, cache_modifier=".cg")
        e = tl.load(cu + i + 1, mask=m, other=0, cache_modifier=".cg")
        nc = tl.where(m, ((e - a + BT - 1) // BT).to(tl.int32), 0)
        tl.store(coff + i + 1, tl.cumsum(nc, 0) + nco, mask=m)
        nco += tl.sum(nc, 0)
        if SPLIT:
            ns = tl.where(m, tl.maximum((nc + L - 1) // L, 1), 0)
            tl.store(soff + i + 1, tl.cumsum(ns, 0) + nso, mask=m)
            nso += tl.sum(ns, 0)
    tl.store(coff + r, tl.zeros_like(r), mask=r == 0)
    if SPLIT:
        tl.store(soff + r, tl.zeros_like(r), mask=r == 0)
    tl.debug_barrier()
    for j0 in range(0, NTT, BLOCK):
        j = j0 + r
        n = _owner(coff, N, j, STEPS)
        real = n < N
        c = j - tl.load(coff + n, cache_modifier=".cg")
        tl.store(cidx + 2 * j, tl.where(real, n, -1), mask=j < NTT)
        tl.store(cidx + 2 * j + 1, tl.where(real, c, 0), mask=j < NTT)
    if SPLIT:
        end = tl.load(cu + N, cache_modifier=".cg")
        last = tl.load(coff + N, cache_modifier=".cg")
        for s0 in range(0, NSEG, BLOCK):
            s = s0 + r
            n = _owner(soff, N, s, STEPS)
            real = n < N
            jj = s - tl.load(soff + n, cache_modifier=".cg")
            start = tl.load(cu + n, cache_modifier=".cg") + jj.to(tl.int64) * L * BT
            tl.store(seg_cu + s, tl.where(real, start, end), mask=s < NSEG)
            tl.store(seg_coff + s, tl.where(real, tl.load(coff + n, cache_modifier=".cg") + jj * L, last),
                     mask=s < NSEG)
        tl.store(seg_cu + NSEG + r, end + tl.zeros_like(r).to(tl.int64), mask=r == 0)


@triton.jit
def _zero_rows(x, stride, W, rows, pad, BW: tl.constexpr):
    """Zero the first W columns of the rows of ``x`` (rows ``stride`` elements apart, columns adjacent) where pad."""
    for c0 in range(0, W, BW):
        c = c0 + tl.arange(0, BW)
        tl.store(x + rows[:, None] * stride + c[None, :], tl.zeros([rows.shape[0], BW], x.dtype.element_ty),
                 mask=pad[:, None] & (c[None, :] < W))


@triton.jit
def zero_padding_block(x, cu, N, T, blk, stride, W, BT: tl.constexpr, BW: tl.constexpr):
    """Zero the padding rows (tokens outside [cu[0], cu[N])) among rows ``[blk·BT, blk·BT + BT)`` below T of ``x``
    (rows ``stride`` elements apart, W columns): a chunk kernel with a program for each block does it on the side."""
    rows = (blk * BT + tl.arange(0, BT)).to(tl.int64)
    pad = ((rows < tl.load(cu)) | (rows >= tl.load(cu + N))) & (rows < T)
    if tl.max(pad.to(tl.int32), 0) != 0:
        _zero_rows(x, stride, W, rows, pad, BW)


@triton.jit(do_not_specialize=["N", "T", "w0", "w1", "w2", "w3", "w4"])
def gdn_pad_zero_kernel(cu, N, T, x0, x1, x2, x3, x4, w0, w1, w2, w3, w4, NUM: tl.constexpr, BR: tl.constexpr,
                        BW: tl.constexpr):
    """Zero the padding rows (tokens outside [cu[0], cu[N])) among this program's BR rows of the first NUM of the
    contiguous ``[T, w_i]`` tensors x0..x4."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    pad = ((rows < tl.load(cu)) | (rows >= tl.load(cu + N))) & (rows < T)
    if tl.max(pad.to(tl.int32), 0) == 0:
        return
    _zero_rows(x0, w0, w0, rows, pad, BW)
    if NUM > 1:
        _zero_rows(x1, w1, w1, rows, pad, BW)
    if NUM > 2:
        _zero_rows(x2, w2, w2, rows, pad, BW)
    if NUM > 3:
        _zero_rows(x3, w3, w3, rows, pad, BW)
    if NUM > 4:
        _zero_rows(x4, w4, w4, rows, pad, BW)


@triton.jit(do_not_specialize=["W", "ROWS"])
def gdn_rows_zero_kernel(x, first, W, ROWS, BR: tl.constexpr, BW: tl.constexpr):
    """Zero rows ``[*first, ROWS)`` of the contiguous ``[ROWS, W]`` tensor x (a bound's rows past the real ones):
    program (j, i) the BW columns j of rows ``[i·BR, i·BR + BR)``."""
    rows = tl.program_id(1).to(tl.int64) * BR + tl.arange(0, BR)
    pad = (rows >= tl.load(first)) & (rows < ROWS)
    if tl.max(pad.to(tl.int32), 0) == 0:
        return
    c0 = tl.program_id(0).to(tl.int64) * BW
    _zero_rows(x + c0, W, tl.minimum(W - c0, BW), rows, pad, BW)
