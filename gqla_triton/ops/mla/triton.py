"""Portable Triton kernel of ``mla_decode`` (any CUDA GPU, every width and dtype, and the CPU interpreter).

One program per (batch entry, KV split, row tile; ``plan.py``). ``S = Q_lat·K_latᵀ + Q_rope·K_ropeᵀ`` and
``acc += P·V`` run on tensor cores with ``V`` = the latent tile already loaded for ``S`` (never reloaded).
Keys are gathered per token through the block table (``logical_to_physical``), so ``BLOCK_N`` need not divide
the page size. Sparse tiles load one physical row index per key (``sparse_rows`` translated the indices before
the launch). Definitions of masking, empty rows, duplicate indices and non-finite values: ``reference.py``.

Every row of a tile sees every key of it: dense tiles stop at the tile's first query token's position (and at
the block table's capacity), so a key only later MTP tokens see (at most ``QPT - 1`` per row tile, ``TAIL``)
runs alone after the tiles and enters only the accumulators of the rows that see it. No row ever multiplies a
value it does not see, so a NaN or inf there cannot reach it (``0 · NaN``).

FP8 latent cache (``fp8.py``, FlashMLA's 656-byte rows): the e4m3 bytes are converted and multiplied by their
tile's scale as a tile loads, the bf16 rope values converted to q's dtype, so the dots run as on a bf16 cache.
A float8 cache scaled per tensor (``k_descale``; q optionally float8 too, then taken in fp16): the e4m3 values are
converted exactly and the descales multiply the scores and the output, never the values.
FlashMLA's MODEL1 pages (sparse only): a token's 448 e4m3 values and 64 bf16 rope values form its 512-channel key
(and value), its UE8M0 scales sit in the page's second region.

Variants (config fields): ``paged_tiles`` (dense, ``BLOCK_N`` divides the page: one block-table load per tile,
contiguous rows), ``p_scratch`` (P and its row rescale cross a per-program scratch tile, so the score product
splits its keys over the warpgroups instead of running whole in both), ``rows_ahead`` (the next tile's row
indices or block-table entry load one iteration ahead).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...dispatch import device_info
from .._common import (
    finish_rows,
    logical_to_physical,
    next_pow2,
    scale_scores,
    score_mode,
    softmax_step,
    split_bounds,
    split_lse_unit,
    store_rows,
)
from .._common.alloc import empty
from .._common.host import on_device
from .._common.paging import table_keys
from .fp8 import M1_NOPE, PAGED
from .plan import MLAPlan

__all__ = ["mla_decode_fwd_kernel", "mla_decode_triton"]


@triton.jit
def _cta_sync(dep, ASM: tl.constexpr):
    """CTA barrier (``bar.sync 0``) returning 0, a data dependency for the loads that must follow it. As inline
    assembly it is invisible to Triton 3.6's software pipeliner, which stops pipelining a loop that contains
    ``tl.debug_barrier``; the interpreter (ASM false) takes ``tl.debug_barrier``."""
    if ASM:
        return tl.inline_asm_elementwise("bar.sync 0;\n\tmov.u32 $0, 0;", "=r,r", [dep], dtype=tl.int32,
                                         is_pure=False, pack=1)
    else:
        tl.debug_barrier()
        return dep * 0


@triton.jit
def _tile_block(bt_row, start, max_pages, PAGE_SIZE: tl.constexpr):
    """[1] block-table entry of the page holding key ``start``; -1 when the page is outside the table."""
    page = start // PAGE_SIZE + tl.zeros([1], tl.int32)  # [1]: a masked scalar load
    pin = page < max_pages
    return tl.load(bt_row + tl.where(pin, page, 0), mask=pin, other=-1)


@triton.jit
def _unchained_scores(q_lat, k_lat, q_rope, k_rope, qk_scale, sdesc, ok, rvalid, m_i, l_i,
                      DOT_PREC: tl.constexpr, SPARSE: tl.constexpr, RAW: tl.constexpr, DESCALE: tl.constexpr):
    """S = Q·Kᵀ of one key tile (latent and rope dots each scaled, then added: an add of two bare dots is folded into
    one chained accumulation, after which Triton computes the whole score tile in both warpgroups, 72 wgmma instead
    of 40 and 152 bytes of spills in the sm_90 compile; under RAW the raw dots still fold), masked, and one online-softmax step: ``(m_new, alpha, p,
    l_new)`` (the P_SCRATCH variant). ``qk_scale``: the scores' scale (the kernel's ``s_scale``)."""
    s = (scale_scores(_descale(tl.dot(q_lat, tl.trans(k_lat), input_precision=DOT_PREC), sdesc, DESCALE), qk_scale,
                      RAW)
         + scale_scores(_descale(tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PREC), sdesc, DESCALE),
                        qk_scale, RAW))
    if SPARSE:
        keep = ok[None, :] & rvalid[:, None]
    else:  # every row sees every key of a dense tile (the loop bounds; the boundary keys: the TAIL loop)
        keep = ok[None, :]
    return softmax_step(tl.where(keep, s, float("-inf")), m_i, l_i, qk_scale, 1, RAW)


@triton.jit
def _descale(s, sdesc, DESCALE: tl.constexpr):
    """Raw scores of a cache scaled per tensor: the dot of the e4m3 values times ``q_descale · k_descale``."""
    if DESCALE > 0:
        return s * sdesc
    return s


# the kernel's FP8 argument: which of FlashMLA's layouts (fp8.py) the cache holds
V32 = tl.constexpr(1)  # 656-byte rows, and the 528-byte rows without rope (DR = 0)
MODEL1 = tl.constexpr(2)
E4M3 = tl.constexpr(3)  # one e4m3 value per channel, scaled per tensor (k_descale)
V41 = tl.constexpr(4)
FP4 = tl.constexpr(5)  # V4.1 fp4 pages
FP8_KINDS = {None: 0, "v32": 1, "v32_no_rope": 1, "model1": 2, "e4m3": 3, "v41": 4, "v41_fp4": 5}
_M1_NOPE = tl.constexpr(M1_NOPE)  # MODEL1: a token's e4m3 values, before its 64 bf16 rope values


@triton.jit
def _e4m3(u, HW: tl.constexpr):
    """float32 values of e4m3 bytes ``u`` (uint8). ``HW``: by the GPU's e4m3 conversion (sm_89 and later, the
    interpreter); otherwise from the bits (sign, 4 exponent bits of bias 7, 3 mantissa bits; exponent 0 subnormal:
    m · 2^-9). The NaN bytes (``S.1111.111``) are mapped to NaN explicitly: the interpreter's conversion reads them
    as 480."""
    if HW:
        x = u.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        b = u.to(tl.int32)
        e = (b >> 3) & 0xF
        normal = (((b & 0x80) << 24) | ((e + 120) << 23) | ((b & 7) << 20)).to(tl.float32, bitcast=True)
        sub_bits = ((b & 7).to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True) | ((b & 0x80) << 24)
        x = tl.where(e == 0, sub_bits.to(tl.float32, bitcast=True), normal)
    return tl.where((u & 0x7F) == 0x7F, float("nan"), x)


@triton.jit
def _ue8m0(e):
    """float32 ``2^(e - 127)`` of UE8M0 bytes ``e`` (int32; 255: NaN, 0: 2^-127, a float32 subnormal)."""
    sc = (e << 23).to(tl.float32, bitcast=True)
    return tl.where(e == 255, float("nan"), tl.where(e == 0, 5.877471754111438e-39, sc))


@triton.jit
def _e2m1(c):
    """float32 values of e2m1 codes ``c`` (int32, 0..15): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 by the three low
    bits, bit 3 the sign (set as the float's top bit: code 8 is -0.0)."""
    m = c & 7
    e = m >> 1
    mag = tl.where(e == 0, (m & 1).to(tl.float32) * 0.5, ((2 + (m & 1)) << tl.maximum(e - 1, 0)).to(tl.float32) * 0.5)
    return (mag.to(tl.int32, bitcast=True) | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _keys(kv, kvs, kvr, off, sc_off, ok, offs_v, mv, offs_r, mr, KDT: tl.constexpr, DV: tl.constexpr,
          FP8: tl.constexpr, E4M3_HW: tl.constexpr):
    """``(k_lat [BLOCK_N, BDV], k_rope [BLOCK_N, BDR])`` in ``KDT`` of the cache rows at element offsets ``off``.
    FP8 1 (``fp8.py``, 656-byte rows): ``off`` counts bytes; the e4m3 bytes times their tile's float32 scale
    (``kvs``, the same memory as float32) and the bf16 rope values (``kvr``, as bf16). FP8 2 (MODEL1 pages): ``off``
    is a token's byte offset in its page's first region, ``sc_off`` that of its UE8M0 scales; channels 0..447 are
    e4m3 · 2^(e - 127), 448..511 the bf16 rope values (read as bytes), all in ``k_lat`` (DV = D = 512, no separate
    rope part).
    FP8 3 (a cache scaled per tensor): every channel one e4m3 byte, unscaled (the descales multiply the scores and
    the output). FP8 4 (V4.1 pages): 512 e4m3 values at ``off``, 16 UE8M0 scales (one per 32) at ``sc_off``. FP8 5
    (V4.1 fp4 pages): 512 e2m1 values in 256 bytes at ``off`` (the even channel in the low nibble), 32 e4m3 scales
    (one per 16) at ``sc_off``."""
    m2 = ok[:, None] & mv[None, :]
    mr2 = ok[:, None] & mr[None, :]
    if FP8 == MODEL1:
        # two byte tiles per key tile: channel c < 448's e4m3 byte or rope channel c's low byte, and the rope
        # channels' high bytes (a [BLOCK_N, DV] bf16 tile for 64 rope values would double the pipelined stage, past
        # an sm_90's shared memory at the H200 table's 64-key tiles and two stages)
        nope = offs_v < _M1_NOPE
        rb = _M1_NOPE + 2 * (offs_v - _M1_NOPE)  # rope channel c's first byte
        lo = tl.load(kv + off[:, None] + tl.where(nope, offs_v, rb)[None, :], mask=m2, other=0)
        hi = tl.load(kv + off[:, None] + (rb + 1)[None, :], mask=ok[:, None] & ~nope[None, :], other=0)
        # [BLOCK_N, 8] scale bytes (the 8th is padding: its channels take the rope values)
        e = tl.load(kv + sc_off[:, None] + tl.arange(0, 8)[None, :], mask=ok[:, None], other=127).to(tl.int32)
        xt = tl.reshape(_e4m3(lo, E4M3_HW), [lo.shape[0], 8, 64])
        deq = tl.reshape(xt * _ue8m0(e)[:, :, None], [lo.shape[0], DV])
        rope = ((hi.to(tl.int16) << 8) | lo.to(tl.int16)).to(tl.bfloat16, bitcast=True).to(tl.float32)
        k_lat = tl.where(nope[None, :], deq, rope).to(KDT)
        k_rope = tl.zeros([lo.shape[0], offs_r.shape[0]], KDT)
    elif FP8 == V32:
        x = _e4m3(tl.load(kv + off[:, None] + offs_v[None, :], mask=m2, other=0), E4M3_HW)
        # [BLOCK_N, DV / 128] scales, broadcast over their tiles (a [BLOCK_N, DV] gather would be pipelined whole)
        sc = tl.load(kvs + (off // 4 + DV // 4)[:, None] + tl.arange(0, DV // 128)[None, :], mask=ok[:, None],
                     other=0.0)
        xt = tl.reshape(x, [x.shape[0], DV // 128, 128])
        k_lat = tl.reshape(xt * sc[:, :, None], [x.shape[0], DV]).to(KDT)
        k_rope = tl.load(kvr + (off // 2 + (DV + 16) // 2)[:, None] + offs_r[None, :], mask=mr2, other=0.0).to(KDT)
    elif FP8 == V41:
        x = _e4m3(tl.load(kv + off[:, None] + offs_v[None, :], mask=m2, other=0), E4M3_HW)
        e = tl.load(kv + sc_off[:, None] + tl.arange(0, 16)[None, :], mask=ok[:, None], other=127).to(tl.int32)
        xt = tl.reshape(x, [x.shape[0], 16, 32])
        k_lat = tl.reshape(xt * _ue8m0(e)[:, :, None], [x.shape[0], DV]).to(KDT)
        k_rope = tl.zeros([x.shape[0], offs_r.shape[0]], KDT)
    elif FP8 == FP4:
        byte = tl.load(kv + off[:, None] + (offs_v // 2)[None, :], mask=m2, other=0).to(tl.int32)
        x = _e2m1(tl.where((offs_v % 2 == 0)[None, :], byte & 0xF, byte >> 4))
        sc = _e4m3(tl.load(kv + sc_off[:, None] + tl.arange(0, 32)[None, :], mask=ok[:, None], other=0), E4M3_HW)
        xt = tl.reshape(x, [x.shape[0], 32, 16])
        k_lat = tl.reshape(xt * sc[:, :, None], [x.shape[0], DV]).to(KDT)
        k_rope = tl.zeros([x.shape[0], offs_r.shape[0]], KDT)
    elif FP8 == E4M3:
        k_lat = _e4m3(tl.load(kv + off[:, None] + offs_v[None, :], mask=m2, other=0), E4M3_HW).to(KDT)
        k_rope = _e4m3(tl.load(kv + off[:, None] + DV + offs_r[None, :], mask=mr2, other=0), E4M3_HW).to(KDT)
    else:
        k_lat = tl.load(kv + off[:, None] + offs_v[None, :], mask=m2, other=0.0)
        k_rope = tl.load(kv + off[:, None] + DV + offs_r[None, :], mask=mr2, other=0.0)
    return k_lat, k_rope


# lengths and tile geometry are runtime values: one compiled variant serves every h_q / s_q / causal flag
@triton.jit(do_not_specialize=["s_q", "h_q", "max_pages", "num_pages", "topk", "num_splits", "h_tiles", "HPT", "QPT",
                               "causal"])
def mla_decode_fwd_kernel(
    q, kv, kvs, kvr, block_table, seqlens, indices, topk_length,
    out, lse, o_part, lse_part, pbuf, abuf, mx, qd, kd,
    qk_scale,  # softmax_scale * log2(e), as combine.score_mode gives it
    s_q, h_q, max_pages, num_pages, topk, num_splits, h_tiles, HPT, QPT, causal,
    s_qb, s_qq, s_qh,
    s_kvp, s_kvt,
    s_btb,
    s_ib, s_iq,
    s_ob, s_oq, s_oh,
    s_lb, s_lh, s_lq,
    s_pb, s_ps, s_pq, s_ph,
    s_plb, s_pls, s_plq,
    s_mb, s_ms, s_mq,
    s_qd, s_kd,
    DV: tl.constexpr, DR: tl.constexpr, BDV: tl.constexpr, BDR: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    SPARSE: tl.constexpr, HAS_TOPK_LEN: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PREC: tl.constexpr, PAGED_TILES: tl.constexpr, P_SCRATCH: tl.constexpr, ASM_SYNC: tl.constexpr,
    ROWS_AHEAD: tl.constexpr, TAIL: tl.constexpr, FP8: tl.constexpr, RAW: tl.constexpr, HAS_MAX: tl.constexpr,
    DESCALE: tl.constexpr, PAGE_TOKEN: tl.constexpr, PAGE_SCALES: tl.constexpr, Q_E4M3: tl.constexpr,
    E4M3_HW: tl.constexpr, LSE_RAW: tl.constexpr,
):
    pid_bs = tl.program_id(0)
    pid_t = tl.program_id(1)
    b = pid_bs // num_splits
    split = pid_bs % num_splits
    ht = pid_t % h_tiles
    qt = pid_t // h_tiles
    b64 = b.to(tl.int64)

    # rows of the tile: query token qi (major) x head h
    r = tl.arange(0, BLOCK_H)
    rq = r // HPT
    qi = qt * QPT + rq
    h = ht * HPT + (r % HPT)
    rvalid = (rq < QPT) & (qi < s_q) & (h < h_q)

    seqlen = tl.maximum(tl.load(seqlens + b), 0)  # a negative length is empty
    sdesc = 1.0
    s_scale = qk_scale  # the scores' scale (softmax_step's qk_scale)
    if DESCALE > 0:  # a cache scaled per tensor: the scores take q_descale · k_descale, the output k_descale
        kdesc = tl.load(kd + b64 * s_kd)
        dsc = kdesc.to(tl.float64)
        if DESCALE == 2:
            dsc = dsc * tl.load(qd + b64 * s_qd).to(tl.float64)
        # raw scores (the launcher sets RAW): the descales' sign goes on the dot and their magnitude on the scale,
        # which applies to differences from the running max only, so a large descale overflows nothing on the way.
        # The product is formed in float64 (q_descale · k_descale neither under- nor overflows on its own). Where it
        # is not a normal float32 number (0: a zero descale or softmax_scale, or one too small; inf; NaN) it
        # multiplies the dots itself (every score 0, ±inf or NaN, as the math gives) and the differences from the max
        # go unscaled: a masked key's -inf times a zero scale would be NaN.
        mag = (qk_scale * tl.abs(dsc)).to(tl.float32)  # (float64: dsc is)
        normal = (mag >= 1.1754943508222875e-38) & (mag < float("inf"))
        sdesc = tl.where(dsc < 0, -1.0, 1.0)
        sdesc = tl.where(normal, sdesc, sdesc * mag)
        s_scale = tl.where(normal, mag, 1.0)

    offs_r = tl.arange(0, BDR)
    mr = offs_r < DR
    q_row = q + b64 * s_qb + qi.to(tl.int64) * s_qq + h.to(tl.int64) * s_qh
    offs_v = tl.arange(0, BDV)
    mv = offs_v < DV
    q_lat = tl.load(q_row[:, None] + offs_v[None, :], mask=rvalid[:, None] & mv[None, :], other=0)
    q_rope = tl.load(q_row[:, None] + DV + offs_r[None, :], mask=rvalid[:, None] & mr[None, :], other=0)
    if Q_E4M3:  # a float8 q (its bytes): exact in fp16, in which the products then run
        q_lat = _e4m3(q_lat, E4M3_HW).to(tl.float16)
        q_rope = _e4m3(q_rope, E4M3_HW).to(tl.float16)

    bt_row = block_table + b64 * s_btb
    if SPARSE:
        # one query token per tile (QPT == 1): its index row and position are scalars
        n_valid = topk
        if HAS_TOPK_LEN:
            n_valid = tl.maximum(tl.minimum(tl.load(topk_length + b), topk), 0)
        lo, hi = split_bounds(n_valid, split, num_splits, BLOCK_N)
        idx_row = indices + b64 * s_ib + qt.to(tl.int64) * s_iq
        if ROWS_AHEAD:  # the next tile's row indices load one iteration ahead (loop-carried)
            nxt = tl.load(idx_row + lo + tl.arange(0, BLOCK_N), mask=lo + tl.arange(0, BLOCK_N) < hi, other=-1)
    else:
        lo, hi = split_bounds(table_keys(seqlen, max_pages, PAGE_SIZE), split, num_splits, BLOCK_N)
        if causal != 0:
            # the tiles cover the keys every query token of the row tile sees (up to its first token's position);
            # the at most QPT - 1 keys after it, which only its later tokens see, run one by one after the tiles
            # (TAIL), so that no row multiplies a key it does not see (0 · NaN) in P·V
            first = seqlen - s_q + qt * QPT
            if TAIL:  # TAIL implies causal
                t_lo = tl.maximum(lo, first + 1)
                t_hi = tl.minimum(hi, seqlen - s_q + tl.minimum(qt * QPT + QPT, s_q))
            hi = tl.minimum(hi, first + 1)
        elif TAIL:
            t_lo = hi
            t_hi = hi
        if PAGED_TILES and ROWS_AHEAD:  # the next tile's block-table entry loads one iteration ahead
            nxt = _tile_block(bt_row, lo, max_pages, PAGE_SIZE)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BDV], tl.float32)
    if P_SCRATCH:  # this program's two [BLOCK_H, BLOCK_N] tiles of the P scratch buffer, two [BLOCK_H] of alpha's
        pid_lin = (pid_bs * tl.num_programs(1) + tl.program_id(1)).to(tl.int64)
        p_tile = pbuf + pid_lin * (2 * BLOCK_H * BLOCK_N) + r[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        a_row = abuf + pid_lin * (2 * BLOCK_H) + r
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        pos = offs_n
        if SPARSE:  # physical rows from sparse_rows (-1: the entry does not count)
            # inline here and in gqa_decode: as one shared @triton.jit helper the sm_90 compile spilled 64-112 B
            if ROWS_AHEAD:
                prow = nxt
                nxt = tl.load(idx_row + offs_n + BLOCK_N, mask=offs_n + BLOCK_N < hi, other=-1)
            else:
                prow = tl.load(idx_row + offs_n, mask=offs_n < hi, other=-1)
            ok = prow >= 0
            prow = tl.where(ok, prow, 0)
            page_off = (prow // PAGE_SIZE).to(tl.int64) * s_kvp
            slot = (prow % PAGE_SIZE).to(tl.int64)
            kv_off = page_off + slot * s_kvt
            if PAGE_TOKEN > 0:  # a paged layout: the token's scales in its page's second region
                sc_off = page_off + (PAGE_SIZE * PAGE_TOKEN + slot * PAGE_SCALES)
            else:
                sc_off = kv_off
        elif PAGED_TILES:
            # the tile lies inside one page (start is a multiple of BLOCK_N, BLOCK_N divides PAGE_SIZE): one
            # scalar block-table load, contiguous rows
            if ROWS_AHEAD:
                blk = nxt
                nxt = _tile_block(bt_row, start + BLOCK_N, max_pages, PAGE_SIZE)
            else:
                blk = _tile_block(bt_row, start, max_pages, PAGE_SIZE)
            pok = (blk >= 0) & (blk < num_pages)
            ok = (offs_n < hi) & pok
            kv_off = (tl.where(pok, blk, 0).to(tl.int64) * s_kvp
                      + ((start % PAGE_SIZE) + tl.arange(0, BLOCK_N)).to(tl.int64) * s_kvt)
            sc_off = kv_off
        else:
            row, ok = logical_to_physical(bt_row, pos, offs_n < hi, max_pages, num_pages, PAGE_SIZE)
            kv_off = (row // PAGE_SIZE) * s_kvp + (row % PAGE_SIZE) * s_kvt
            sc_off = kv_off
        k_lat, k_rope = _keys(kv, kvs, kvr, kv_off, sc_off, ok, offs_v, mv, offs_r, mr, q_lat.dtype, DV, FP8, E4M3_HW)
        if P_SCRATCH:
            # P and alpha cross a global scratch tile (an L2 round trip): the store / load ends S's forward slice,
            # so Triton splits S's keys over the warpgroups (no duplicated QKᵀ), while P·V stays in the iteration
            # of its tile. The tiles alternate between two buffers, so one barrier per tile orders both the read
            # after this tile's writes and the next write to the same buffer (two tiles later) after every read.
            m_new, alpha, p, l_i = _unchained_scores(q_lat, k_lat, q_rope, k_rope, s_scale, sdesc, ok, rvalid, m_i,
                                                     l_i, DOT_PREC, SPARSE, RAW, DESCALE)
            nb = ((start - lo) // BLOCK_N) % 2
            tl.store(p_tile + nb * (BLOCK_H * BLOCK_N), p.to(pbuf.dtype.element_ty))
            tl.store(a_row + nb * BLOCK_H, alpha)  # alpha too: it reaches the PV dot through the accumulator
            z = _cta_sync(nb, ASM_SYNC)
            pp = tl.load(p_tile + (nb * (BLOCK_H * BLOCK_N) + z))
            aa = tl.load(a_row + (nb * BLOCK_H + z))
            acc = acc * aa[:, None]
            acc = tl.dot(pp, k_lat, acc, input_precision=DOT_PREC)
        else:
            s = tl.dot(q_lat, tl.trans(k_lat), input_precision=DOT_PREC)
            s = _descale(tl.dot(q_rope, tl.trans(k_rope), s, input_precision=DOT_PREC), sdesc, DESCALE)
            if SPARSE:
                keep = ok[None, :] & rvalid[:, None]
            else:  # every row sees every key of a dense tile (the loop bounds)
                keep = ok[None, :]
            s = tl.where(keep, scale_scores(s, s_scale, RAW), float("-inf"))
            m_new, alpha, p, l_i = softmax_step(s, m_i, l_i, s_scale, 1, RAW)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(k_lat.dtype), k_lat, acc, input_precision=DOT_PREC)
        m_i = m_new

    if TAIL:  # causal MTP, QPT > 1: each key only the later query tokens of the tile see, alone in a 16-key tile
        last = seqlen - s_q + qi  # [BLOCK_H] each row's own position
        offs_t = tl.arange(0, 16)
        for t in range(t_lo, t_hi):
            row, ok = logical_to_physical(bt_row, t + offs_t, offs_t == 0, max_pages, num_pages, PAGE_SIZE)
            kv_off = (row // PAGE_SIZE) * s_kvp + (row % PAGE_SIZE) * s_kvt
            k_lat, k_rope = _keys(kv, kvs, kvr, kv_off, kv_off, ok, offs_v, mv, offs_r, mr, q_lat.dtype, DV,
                                  FP8, E4M3_HW)
            s = tl.dot(q_lat, tl.trans(k_lat), input_precision=DOT_PREC)
            s = _descale(tl.dot(q_rope, tl.trans(k_rope), s, input_precision=DOT_PREC), sdesc, DESCALE)
            sees = t <= last
            s = tl.where(ok[None, :] & sees[:, None], scale_scores(s, s_scale, RAW), float("-inf"))
            m_i, alpha, p, l_i = softmax_step(s, m_i, l_i, s_scale, 1, RAW)
            # rows that do not see the key keep their accumulator (alpha is 1 there): no 0 · v enters them
            acc = acc * alpha[:, None] + tl.where(sees[:, None], tl.dot(p.to(k_lat.dtype), k_lat,
                                                                         input_precision=DOT_PREC), 0.0)

    # split partials: lse in raw-score units under LSE_RAW (never with DESCALE, whose scale is per sequence: its
    # partials keep natural log)
    o, lse_row = finish_rows(acc, m_i, l_i, s_scale, SPLIT, RAW, LSE_RAW)
    if DESCALE > 0:  # a row with no key keeps its 0 (or a split's raw partial), whatever the descale
        o = tl.where((l_i == 0)[:, None], o, o * kdesc)
    store_rows(o, lse_row, rvalid[:, None] & mv[None, :], rvalid, offs_v, b64, split, qi.to(tl.int64),
               h.to(tl.int64), out, s_ob, s_oq, s_oh, lse, s_lb, s_lh, s_lq,
               o_part, s_pb, s_ps, s_pq, s_ph, lse_part, s_plb, s_pls, s_plq, SPLIT)
    if HAS_MAX:  # this split's largest score per row in natural units (softmax_scale · q·k); NaN with a NaN sum
        ln_m = s_scale * 0.6931471805599453 if RAW else 0.6931471805599453  # m: raw scores, or in log2 units
        mx_row = tl.where(l_i != l_i, float("nan"), m_i * ln_m)
        tl.store(mx + b64 * s_mb + split.to(tl.int64) * s_ms + qi.to(tl.int64) * s_mq + h, mx_row, mask=rvalid)


def mla_decode_triton(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                      rows_src: torch.Tensor, topk_length: torch.Tensor | None, head_dim_v: int, qk_scale: float,
                      causal: bool, sparse: bool, p: MLAPlan, out: torch.Tensor, lse: torch.Tensor,
                      o_part: torch.Tensor, lse_part: torch.Tensor, max_logits: torch.Tensor | None = None, *,
                      q_descale: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
                      layout: str | None = None) -> float:
    """Launch the portable kernel over plan ``p``. ``rows_src``: ``sparse_rows``' physical rows ``[B, s_q, topk]``
    (sparse) or the block table (dense); ``qk_scale = softmax_scale · log2(e)``. Writes ``out``/``lse`` (one
    split) or the fp32 partials ``o_part [B, S, s_q, h_q, DV]`` / ``lse_part [B, S, s_q, h_q]``; with
    ``max_logits`` (fp32 ``[B, S, s_q, h_q]``, unit stride along h_q) each split's largest scaled score per row
    (-inf where the split saw no key). ``k_descale`` (``q_descale``): fp32 ``[1]`` or ``[B]``, the descales of a
    float8_e4m3fn cache scaled per tensor (and of a float8_e4m3fn ``q``, read as bytes and taken in fp16 in the
    kernel); ``layout``: the cache's quantised layout (``fp8.KV_FORMATS``, or ``"e4m3"`` with ``k_descale``), None
    for a bf16 / fp16 / fp32 cache. Returns the unit of the partials' lse, ``combine_splits``' ``unit``
    (``split_lse_unit``; 1.0 with one split or with descales: natural log)."""
    B, s_q, h_q, D = q.shape
    num_pages, page_size = kv_cache.shape[:2]
    cfg, S = p.cfg, p.num_splits
    info = device_info(q)
    DV = head_dim_v
    DR = D - DV
    BDV = max(16, next_pow2(DV))
    paged = cfg.paged_tiles and not sparse and page_size % cfg.block_n == 0
    grid = (B * S, p.h_tiles * p.q_tiles)
    q_e4m3 = q.dtype == torch.float8_e4m3fn  # read as bytes, converted to fp16 in the kernel
    # p_scratch: two [BLOCK_H, block_n] tiles per program (in the products' dtype: the PV operand), two alpha rows
    pbuf = (empty(grid[0] * grid[1] * 2 * p.BLOCK_H * cfg.block_n, dtype=torch.float16 if q_e4m3 else q.dtype,
                  device=q.device) if cfg.p_scratch else out)
    abuf = empty(grid[0] * grid[1] * 2 * p.BLOCK_H, dtype=torch.float32, device=q.device) if cfg.p_scratch else lse
    fp8 = layout is not None
    if fp8:  # a size-1 dim's stride is never used: 0 there, so the float32 / bf16 views below need no alignment of it
        kv_cache = kv_cache.as_strided(kv_cache.shape, [st if n > 1 else 0 for n, st in
                                                        zip(kv_cache.shape, kv_cache.stride(), strict=True)])
    kv = kv_cache.view(torch.uint8) if fp8 else kv_cache
    kvs = kv.view(torch.float32) if layout in ("v32", "v32_no_rope") else kv
    kvr = kv.view(torch.bfloat16) if layout == "v32" else kv
    # paged layouts: a token's values are PAGED.token bytes apart in its page's first region (the view's rows are
    # the page's bytes in order, scales last)
    paged_fp8 = PAGED.get(layout)
    s_kvt = paged_fp8.token if paged_fp8 else kv.stride(1)
    qk_scale, raw = score_mode(qk_scale, raw=k_descale is not None)  # descales: raw scores (see the kernel)
    unit = split_lse_unit(qk_scale, raw) if S > 1 and k_descale is None else 1.0
    with on_device(q.device):
        mla_decode_fwd_kernel[grid](
            q.view(torch.uint8) if q_e4m3 else q, kv, kvs, kvr, block_table, cache_seqlens, rows_src,
            topk_length if topk_length is not None else cache_seqlens,
            out, lse, o_part, lse_part, pbuf, abuf, max_logits if max_logits is not None else lse,
            q_descale if q_descale is not None else lse, k_descale if k_descale is not None else lse,
            qk_scale,
            s_q, h_q, block_table.shape[1], num_pages, rows_src.shape[-1] if sparse else 0, S, p.h_tiles, p.HPT, p.QPT,
            int(bool(causal)),
            q.stride(0), q.stride(1), q.stride(2),
            kv.stride(0), s_kvt,
            block_table.stride(0),
            rows_src.stride(0), rows_src.stride(1) if sparse else 0,
            out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1), lse.stride(2),
            *(o_part.stride()[:4] if S > 1 else (0, 0, 0, 0)),
            *(lse_part.stride()[:3] if S > 1 else (0, 0, 0)),
            *(max_logits.stride()[:3] if max_logits is not None else (0, 0, 0)),
            *(d.stride(0) if d is not None and d.shape[0] > 1 else 0 for d in (q_descale, k_descale)),
            DV=DV, DR=DR, BDV=BDV, BDR=max(16, next_pow2(max(DR, 1))),
            PAGE_SIZE=page_size, BLOCK_H=p.BLOCK_H, BLOCK_N=cfg.block_n, SPARSE=sparse,
            HAS_TOPK_LEN=topk_length is not None, SPLIT=S > 1,
            DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", PAGED_TILES=paged, P_SCRATCH=cfg.p_scratch,
            ASM_SYNC=not info.interpreter, ROWS_AHEAD=(sparse or paged) and cfg.rows_ahead,
            TAIL=causal and not sparse and p.QPT > 1, FP8=FP8_KINDS[layout],
            RAW=raw,
            HAS_MAX=max_logits is not None, DESCALE=0 if k_descale is None else 1 if q_descale is None else 2,
            PAGE_TOKEN=paged_fp8.token if paged_fp8 else 0, PAGE_SCALES=paged_fp8.scales if paged_fp8 else 0,
            Q_E4M3=q_e4m3, E4M3_HW=info.interpreter or info.capability >= (8, 9), LSE_RAW=unit != 1.0,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return unit


def compile_sm90(*, layout: str | None = None, dtype: str = "bf16", head_dim_v: int = 512, D: int = 576,
                 sparse: bool = True, block_h: int = 64, block_n: int = 64, num_warps: int = 8, num_stages: int = 2,
                 p_scratch: bool = True, rows_ahead: bool = True):
    """Compile the portable kernel for sm_90 without a GPU (``triton.compile``; returns the compiled kernel:
    ``.asm``, ``.metadata``), split, at the given tiles, over a ``dtype`` cache or FlashMLA's quantised ``layout``
    (``fp8.KV_FORMATS``, or ``"e4m3"``: a dense float8 q over a cache scaled per tensor). Pointers and the
    specialised integers are taken 16-aligned, as the launches see them: the loads vectorise and pipeline through
    shared memory as they do on the GPU."""
    import inspect

    from triton import compile as tcompile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = mla_decode_fwd_kernel
    lay = PAGED.get(layout)
    q8 = layout == "e4m3"
    if layout is not None:
        D = 576 if layout in ("v32", "e4m3") else 512
        head_dim_v, dtype = 512, "bf16"
    DR = D - head_dim_v
    names = list(inspect.signature(fn.fn).parameters)
    const = dict(DV=head_dim_v, DR=DR, BDV=max(16, next_pow2(head_dim_v)), BDR=max(16, next_pow2(max(DR, 1))),
                 PAGE_SIZE=64, BLOCK_H=block_h, BLOCK_N=block_n, SPARSE=sparse and not q8,
                 HAS_TOPK_LEN=sparse and not q8, SPLIT=True, DOT_PREC="ieee" if dtype == "fp32" else "tf32",
                 PAGED_TILES=not sparse or q8, P_SCRATCH=p_scratch, ASM_SYNC=True, ROWS_AHEAD=rows_ahead, TAIL=False,
                 FP8=FP8_KINDS[layout], RAW=int(q8), HAS_MAX=False, DESCALE=2 if q8 else 0,
                 PAGE_TOKEN=lay.token if lay else 0, PAGE_SCALES=lay.scales if lay else 0, Q_E4M3=q8,
                 E4M3_HW=True, LSE_RAW=False)
    cache = "u8" if layout is not None else dtype  # the views the launcher passes (mla_decode_triton)
    ptr = dict(q="*u8" if q8 else f"*{dtype}", kv=f"*{cache}",
               kvs="*fp32" if layout in ("v32", "v32_no_rope") else f"*{cache}",
               kvr="*bf16" if layout == "v32" else f"*{cache}", block_table="*i32", seqlens="*i32", indices="*i32",
               topk_length="*i32", out=f"*{dtype}", lse="*fp32", o_part="*fp32", lse_part="*fp32",
               pbuf="*fp16" if q8 else f"*{dtype}", abuf="*fp32", mx="*fp32", qd="*fp32", kd="*fp32")
    sig = {n: "constexpr" if n in const else ptr.get(n, "fp32" if n == "qk_scale" else "i32") for n in names}
    aligned = [n for n in names if n in ptr or (sig[n] == "i32" and n not in fn.do_not_specialize)]
    src = ASTSource(fn, sig, constexprs={(names.index(n),): v for n, v in const.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return tcompile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
