"""MLA absorb-path decode for Hopper (sm_90): a warp-specialised Gluon kernel.

One program per (batch entry, KV split, 64-row tile), three partitions:

* a producer warpgroup brings each 64-key tile (64 cache rows x ``D`` channels, one 64-channel slab at a time)
  into a two-stage shared-memory ring: a dense tile inside one valid page whose every key counts by TMA (one box
  per slab, under ``TMA``: the launch passes a descriptor where the cache's pages form one row range), every other
  tile by a ``cp.async`` gather, so any page size and sparse rows work alike, masked rows zero-filled (the index
  words a tile's rows come from are loaded one tile ahead, while the producer waits for the stage). From an
  FP8 latent cache (``fp8.py``) it copies the e4m3 bytes, their float32 tile scales and the rope values into the
  stage, and each consumer converts the half of the latent values it reads to bf16 in place before its products
  (the conversion is spread over both consumer warpgroups rather than bounding the producer's four warps);
* two consumer warpgroups each own half of the value columns and compute each score tile ``S = Q·Kᵀ`` once,
  between them: the owner over latent channels 0-255 and the rope (its rope channels of Q in registers, the
  rest of Q in shared memory), the partner over channels 256-511, whose fp32 partial reaches the owner through
  shared memory. The owner runs the online softmax and hands P and the row rescale to the partner, P in the
  stage's rope slab (consumed by then); each adds ``P·V`` for its half, the owner with P from registers.

Shared memory: Q's latent channels (64 KB), two 72 KB stages and the 16 KB score exchange, within the 227 KB
of one program per SM.

Tiles, masks and outputs follow the portable kernel (``triton.py``; same row tiles and split partials, geometry
from ``plan.py``), which serves other GPUs, other widths and the interpreter. The register split between the
partitions (``PRODUCER_REGS`` / ``CONSUMER_REGS`` under a ``MAXNREG`` cap) is a constant of the kernel.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .._common import score_mode, split_lse_unit
from .._common.gluon import async_load, barrier, reinterpret, tma_load
from .._common.host import on_device
from .fp8 import fp8_layout, is_fp8_latent
from .plan import MLAPlan

# the kernel's constants: the defaults of its trailing constexpr parameters (so Triton's cache key holds them)
NEVER = 1 << 30  # key-mask value of a key no query sees
SLAB = 64  # channels per shared-memory slab: 128 bytes of bf16, one 128-byte swizzle row
PRODUCER_WARPS = 4
PRODUCER_REGS = 40  # registers per thread of the producer warpgroup (setmaxnreg)
CONSUMER_REGS = 232  # registers per thread of each consumer warpgroup
MAXNREG = 168  # register cap of the launch (4 default warps)
_SWIZZLE_128 = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)  # the key slabs' layout

__all__ = ["compile_sm90", "gluon_unsupported", "mla_decode_gluon", "mla_decode_gluon_kernel"]


@gluon.jit
def _tile_rows(row_tiles, num_splits, h_tiles, HPT, QPT, s_q, h_q, causal, seqlens, topk_length, topk, max_pages,
               SPARSE: gl.constexpr, HAS_TOPK_LEN: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr,
               TAIL: gl.constexpr):
    """Program coordinates, its key range ``[lo, hi)`` of ``n_tiles`` tiles and the ``n_tail`` boundary keys from
    ``t_lo`` (the same in every partition). The row tiles of one (batch entry, split) are consecutive programs, so
    they run at the same time and read their keys through the L2 once. Dense: at most the block table's capacity
    (``_common.paging.table_keys``); a negative length is empty. Causal: the tiles end at the keys every query
    token of the row tile sees; under ``TAIL`` (several tokens per tile) the keys only its later tokens see come
    one per tile after them (as the portable kernel: no row multiplies a key it does not see in P·V)."""
    pid_bs = gl.program_id(0) // row_tiles
    pid_t = gl.program_id(0) % row_tiles
    b = pid_bs // num_splits
    split = pid_bs % num_splits
    ht = pid_t % h_tiles
    qt = pid_t // h_tiles
    seqlen = gl.maximum(gl.load(seqlens + b), 0)
    if SPARSE:
        n = topk
        if HAS_TOPK_LEN:
            n = gl.maximum(gl.minimum(gl.load(topk_length + b), topk), 0)
    else:
        n = gl.minimum(seqlen, max_pages * PAGE_SIZE)
    per = gl.cdiv(gl.cdiv(n, num_splits), BLOCK_N) * BLOCK_N
    lo = split * per
    hi = gl.minimum(lo + per, n)
    t_lo = hi
    t_hi = hi
    if not SPARSE:
        if causal != 0:
            first = seqlen - s_q + qt * QPT  # the tile's first query token
            if TAIL:
                t_lo = gl.maximum(lo, first + 1)
                t_hi = gl.minimum(hi, seqlen - s_q + gl.minimum(qt * QPT + QPT, s_q))
            hi = gl.minimum(hi, first + 1)
    n_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
    return b, split, ht, qt, seqlen, lo, hi, n_tiles, t_lo, gl.maximum(t_hi - t_lo, 0)


@gluon.jit
def _row_words(kpos, hi, rows_src, b64, qt, s_rb, s_rq, max_pages, SPARSE: gl.constexpr, PAGE_SIZE: gl.constexpr):
    """The index words of key positions ``kpos`` (-1 at or past ``hi`` or past the block table): sparse, the rows
    ``sparse_rows`` translated (-1: the entry does not count); dense, each key's block-table entry. The producer
    loads a tile's words one tile ahead of its copies, so their latency is not on the copies' path."""
    inb = kpos < hi
    if SPARSE:
        w = gl.load(rows_src + b64 * s_rb + qt.to(gl.int64) * s_rq + kpos, mask=inb, other=-1)
    else:
        page = kpos // PAGE_SIZE
        pin = inb & (page < max_pages)
        w = gl.load(rows_src + b64 * s_rb + gl.where(pin, page, 0), mask=pin, other=-1)
    return w


@gluon.jit
def _word_rows(w, kpos, num_pages, SPARSE: gl.constexpr, PAGE_SIZE: gl.constexpr):
    """Physical cache row of each key position from its index word (``_row_words``) and whether it counts."""
    if SPARSE:
        ok = w >= 0
        row = w
    else:
        ok = (w >= 0) & (w < num_pages)
        row = w * PAGE_SIZE + kpos % PAGE_SIZE
    return gl.where(ok, row, 0), ok


@gluon.jit
def _tile_words(k0, hi, rows_src, b64, qt, s_rb, s_rq, max_pages, SPARSE: gl.constexpr, PAGE_SIZE: gl.constexpr,
                BLOCK_N: gl.constexpr, FP8: gl.constexpr):
    """``_row_words`` of the tile at ``k0`` in each layout its copies use: the bf16 gather's rows; FP8 also the
    byte copy's rows and the scale copy's keys (bf16: the first again)."""
    cp: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    w = _row_words(k0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, cp)), hi, rows_src, b64, qt, s_rb, s_rq,
                   max_pages, SPARSE, PAGE_SIZE)
    wb = w
    ws = w
    if FP8:
        b16: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [gl.num_warps(), 1], [1, 0])
        sl: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [2, gl.num_warps() // 2], [1, 0])
        wb = _row_words(k0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, b16)), hi, rows_src, b64, qt, s_rb,
                        s_rq, max_pages, SPARSE, PAGE_SIZE)
        ws = _row_words(k0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, sl)), hi, rows_src, b64, qt, s_rb,
                        s_rq, max_pages, SPARSE, PAGE_SIZE)
    return w, wb, ws


@gluon.jit
def _fill_stage(kv, kv_smem, s, k0, words, num_pages, s_kvp, s_kvt, D: gl.constexpr, DV: gl.constexpr,
                PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPARSE: gl.constexpr,
                FP8: gl.constexpr, SLAB: gl.constexpr, RAW_SLAB: gl.constexpr):
    """Fill stage ``s`` with the cache rows of key positions ``[k0, k0 + BLOCK_N)``, ``words`` their index words
    (``_tile_words``; rows that do not count zero-filled); returns which rows count. bf16: every slab by
    ``cp.async`` (the consumers wait on the copies). FP8 (``kv`` the cache's bytes, ``fp8.py`` layout):
    ``_fp8_stage``."""
    NSLAB: gl.constexpr = D // SLAB
    cp: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    cc = gl.arange(0, SLAB, layout=gl.SliceLayout(0, cp))
    w, wb, ws = words
    row, ok = _word_rows(w, k0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, cp)), num_pages, SPARSE, PAGE_SIZE)
    base = kv + (row // PAGE_SIZE).to(gl.int64) * s_kvp + (row % PAGE_SIZE).to(gl.int64) * s_kvt
    if FP8:
        _fp8_stage(kv, kv_smem, s, base, ok, k0, wb, ws, num_pages, s_kvp, s_kvt, D, DV, PAGE_SIZE, BLOCK_N,
                   STAGES, SPARSE, SLAB, RAW_SLAB)
    else:
        for c in gl.static_range(NSLAB):
            async_load(kv_smem.index(s * NSLAB + c), base[:, None] + (c * SLAB + cc)[None, :], mask=ok[:, None])
    return ok


# FP8 stage layout (``fp8.py`` rows): the e4m3 bytes of latent tile k (128 values per row) in slab RAW_SLAB[k], as
# two 64-byte halves; the float32 scales of tiles 2h and 2h + 1 as the first two rows of slab 4h (h = 0, 1); the
# rope values (bf16) in the rope slab. The consumer warpgroup that reads tile k's values converts it into bf16
# slabs 2k and 2k + 1 (``_fp8_convert``): the owner tiles 0 and 1 (slabs 0-3), the other warpgroup tiles 2 and 3
# (slabs 4-7), so neither writes a slab the other reads.
RAW_SLAB = (2, 3, 6, 7)


@gluon.jit
def _fp8_views(kv_smem, STAGES: gl.constexpr, NSLAB: gl.constexpr, BLOCK_N: gl.constexpr, SLAB: gl.constexpr):
    """The ring as 64-byte rows (``raw``: half h of slab c of stage s at ``2 * (s * NSLAB + c) + h``) and as pairs
    of ``BLOCK_N``-float32 rows (``scv``: the first two rows of slab c of stage s at
    ``(s * NSLAB + c) * SLAB // 4``)."""
    raw = reinterpret(kv_smem, gl.uint8, [2 * STAGES * NSLAB, BLOCK_N, SLAB],
                       gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    scv = reinterpret(kv_smem, gl.float32, [STAGES * NSLAB * SLAB // 4, 2, BLOCK_N],
                       gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    return raw, scv


@gluon.jit
def _fp8_stage(kv, kv_smem, s, base, ok, k0, wb, ws, num_pages, s_kvp, s_kvt, D: gl.constexpr, DV: gl.constexpr,
               PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPARSE: gl.constexpr,
               SLAB: gl.constexpr, RAW_SLAB: gl.constexpr):
    """Copy an FP8 tile's bytes into stage ``s`` as laid out above, every part by ``cp.async`` (rows that do not
    count are zero bytes with scale 0)."""
    NSLAB: gl.constexpr = D // SLAB
    NT: gl.constexpr = DV // 128  # scale tiles of 128 latent values
    cp: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    b16: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [gl.num_warps(), 1], [1, 0])  # 16-byte copies
    sl: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [2, gl.num_warps() // 2], [1, 0])  # 2 x 64 scales
    raw, scv = _fp8_views(kv_smem, STAGES, NSLAB, BLOCK_N, SLAB)
    cc = gl.arange(0, SLAB, layout=gl.SliceLayout(0, cp))
    rope = (base + DV + 4 * NT).to(gl.pointer_type(gl.bfloat16), bitcast=True)
    async_load(kv_smem.index(s * NSLAB + NSLAB - 1), rope[:, None] + cc[None, :], mask=ok[:, None])
    rowb, okb = _word_rows(wb, k0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, b16)), num_pages, SPARSE,
                           PAGE_SIZE)
    bb = kv + (rowb // PAGE_SIZE).to(gl.int64) * s_kvp + (rowb % PAGE_SIZE).to(gl.int64) * s_kvt
    cb = gl.arange(0, SLAB, layout=gl.SliceLayout(0, b16))
    for k in gl.static_range(NT):
        for h in gl.static_range(2):
            async_load(raw.index(2 * (s * NSLAB + RAW_SLAB[k]) + h),
                        bb[:, None] + (128 * k + SLAB * h + cb)[None, :], mask=okb[:, None])
    rows_s, ok_s = _word_rows(ws, k0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, sl)), num_pages, SPARSE,
                              PAGE_SIZE)
    bs = (kv + (rows_s // PAGE_SIZE).to(gl.int64) * s_kvp + (rows_s % PAGE_SIZE).to(gl.int64) * s_kvt + DV).to(
        gl.pointer_type(gl.float32), bitcast=True)
    pair = gl.arange(0, 2, layout=gl.SliceLayout(1, sl))
    for h in gl.static_range(NT // 2):
        async_load(scv.index((s * NSLAB + 4 * h) * SLAB // 4), bs[None, :] + (2 * h + pair)[:, None],
                    mask=ok_s[None, :])


@gluon.jit
def _fp8_convert(kv_smem, s, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, OWNER: gl.constexpr,
                 SLAB: gl.constexpr, RAW_SLAB: gl.constexpr):
    """This consumer warpgroup's two FP8 tiles of stage ``s`` to bf16 in place (layout above), complete and visible
    to its wgmma on return. Every thread loads both tiles' scales and bytes, a partition barrier, then it stores
    the values, so no store lands on bytes another thread has still to read."""
    NSLAB: gl.constexpr = D // SLAB
    H: gl.constexpr = 0 if OWNER else 1
    b16: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [gl.num_warps(), 1], [1, 0])
    rows: gl.constexpr = gl.SliceLayout(1, b16)
    raw, scv = _fp8_views(kv_smem, STAGES, NSLAB, BLOCK_N, SLAB)
    pair: gl.constexpr = gl.BlockedLayout([1, 2], [32, 1], [gl.num_warps(), 1], [1, 0])  # a key's two scales
    sc0, sc1 = gl.split(scv.index((s * NSLAB + 4 * H) * SLAB // 4).permute((1, 0)).load(pair))
    sc0 = gl.convert_layout(sc0, rows)
    sc1 = gl.convert_layout(sc1, rows)
    src = 2 * (s * NSLAB + RAW_SLAB[2 * H])
    u0 = raw.index(src).load(b16)
    u1 = raw.index(src + 1).load(b16)
    src = 2 * (s * NSLAB + RAW_SLAB[2 * H + 1])
    u2 = raw.index(src).load(b16)
    u3 = raw.index(src + 1).load(b16)
    barrier()
    dst = s * NSLAB + 4 * H
    kv_smem.index(dst).store(_e4m3_scaled(u0, sc0))
    kv_smem.index(dst + 1).store(_e4m3_scaled(u1, sc0))
    kv_smem.index(dst + 2).store(_e4m3_scaled(u2, sc1))
    kv_smem.index(dst + 3).store(_e4m3_scaled(u3, sc1))
    fence_async_shared()  # the values were stored by the generic proxy; wgmma reads the async proxy
    barrier()


@gluon.jit
def _e4m3_scaled(u, sc):
    """``e4m3(u) * scale`` in bf16 (the product in fp32, rounded once), ``u`` [rows, 64] bytes, ``sc`` [rows]."""
    return (u.to(gl.float8e4nv, bitcast=True).to(gl.float32) * sc[:, None]).to(gl.bfloat16)


@gluon.jit
def _publish(ready):
    """Every producer thread arrives on ``ready`` once its own copies have landed (the barrier counts them all);
    one more arrival publishes the key mask."""
    async_copy.mbarrier_arrive(ready, increment_count=False)
    mbarrier.arrive(ready, count=1)


@gluon.jit
def _producer(rt, D: gl.constexpr, DV: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_H: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPARSE: gl.constexpr, HAS_TOPK_LEN: gl.constexpr,
              SPLIT: gl.constexpr, TAIL: gl.constexpr, FP8: gl.constexpr, TMA: gl.constexpr, SLAB: gl.constexpr,
              NEVER: gl.constexpr, PRODUCER_WARPS: gl.constexpr, RAW_SLAB: gl.constexpr):
    (q, kv, kv_desc, rows_src, seqlens, topk_length, out, lse, o_part, lse_part, q_smem, kv_smem, ready, empty,
     first_q_smem, s_smem, a_smem, l_smem, s_full, s_free, p_ready, fin,
     qk_scale, s_q, h_q, max_pages, num_pages, topk, num_splits, row_tiles, h_tiles, HPT, QPT, causal, s_qb, s_qq,
     s_qh, s_kvp, s_kvt, s_rb, s_rq, s_ob, s_oq, s_oh, s_lb, s_lh, s_lq, s_pb, s_ps, s_pq, s_ph, s_plb, s_pls,
     s_plq) = rt
    NSLAB: gl.constexpr = D // SLAB
    cp: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    b, split, ht, qt, seqlen, lo, hi, n_tiles, t_lo, n_tail = _tile_rows(
        row_tiles, num_splits, h_tiles, HPT, QPT, s_q, h_q, causal, seqlens, topk_length,
        topk, max_pages, SPARSE, HAS_TOPK_LEN, BLOCK_N, PAGE_SIZE, TAIL)
    b64 = b.to(gl.int64)
    rk = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, cp))
    # bf16 without TMA: each tile's index words are loaded one tile ahead (TMA: the block-table entry of a whole
    # tile). FP8 loads its three layouts' words in the tile's own step: kept across a step, they slowed it down.
    AHEAD: gl.constexpr = not (TMA or FP8)
    if AHEAD:
        words = _tile_words(lo, hi, rows_src, b64, qt, s_rb, s_rq, max_pages, SPARSE, PAGE_SIZE, BLOCK_N, FP8)
    if TMA:
        blk = gl.load(rows_src + b64 * s_rb + lo // PAGE_SIZE, mask=lo + BLOCK_N <= hi, other=-1)
    for j in range(n_tiles):
        s = j % STAGES
        k0 = lo + j * BLOCK_N
        mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
        # per key: the first query token (within the tile's sequence) that sees it; NEVER where it counts for none
        first_q = gl.full([BLOCK_N], 0, gl.int32, layout=gl.SliceLayout(1, cp))
        if not SPARSE:
            if causal != 0:
                first_q = gl.maximum(k0 + rk - (seqlen - s_q), 0)
        whole = False
        if TMA:  # a tile of one valid page whose every key counts: 64-row boxes of each slab by TMA
            whole = (k0 + BLOCK_N <= hi) & (blk >= 0) & (blk < num_pages)
            if whole:
                mbarrier.expect(ready.index(s), D * BLOCK_N * 2)  # an arrival, and the bytes to land
                for c in gl.static_range(NSLAB):
                    tma_load(kv_desc, [blk * PAGE_SIZE + k0 % PAGE_SIZE, c * SLAB], ready.index(s),
                             kv_smem.index(s * NSLAB + c))
                first_q_smem.index(s).store(first_q)
                barrier()  # every thread's mask store before the arrival that publishes them
                mbarrier.arrive(ready.index(s), count=PRODUCER_WARPS * 32)
        if not whole:
            if AHEAD:
                ok = _fill_stage(kv, kv_smem, s, k0, words, num_pages, s_kvp, s_kvt, D, DV, PAGE_SIZE, BLOCK_N,
                                 STAGES, SPARSE, FP8, SLAB, RAW_SLAB)
            else:
                ok = _fill_stage(kv, kv_smem, s, k0,
                                 _tile_words(k0, hi, rows_src, b64, qt, s_rb, s_rq, max_pages, SPARSE, PAGE_SIZE,
                                             BLOCK_N, FP8),
                                 num_pages, s_kvp, s_kvt, D, DV, PAGE_SIZE, BLOCK_N, STAGES, SPARSE, FP8, SLAB,
                                 RAW_SLAB)
            first_q_smem.index(s).store(gl.where(ok, first_q, NEVER))
            _publish(ready.index(s))
        k1 = k0 + BLOCK_N
        if TMA:
            blk = gl.load(rows_src + b64 * s_rb + k1 // PAGE_SIZE, mask=k1 + BLOCK_N <= hi, other=-1)
        if AHEAD:
            words = _tile_words(k1, hi, rows_src, b64, qt, s_rb, s_rq, max_pages, SPARSE, PAGE_SIZE, BLOCK_N, FP8)
    if TAIL:  # the boundary keys, one per tile (row 0; the others zero-filled), through the same ring
        for jt in range(n_tail):
            j = n_tiles + jt
            s = j % STAGES
            mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
            k0 = t_lo + jt
            words = _tile_words(k0, k0 + 1, rows_src, b64, qt, s_rb, s_rq, max_pages, SPARSE, PAGE_SIZE, BLOCK_N,
                                FP8)
            ok = _fill_stage(kv, kv_smem, s, k0, words, num_pages, s_kvp, s_kvt, D, DV, PAGE_SIZE, BLOCK_N,
                             STAGES, SPARSE, FP8, SLAB, RAW_SLAB)
            first_q_smem.index(s).store(gl.where(ok, gl.maximum(k0 + rk - (seqlen - s_q), 0), NEVER))
            _publish(ready.index(s))


@gluon.jit
def _scaled(sacc, qk_scale, RAW: gl.constexpr):
    """The scores ``_softmax_step`` takes: as ``_common.combine.scale_scores``."""
    if RAW > 0:
        return sacc
    if RAW < 0:
        return -sacc
    return sacc * qk_scale


@gluon.jit
def _softmax_step(sc, m_i, l_i, qk_scale, RAW: gl.constexpr):
    """One online-softmax step, as ``_common.combine.softmax_step`` (``sc`` scaled, or under ``RAW`` raw with the
    scale applied to differences from their max): NaN reaches l through p, an infinite max rescales from 0.
    Returns ``(p, alpha, m, l)``."""
    m_new = gl.maximum(m_i, gl.max(sc, 1))
    m_safe = gl.where(gl.abs(m_new) == float("inf"), 0.0, m_new)
    a = m_i - m_safe
    d = sc - m_safe[:, None]
    if RAW:
        a = a * qk_scale
        d = d * qk_scale
    alpha = gl.exp2(a)
    p = gl.exp2(d)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _partial_scores(q_a, q_smem, kv_smem, s, FIRST: gl.constexpr, NSLAB: gl.constexpr, VS: gl.constexpr,
                    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, OWNER: gl.constexpr, s_l: gl.constexpr):
    """This warpgroup's part of ``S = Q·Kᵀ`` for the key tile in stage ``s`` (async; wait on the result): latent
    slabs ``[FIRST, FIRST + VS)`` from shared Q, and for the owner also the rope slab with ``q_a`` (the rope
    channels of Q, in registers) as A."""
    acc = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_l)
    for c in gl.static_range(VS):
        acc = warpgroup_mma(q_smem.index(FIRST + c), kv_smem.index(s * NSLAB + FIRST + c).permute((1, 0)), acc,
                            use_acc=c > 0, is_async=True)
    if OWNER:
        acc = warpgroup_mma(q_a, kv_smem.index(s * NSLAB + NSLAB - 1).permute((1, 0)), acc, is_async=True)
    return acc


@gluon.jit
def _rescaled(o0, o1, o2, o3, alpha, row_o: gl.constexpr):
    """``o·alpha`` (``alpha`` [rows])."""
    a_o = gl.convert_layout(alpha, row_o)[:, None]
    return o0 * a_o, o1 * a_o, o2 * a_o, o3 * a_o


@gluon.jit
def _pv_boundary(p_op, kv_smem, v0, o0, o1, o2, o3, zero, sees):
    """``o += P·V`` (synchronous) for a boundary key: the rows that do not see it (``sees`` false) keep their
    accumulator (alpha is 1 there) and never multiply its values, so a NaN in them stays out of those rows."""
    t0 = warpgroup_mma(p_op, kv_smem.index(v0 + 0), zero, use_acc=False)
    t1 = warpgroup_mma(p_op, kv_smem.index(v0 + 1), zero, use_acc=False)
    t2 = warpgroup_mma(p_op, kv_smem.index(v0 + 2), zero, use_acc=False)
    t3 = warpgroup_mma(p_op, kv_smem.index(v0 + 3), zero, use_acc=False)
    return (o0 + gl.where(sees, t0, 0.0), o1 + gl.where(sees, t1, 0.0), o2 + gl.where(sees, t2, 0.0),
            o3 + gl.where(sees, t3, 0.0))


@gluon.jit
def _pv_step(j, p_op, kv_smem, empty, o0, o1, o2, o3, FIRST: gl.constexpr, NSLAB: gl.constexpr,
             STAGES: gl.constexpr, P_REGS: gl.constexpr):
    """``o += P·V`` for tile ``j`` over the four value slabs from ``FIRST``, then its stage released. P in registers
    (``P_REGS``) is an operand the asynchronous wgmma reads until the wait, so the wait keeps it alive (without
    that the compiler may reuse its registers while the products still read them)."""
    s = j % STAGES
    v0 = s * NSLAB + FIRST
    o0 = warpgroup_mma(p_op, kv_smem.index(v0 + 0), o0, is_async=True)
    o1 = warpgroup_mma(p_op, kv_smem.index(v0 + 1), o1, is_async=True)
    o2 = warpgroup_mma(p_op, kv_smem.index(v0 + 2), o2, is_async=True)
    o3 = warpgroup_mma(p_op, kv_smem.index(v0 + 3), o3, is_async=True)
    if P_REGS:
        o0, o1, o2, o3, _ = warpgroup_mma_wait(num_outstanding=0, deps=(o0, o1, o2, o3, p_op))
    else:
        o0, o1, o2, o3 = warpgroup_mma_wait(num_outstanding=0, deps=(o0, o1, o2, o3))
    mbarrier.arrive(empty.index(s), count=1)
    return o0, o1, o2, o3


@gluon.jit
def _tile_scores(j, q_a, q_smem, kv_smem, ready, D: gl.constexpr, FIRST: gl.constexpr, VS: gl.constexpr,
                 BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, FP8: gl.constexpr,
                 OWNER: gl.constexpr, s_l: gl.constexpr, SLAB: gl.constexpr, RAW_SLAB: gl.constexpr):
    """Wait for key tile ``j`` to land, then this warpgroup's part of its scores (``_partial_scores``), complete."""
    s = j % STAGES
    mbarrier.wait(ready.index(s), (j // STAGES) & 1)
    fence_async_shared()  # the rows arrived through cp.async (generic proxy); wgmma reads the async proxy
    if FP8:
        _fp8_convert(kv_smem, s, D, BLOCK_N, STAGES, OWNER, SLAB, RAW_SLAB)
    sacc = _partial_scores(q_a, q_smem, kv_smem, s, FIRST, D // SLAB, VS, BLOCK_H, BLOCK_N, OWNER, s_l)
    if OWNER:  # the rope product reads q_a from registers until the wait
        sacc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(sacc, q_a))
        return sacc
    return warpgroup_mma_wait(num_outstanding=0, deps=(sacc,))


@gluon.jit
def _consumer(rt, D: gl.constexpr, DV: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_H: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPARSE: gl.constexpr, HAS_TOPK_LEN: gl.constexpr,
              SPLIT: gl.constexpr, TAIL: gl.constexpr, FP8: gl.constexpr, RAW: gl.constexpr, SOLO: gl.constexpr,
              OWNER: gl.constexpr, SLAB: gl.constexpr, RAW_SLAB: gl.constexpr):
    """One of the two consumer warpgroups. Both add their part of each score tile (the owner: latent columns
    0-255 and the rope; the other: 256-511), the other's part reaching the owner through ``s_smem``; the owner
    runs the softmax and hands P (in the consumed rope slab of the stage) and the row rescale to the other; each
    then adds ``P·V`` for its half of the value columns. Under ``SOLO`` (bf16 / fp16 caches, row tiles of one query
    token) the owner forms each tile's whole score product and nothing is exchanged: the other warpgroup only adds
    ``P·V``, its products running on the tensor cores beside the owner's softmax and next scores."""
    (q, kv, kv_desc, rows_src, seqlens, topk_length, out, lse, o_part, lse_part, q_smem, kv_smem, ready, empty,
     first_q_smem, s_smem, a_smem, l_smem, s_full, s_free, p_ready, fin,
     qk_scale, s_q, h_q, max_pages, num_pages, topk, num_splits, row_tiles, h_tiles, HPT, QPT, causal, s_qb, s_qq,
     s_qh, s_kvp, s_kvt, s_rb, s_rq, s_ob, s_oq, s_oh, s_lb, s_lh, s_lq, s_pb, s_ps, s_pq, s_ph, s_plb, s_pls,
     s_plq) = rt
    NSLAB: gl.constexpr = D // SLAB
    VS: gl.constexpr = DV // SLAB // 2  # latent slabs per half
    FIRST: gl.constexpr = 0 if OWNER else VS
    S_FIRST: gl.constexpr = 0 if SOLO else FIRST  # this warpgroup's latent slabs of the score product
    S_VS: gl.constexpr = 2 * VS if SOLO else VS
    ROPE: gl.constexpr = NSLAB - 1  # the rope slab of a stage; once the owner's scores are in, it holds P
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, SLAB, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    qa_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_l, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    b, split, ht, qt, seqlen, lo, hi, n_tiles, t_lo, n_tail = _tile_rows(
        row_tiles, num_splits, h_tiles, HPT, QPT, s_q, h_q, causal, seqlens, topk_length,
        topk, max_pages, SPARSE, HAS_TOPK_LEN, BLOCK_N, PAGE_SIZE, TAIL)
    b64 = b.to(gl.int64)

    r = gl.arange(0, BLOCK_H, layout=row_s)
    qi = qt * QPT + r // HPT
    rvalid = (r // HPT < QPT) & (qi < s_q) & (ht * HPT + r % HPT < h_q)
    q_a = gl.zeros([BLOCK_H, SLAB], q.dtype.element_ty, layout=qa_l)
    if OWNER:  # the rope channels of Q, the A operand of the rope slab's product
        ra = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, qa_l))
        ca = gl.arange(0, SLAB, layout=gl.SliceLayout(0, qa_l))
        qa = qt * QPT + ra // HPT
        ha = ht * HPT + ra % HPT
        va = (ra // HPT < QPT) & (qa < s_q) & (ha < h_q)
        q_a = gl.load((q + b64 * s_qb + qa.to(gl.int64) * s_qq + ha.to(gl.int64) * s_qh + DV)[:, None] + ca[None, :],
                      mask=va[:, None], other=0.0)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.full([BLOCK_H], 0.0, gl.float32, layout=row_s)
    zero = gl.zeros([BLOCK_H, SLAB], gl.float32, layout=o_l)
    o0 = zero
    o1 = zero
    o2 = zero
    o3 = zero
    if TAIL:
        ro_t = gl.arange(0, BLOCK_H, layout=row_o)
        last_o = seqlen - s_q + qt * QPT + ro_t // HPT  # each row's own position
    for j in range(n_tiles + n_tail):
        s = j % STAGES
        ph = (j // STAGES) & 1
        if SOLO and not OWNER:  # no scores: the tile's value slabs are read once P is in
            mbarrier.wait(ready.index(s), ph)
            fence_async_shared()
        else:
            sacc = _tile_scores(j, q_a, q_smem, kv_smem, ready, D, S_FIRST, S_VS, BLOCK_H, BLOCK_N, STAGES, FP8,
                                OWNER, s_l, SLAB, RAW_SLAB)
        if OWNER:
            first_q = first_q_smem.index(s).load(gl.SliceLayout(0, s_l))  # the producer's key mask
            if not SOLO:
                mbarrier.wait(s_full, j & 1)
                sacc = sacc + s_smem.load(s_l)
                mbarrier.arrive(s_free, count=1)
            sc = gl.where(first_q[None, :] <= qi[:, None], _scaled(sacc, qk_scale, RAW), float("-inf"))
            p, alpha, m_i, l_i = _softmax_step(sc, m_i, l_i, qk_scale, RAW)
            pb = p.to(q.dtype.element_ty)
            kv_smem.index(s * NSLAB + ROPE).store(pb)
            a_smem.index(s).store(alpha)
            fence_async_shared()  # P was written by the generic proxy; the other warpgroup's wgmma reads it
            mbarrier.arrive(p_ready.index(s), count=1)
            p_op = gl.convert_layout(pb, p_l)
        else:
            if not SOLO:
                mbarrier.wait(s_free, (j & 1) ^ 1)
                s_smem.store(sacc)
                mbarrier.arrive(s_full, count=1)
            mbarrier.wait(p_ready.index(s), ph)
            p_op = kv_smem.index(s * NSLAB + ROPE)
            alpha = a_smem.index(s).load(row_s)
        o0, o1, o2, o3 = _rescaled(o0, o1, o2, o3, alpha, row_o)
        if TAIL:
            if j < n_tiles:
                o0, o1, o2, o3 = _pv_step(j, p_op, kv_smem, empty, o0, o1, o2, o3, FIRST, NSLAB, STAGES, OWNER)
            else:
                o0, o1, o2, o3 = _pv_boundary(p_op, kv_smem, s * NSLAB + FIRST, o0, o1, o2, o3, zero,
                                              ((t_lo + j - n_tiles) <= last_o)[:, None])
                mbarrier.arrive(empty.index(s), count=1)
        else:
            o0, o1, o2, o3 = _pv_step(j, p_op, kv_smem, empty, o0, o1, o2, o3, FIRST, NSLAB, STAGES, OWNER)

    # epilogue: normalise and store this half's value columns (and lse from the owner). As
    # _common.combine.finish_rows: a row whose weights sum to 0 gets lse -inf and o 0 (split partials: its raw
    # accumulator); a NaN sum gives NaN. The other warpgroup takes the row sums from the owner.
    if OWNER:
        l_smem.store(l_i)
        mbarrier.arrive(fin, count=1)
    else:
        mbarrier.wait(fin, 0)
        l_i = l_smem.load(row_s)
    empty_r = l_i == 0
    safe_l = gl.where(empty_r, 1.0, l_i)
    # lse = m·ln_m + ln l: m in log2 units, or under RAW the raw scores' max; under RAW a split's partial lse in
    # units of ln_m, m + ln(l) / ln_m (as _common.combine.finish_rows with LSE_RAW, split_lse_unit)
    ln_m = qk_scale * 0.6931471805599453 if RAW else 0.6931471805599453
    inv = gl.convert_layout(1.0 / safe_l, row_o)[:, None]
    o0 = o0 * inv
    o1 = o1 * inv
    o2 = o2 * inv
    o3 = o3 * inv
    if not SPLIT:
        keep_o = gl.convert_layout(l_i, row_o)[:, None] != 0
        o0 = gl.where(keep_o, o0, 0.0)
        o1 = gl.where(keep_o, o1, 0.0)
        o2 = gl.where(keep_o, o2, 0.0)
        o3 = gl.where(keep_o, o3, 0.0)
    ro = gl.arange(0, BLOCK_H, layout=row_o)
    qo = (qt * QPT + ro // HPT).to(gl.int64)
    ho = (ht * HPT + ro % HPT).to(gl.int64)
    mo = ((ro // HPT < QPT) & (qt * QPT + ro // HPT < s_q) & (ht * HPT + ro % HPT < h_q))[:, None]
    cols = FIRST * SLAB + gl.arange(0, SLAB, layout=gl.SliceLayout(0, o_l))
    qr = (qt * QPT + r // HPT).to(gl.int64)
    hr = (ht * HPT + r % HPT).to(gl.int64)
    if SPLIT:
        po = o_part + b64 * s_pb + split.to(gl.int64) * s_ps + qo * s_pq + ho * s_ph
        gl.store(po[:, None] + cols[None, :], o0, mask=mo)
        gl.store(po[:, None] + (cols + SLAB)[None, :], o1, mask=mo)
        gl.store(po[:, None] + (cols + 2 * SLAB)[None, :], o2, mask=mo)
        gl.store(po[:, None] + (cols + 3 * SLAB)[None, :], o3, mask=mo)
        if OWNER:
            if RAW:
                lse_row = gl.where(empty_r, float("-inf"), m_i + gl.log(safe_l) / ln_m)
            else:
                lse_row = gl.where(empty_r, float("-inf"), m_i * ln_m + gl.log(safe_l))
            gl.store(lse_part + b64 * s_plb + split.to(gl.int64) * s_pls + qr * s_plq + hr, lse_row, mask=rvalid)
    else:
        ty = out.dtype.element_ty
        po = out + b64 * s_ob + qo * s_oq + ho * s_oh
        gl.store(po[:, None] + cols[None, :], o0.to(ty), mask=mo)
        gl.store(po[:, None] + (cols + SLAB)[None, :], o1.to(ty), mask=mo)
        gl.store(po[:, None] + (cols + 2 * SLAB)[None, :], o2.to(ty), mask=mo)
        gl.store(po[:, None] + (cols + 3 * SLAB)[None, :], o3.to(ty), mask=mo)
        if OWNER:
            lse_row = gl.where(empty_r, float("-inf"), m_i * ln_m + gl.log(safe_l))
            gl.store(lse + b64 * s_lb + hr * s_lh + qr * s_lq, lse_row, mask=rvalid)


@gluon.jit
def _owner(rt, D: gl.constexpr, DV: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_H: gl.constexpr,
           BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPARSE: gl.constexpr, HAS_TOPK_LEN: gl.constexpr,
           SPLIT: gl.constexpr, TAIL: gl.constexpr, FP8: gl.constexpr, RAW: gl.constexpr, SOLO: gl.constexpr,
           SLAB: gl.constexpr, RAW_SLAB: gl.constexpr):
    _consumer(rt, D, DV, PAGE_SIZE, BLOCK_H, BLOCK_N, STAGES, SPARSE, HAS_TOPK_LEN, SPLIT, TAIL, FP8, RAW, SOLO, True,
              SLAB, RAW_SLAB)


@gluon.jit
def _partner(rt, D: gl.constexpr, DV: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_H: gl.constexpr,
             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPARSE: gl.constexpr, HAS_TOPK_LEN: gl.constexpr,
             SPLIT: gl.constexpr, TAIL: gl.constexpr, FP8: gl.constexpr, RAW: gl.constexpr, SOLO: gl.constexpr,
             SLAB: gl.constexpr, RAW_SLAB: gl.constexpr):
    _consumer(rt, D, DV, PAGE_SIZE, BLOCK_H, BLOCK_N, STAGES, SPARSE, HAS_TOPK_LEN, SPLIT, TAIL, FP8, RAW, SOLO, False,
              SLAB, RAW_SLAB)


@gluon.jit(do_not_specialize=["s_q", "h_q", "max_pages", "num_pages", "topk", "num_splits", "row_tiles", "h_tiles",
                              "HPT", "QPT", "causal"])
def mla_decode_gluon_kernel(
    q, kv, kv_desc, rows_src, seqlens, topk_length, out, lse, o_part, lse_part,
    qk_scale,  # softmax_scale * log2(e)
    s_q, h_q, max_pages, num_pages, topk, num_splits, row_tiles, h_tiles, HPT, QPT, causal,
    s_qb, s_qq, s_qh,
    s_kvp, s_kvt,
    s_rb, s_rq,
    s_ob, s_oq, s_oh,
    s_lb, s_lh, s_lq,
    s_pb, s_ps, s_pq, s_ph,
    s_plb, s_pls, s_plq,
    D: gl.constexpr, DV: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, SPARSE: gl.constexpr, HAS_TOPK_LEN: gl.constexpr, SPLIT: gl.constexpr,
    TAIL: gl.constexpr, FP8: gl.constexpr, RAW: gl.constexpr, TMA: gl.constexpr, SOLO: gl.constexpr,
    # the kernel's constants: leave them at their defaults
    SLAB: gl.constexpr = SLAB, NEVER: gl.constexpr = NEVER, RAW_SLAB: gl.constexpr = RAW_SLAB,
    PRODUCER_WARPS: gl.constexpr = PRODUCER_WARPS, PRODUCER_REGS: gl.constexpr = PRODUCER_REGS,
    CONSUMER_REGS: gl.constexpr = CONSUMER_REGS,
):
    gl.static_assert(not (SOLO and (FP8 or TAIL)),
                     "SOLO: bf16 / fp16 caches (an FP8 tile is converted by both) and one query token per row tile")
    NSLAB: gl.constexpr = D // SLAB
    dt: gl.constexpr = q.dtype.element_ty  # of the shared tiles; an FP8 cache is converted to it in place
    sw: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    q_smem = gl.allocate_shared_memory(dt, [DV // SLAB, BLOCK_H, SLAB], sw)  # the latent channels of Q
    kv_smem = gl.allocate_shared_memory(dt, [STAGES * NSLAB, BLOCK_N, SLAB], sw)
    # the partner's partial scores, fp32; 32-byte vectors swizzled across rows so the accumulator rows of a warp
    # fall in different banks
    s_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H, BLOCK_N], gl.SwizzledSharedLayout(8, 1, 8, [1, 0]))
    a_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_H], vec)  # the owner's row rescale per stage
    l_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec)  # the owner's final row sums
    first_q_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N], vec)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    s_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    s_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    fin = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        # one cp.async arrival per producer thread, one for the key mask
        mbarrier.init(ready.index(i), count=PRODUCER_WARPS * 32 + 1)
        mbarrier.init(empty.index(i), count=2)  # one release per consumer warpgroup
        mbarrier.init(p_ready.index(i), count=1)
    mbarrier.init(s_full, count=1)
    mbarrier.init(s_free, count=1)
    mbarrier.init(fin, count=1)

    # the tile's query rows: token qi (major) x head h, the latent channels as 64-channel slabs into shared memory
    # (both consumers' A); the owner holds the rope channels in registers
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    pid_bs = gl.program_id(0) // row_tiles
    pid_t = gl.program_id(0) % row_tiles
    b64 = (pid_bs // num_splits).to(gl.int64)
    ht = pid_t % h_tiles
    qt = pid_t // h_tiles
    r = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld))
    qi = qt * QPT + r // HPT
    h = ht * HPT + r % HPT
    rvalid = (r // HPT < QPT) & (qi < s_q) & (h < h_q)
    q_row = q + b64 * s_qb + qi.to(gl.int64) * s_qq + h.to(gl.int64) * s_qh
    cc = gl.arange(0, SLAB, layout=gl.SliceLayout(0, ld))
    for c in gl.static_range(DV // SLAB):
        q_smem.index(c).store(gl.load(q_row[:, None] + (c * SLAB + cc)[None, :], mask=rvalid[:, None], other=0.0))
    fence_async_shared()

    # constexprs go inline: a tuple bound to a name turns them into tensors (Triton 3.6)
    rt = (q, kv, kv_desc, rows_src, seqlens, topk_length, out, lse, o_part, lse_part, q_smem, kv_smem, ready,
          empty,
          first_q_smem, s_smem, a_smem, l_smem, s_full, s_free, p_ready, fin,
          qk_scale, s_q, h_q, max_pages, num_pages, topk, num_splits, row_tiles, h_tiles, HPT, QPT, causal, s_qb, s_qq,
          s_qh, s_kvp, s_kvt, s_rb, s_rq, s_ob, s_oq, s_oh, s_lb, s_lh, s_lq, s_pb, s_ps, s_pq, s_ph, s_plb, s_pls,
          s_plq)
    gl.warp_specialize([
        (_owner, (rt, D, DV, PAGE_SIZE, BLOCK_H, BLOCK_N, STAGES, SPARSE, HAS_TOPK_LEN, SPLIT, TAIL, FP8, RAW, SOLO,
                  SLAB, RAW_SLAB)),
        (_partner, (rt, D, DV, PAGE_SIZE, BLOCK_H, BLOCK_N, STAGES, SPARSE, HAS_TOPK_LEN, SPLIT, TAIL, FP8, RAW,
                    SOLO, SLAB, RAW_SLAB)),
        (_producer, (rt, D, DV, PAGE_SIZE, BLOCK_H, BLOCK_N, STAGES, SPARSE, HAS_TOPK_LEN, SPLIT, TAIL, FP8, TMA, SLAB,
                     NEVER, PRODUCER_WARPS, RAW_SLAB)),
    ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


def gluon_unsupported(q: torch.Tensor, kv_cache: torch.Tensor, head_dim_v: int, layout: str | None = None) -> str | None:
    """Why the Gluon kernel cannot run these inputs (None when it can); the GPU itself is checked by the caller.
    ``layout``: the quantised cache's layout (``fp8_layout``; None: told by the row width)."""
    D = q.shape[-1]
    fp8 = is_fp8_latent(kv_cache)
    layout = layout or fp8_layout(kv_cache)
    if fp8 and layout != "v32":
        return f"FlashMLA's {layout} layout (the Gluon kernel reads the 656-byte V3.2 rows; the portable kernel reads it)"
    if fp8 and q.dtype != torch.bfloat16:
        return f"q dtype {q.dtype} with an FP8 latent cache (bf16 only: its rope values are bf16)"
    if not fp8 and kv_cache.dtype != q.dtype:
        return f"kv_cache dtype {kv_cache.dtype} != q dtype {q.dtype}"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {q.dtype} (bf16 / fp16 only)"
    if head_dim_v != 512 or D != 576:
        return f"head_dim_v {head_dim_v}, D {D} (latent 512 + rope 64 only)"
    if kv_cache.shape[1] % 16:
        return f"page size {kv_cache.shape[1]} (multiples of 16 only)"
    if kv_cache.shape[0] * kv_cache.shape[1] >= 2**31:  # e.g. an expanded (stride 0) view of a few pages
        return (f"kv_cache of {kv_cache.shape[0]} pages x {kv_cache.shape[1]} tokens: 2^31 token rows or more (the "
                "kernel's row indices are int32)")
    align = 16 // kv_cache.element_size()
    if kv_cache.stride(0) % align or kv_cache.stride(1) % align or kv_cache.data_ptr() % 16:
        return "kv_cache rows not 16-byte aligned (cp.async copies 16 bytes)"
    return None


def _kv_descriptor(kv_cache: torch.Tensor) -> TensorDescriptor | None:
    """A TMA descriptor of a bf16 / fp16 paged cache ``[num_pages, page_size, 1, D]`` as ``[num_pages · page_size,
    D]`` rows with 64 x 64 boxes in the kernel's 128-byte swizzle, or None where the pages are not one range of
    distinct rows (a token stride below ``D``, as an expanded view has, included) or a 64-key tile would cross a
    page (the kernel then copies every tile by ``cp.async``)."""
    num_pages, page_size = kv_cache.shape[:2]
    rows, D = num_pages * page_size, kv_cache.shape[-1]
    s_t = kv_cache.stride(1)
    if (page_size % 64 or rows == 0 or rows >= 2**31 or kv_cache.stride(-1) != 1 or s_t < D
            or (num_pages > 1 and kv_cache.stride(0) != page_size * s_t)):
        return None
    view = kv_cache.as_strided((rows, D), (s_t, 1))
    return TensorDescriptor(view, [rows, D], [s_t, 1], [64, SLAB], _SWIZZLE_128)


def mla_decode_gluon(q: torch.Tensor, kv_cache: torch.Tensor, rows_src: torch.Tensor, cache_seqlens: torch.Tensor,
                     topk_length: torch.Tensor | None, head_dim_v: int, qk_scale: float, causal: bool, sparse: bool,
                     p: MLAPlan, out: torch.Tensor, lse: torch.Tensor, o_part: torch.Tensor,
                     lse_part: torch.Tensor) -> float:
    """Launch the Gluon kernel over plan ``p`` (64-row tiles, ``num_stages`` ring stages). ``rows_src``: the block
    table (dense) or ``sparse_rows``' physical rows (sparse); outputs as ``triton.mla_decode_triton``. Returns the
    unit of the partials' lse, ``combine_splits``' ``unit`` (``split_lse_unit``: raw-score units under RAW; 1.0
    with one split)."""
    B, s_q, h_q, D = q.shape
    num_pages, page_size = kv_cache.shape[:2]
    S = p.num_splits
    topk = rows_src.shape[-1] if sparse else 0
    fp8 = is_fp8_latent(kv_cache)
    desc = _kv_descriptor(kv_cache) if p.cfg.tma and not (fp8 or sparse) else None
    tail = causal and not sparse and p.QPT > 1  # tiles of several query tokens: their boundary keys
    if fp8:
        kv_cache = kv_cache.view(torch.uint8)  # read as bytes; strides count bytes
    qk_scale, raw = score_mode(qk_scale)
    with on_device(q.device):
        mla_decode_gluon_kernel[(B * S * p.h_tiles * p.q_tiles,)](
            q, kv_cache, kv_cache if desc is None else desc, rows_src, cache_seqlens,
            topk_length if topk_length is not None else cache_seqlens,
            out, lse, o_part, lse_part, qk_scale,
            s_q, h_q, rows_src.shape[1] if not sparse else 0, num_pages, topk, S, p.h_tiles * p.q_tiles, p.h_tiles,
            p.HPT, p.QPT, int(bool(causal)),
            q.stride(0), q.stride(1), q.stride(2),
            kv_cache.stride(0), kv_cache.stride(1),
            rows_src.stride(0), rows_src.stride(1) if sparse else 0,
            out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1), lse.stride(2),
            *(o_part.stride()[:4] if S > 1 else (0, 0, 0, 0)),
            *(lse_part.stride()[:3] if S > 1 else (0, 0, 0)),
            D=D, DV=head_dim_v, PAGE_SIZE=page_size, BLOCK_H=64, BLOCK_N=p.cfg.block_n, STAGES=p.cfg.num_stages,
            SPARSE=sparse, HAS_TOPK_LEN=topk_length is not None, SPLIT=S > 1, TAIL=tail,
            FP8=fp8, RAW=raw, TMA=desc is not None, SOLO=p.cfg.owner_scores and not (fp8 or tail), num_warps=4,
            maxnreg=MAXNREG,
        )
    return split_lse_unit(qk_scale, raw) if S > 1 else 1.0


def compile_sm90(*, sparse: bool, split: bool, dtype: str = "bf16", page_size: int = 64, tail: bool = False,
                 fp8: bool = False, raw: bool = False, tma: bool = False, solo: bool = False):
    """Compile the kernel for sm_90 without a GPU (``triton.compile``; returns the compiled kernel: ``.asm``,
    ``.metadata``). Pointers and the cache strides are taken 16-byte aligned, as the launch specialises them."""
    import inspect

    from triton import compile as tcompile
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = mla_decode_gluon_kernel
    params = inspect.signature(fn.fn).parameters
    names = list(params)
    const = {n: p.default for n, p in params.items() if p.default is not p.empty}  # the kernel's constants
    const.update(D=576, DV=512, PAGE_SIZE=page_size, BLOCK_H=64, BLOCK_N=64, STAGES=2, SPARSE=sparse,
                 HAS_TOPK_LEN=sparse, SPLIT=split, TAIL=tail, FP8=fp8, RAW=raw, TMA=tma, SOLO=solo)
    kv = "*u8" if fp8 else f"*{dtype}"
    desc = f"tensordesc<{dtype}[64,{SLAB}],{_SWIZZLE_128!r}>" if tma else kv
    ptr = {"q": f"*{dtype}", "kv": kv, "kv_desc": desc, "out": f"*{dtype}", "rows_src": "*i32", "seqlens": "*i32",
           "topk_length": "*i32", "lse": "*fp32", "o_part": "*fp32", "lse_part": "*fp32"}
    sig = {n: "constexpr" if n in const else ptr.get(n, "fp32" if n == "qk_scale" else "i32") for n in names}
    aligned = [n for n in names if (n in ptr and n != "kv_desc") or n.startswith("s_kv")]
    src = GluonASTSource(fn, sig, constexprs={(names.index(n),): v for n, v in const.items()},
                         attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return tcompile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=MAXNREG))
