"""Triton kernel of ``gqa_decode`` (GQLA grouped path: GQA over per-group K/V plus one shared RoPE key), dense and
sparse top-k; geometry from ``plan.py``.

A program's rows are one group's query heads (dense: x all ``s_q`` query tokens), so every token's K/V bytes are
read by one program per group and the multi-token-prediction tokens ride along for free. The group index is the
fastest-varying program id so the ``g`` programs of one (sequence, split) run together and re-read the shared
rope key from L2. Variants (config fields): ``paged`` (dense, ``BLOCK_N`` divides the page: one block-table
lookup per tile, contiguous in-page addressing), ``rows_ahead`` (sparse: the next tile's row indices load one
iteration ahead).

Every row sees every key of a tile: dense tiles stop at token 0's position (and at the block table's capacity),
and under causal MTP the ``S_Q - 1`` keys only later tokens see run after the key loop in 16-key tiles (``TAIL``;
the first one loads before the loop), each key entering only the accumulators of the rows that see it, so a NaN
or inf value never multiplies into a row that does not see it (``0 · NaN``). Definitions: ``reference.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import (
    finish_rows,
    logical_to_physical,
    scale_scores,
    score_mode,
    softmax_step,
    split_bounds,
    split_lse_unit,
    store_rows,
)
from .._common.host import on_device
from .._common.paging import table_keys
from .plan import GQAPlan

__all__ = ["gqa_decode_fwd_kernel", "gqa_decode_triton"]


@triton.jit
def _dot(a, b, FP32: tl.constexpr):
    if FP32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _tail_tile(k_cache, v_cache, kr_cache, bt_row, t0, t_hi, grp, max_pages, num_pages, s_kp, s_kt, s_kg, s_vp, s_vt,
               s_vg, s_rp, s_rt, offs_dh, offs_dv, offs_dr, m_dh, m_dv, m_dr, PAGE_SIZE: tl.constexpr,
               DR: tl.constexpr):
    """K, rope K and V of the 16 boundary keys from ``t0`` (``< t_hi``; the others zero) and which exist."""
    pos = t0 + tl.arange(0, 16)
    row, ok = logical_to_physical(bt_row, pos, pos < t_hi, max_pages, num_pages, PAGE_SIZE)
    page = row // PAGE_SIZE
    slot = row % PAGE_SIZE
    grp = grp.to(tl.int64)  # every cache offset in int64: no product of an index and a stride wraps
    k = tl.load(k_cache + (page * s_kp + slot * s_kt + grp * s_kg)[:, None] + offs_dh[None, :],
                mask=ok[:, None] & m_dh[None, :], other=0.0)
    v = tl.load(v_cache + (page * s_vp + slot * s_vt + grp * s_vg)[:, None] + offs_dv[None, :],
                mask=ok[:, None] & m_dv[None, :], other=0.0)
    kr = k  # placeholder without rope (never read)
    if DR > 0:
        kr = tl.load(kr_cache + (page * s_rp + slot * s_rt)[:, None] + offs_dr[None, :],
                     mask=ok[:, None] & m_dr[None, :], other=0.0)
    return k, kr, v, ok


@triton.jit(do_not_specialize=["num_pages", "max_pages", "topk", "num_splits"])
def gqa_decode_fwd_kernel(
    q, k_cache, v_cache, kr_cache, block_table, seqlens, indices, topk_len,
    out, lse_out, o_part, lse_part,
    qk_scale, num_pages, max_pages, topk, num_splits, S_Q,
    s_qb, s_qs, s_qh,
    s_kp, s_kt, s_kg,
    s_vp, s_vt, s_vg,
    s_rp, s_rt,
    s_btb,
    s_ib, s_is, s_ig,
    s_ob, s_os, s_oh,
    s_lb, s_lh, s_ls,
    s_pb, s_ps, s_pq, s_ph,
    s_plb, s_pls, s_plq,
    G: tl.constexpr, NUM_MT: tl.constexpr, PAGE_SIZE: tl.constexpr,
    DH: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BDH: tl.constexpr, BDR: tl.constexpr, BDV: tl.constexpr,
    CAUSAL: tl.constexpr, SPARSE: tl.constexpr, HAS_TOPK_LEN: tl.constexpr, SPLIT: tl.constexpr,
    FP32: tl.constexpr, PAGED: tl.constexpr, ROWS_AHEAD: tl.constexpr, TAIL: tl.constexpr, RAW: tl.constexpr,
    LSE_RAW: tl.constexpr,
):
    pid_gm = tl.program_id(0)  # fastest: the g groups of one (sequence, split) run side by side
    split = tl.program_id(1)
    pid_bq = tl.program_id(2)
    grp = pid_gm // NUM_MT
    mt = pid_gm % NUM_MT
    if SPARSE:  # each query token has its own index set: one token per program, rows = heads
        b = pid_bq // S_Q
        j0 = pid_bq % S_Q
        nq = 1
    else:  # all s_q tokens folded into the rows: K/V read once for them
        b = pid_bq
        j0 = 0
        nq = S_Q
    b64 = b.to(tl.int64)
    seqlen = tl.maximum(tl.load(seqlens + b), 0)

    r = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < nq * G
    jj = j0 + r // G
    hh = grp * G + r % G
    offs_dh = tl.arange(0, BDH)
    offs_dv = tl.arange(0, BDV)
    m_dh = offs_dh < DH
    m_dv = offs_dv < DV

    q_row = q + b64 * s_qb + jj.to(tl.int64) * s_qs + hh.to(tl.int64) * s_qh
    qn = tl.load(q_row[:, None] + offs_dh[None, :], mask=row_ok[:, None] & m_dh[None, :], other=0.0)
    offs_dr = tl.arange(0, BDR)
    m_dr = offs_dr < DR
    if DR > 0:
        qr = tl.load(q_row[:, None] + DH + offs_dr[None, :], mask=row_ok[:, None] & m_dr[None, :], other=0.0)

    if SPARSE:
        length = topk
        if HAS_TOPK_LEN:
            length = tl.minimum(length, tl.load(topk_len + b))
        length = tl.maximum(length, 0)
        idx_row = indices + b64 * s_ib + j0.to(tl.int64) * s_is + grp.to(tl.int64) * s_ig
    else:
        length = table_keys(seqlen, max_pages, PAGE_SIZE)
    start, end = split_bounds(length, split, num_splits, BLOCK_N)
    if not SPARSE:
        if CAUSAL:
            # the tiles cover the keys every query token sees (up to token 0's position); the S_Q - 1 keys after
            # it, which only later tokens see, run after the tiles (TAIL), so that no row multiplies a value it
            # does not see (0 · NaN) in P·V
            if TAIL:
                t_lo = tl.minimum(tl.maximum(start, seqlen - S_Q + 1), end)
                t_hi = end
            end = tl.minimum(end, seqlen - S_Q + 1)
    bt_row = block_table + b64 * s_btb
    if SPARSE and ROWS_AHEAD:  # the next tile's row indices load one iteration ahead (loop-carried)
        nxt = tl.load(idx_row + start + tl.arange(0, BLOCK_N), mask=start + tl.arange(0, BLOCK_N) < end, other=-1)

    if TAIL:  # the first tile of them loads before the key loop: its latency hides behind the loop
        offs_t = tl.arange(0, 16)
        nk, nkr, nv, n_ok = _tail_tile(k_cache, v_cache, kr_cache, bt_row, t_lo, t_hi, grp, max_pages, num_pages,
                                       s_kp, s_kt, s_kg, s_vp, s_vt, s_vg, s_rp, s_rt, offs_dh, offs_dv, offs_dr,
                                       m_dh, m_dv, m_dr, PAGE_SIZE, DR)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BDV], tl.float32)
    arange_n = tl.arange(0, BLOCK_N)
    k_grp = grp.to(tl.int64) * s_kg  # the group's offsets in int64 (cache offsets past 2**31 do not wrap)
    v_grp = grp.to(tl.int64) * s_vg
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + arange_n
        pos = offs_n
        if SPARSE:  # physical rows from sparse_rows (-1: the entry does not count); inline as in mla_decode
            if ROWS_AHEAD:
                prow = nxt
                nxt = tl.load(idx_row + offs_n + BLOCK_N, mask=offs_n + BLOCK_N < end, other=-1)
            else:
                prow = tl.load(idx_row + offs_n, mask=offs_n < end, other=-1)
            ok = prow >= 0
            prow = tl.where(ok, prow, 0)
            page = (prow // PAGE_SIZE).to(tl.int64)
            slot = (prow % PAGE_SIZE).to(tl.int64)
            k_off = page * s_kp + slot * s_kt
            v_off = page * s_vp + slot * s_vt
            r_off = page * s_rp + slot * s_rt
        elif PAGED:  # BLOCK_N divides PAGE_SIZE and tiles start at multiples of BLOCK_N: one page per tile
            pg = (n0 + tl.zeros([], dtype=tl.int32)) // PAGE_SIZE  # scalar tensor (interpreter: not a python int)
            pg_ok = pg < max_pages
            blk = tl.load(bt_row + tl.where(pg_ok, pg, 0))
            pg_ok = (blk >= 0) & (blk < num_pages) & (pg < max_pages)
            ok = (offs_n < end) & ((arange_n * 0 + pg_ok.to(tl.int32)) != 0)  # vector mask (interpreter: no 0-d bool)
            base = tl.where(pg_ok, blk, 0).to(tl.int64)
            slot = ((n0 % PAGE_SIZE) + arange_n).to(tl.int64)
            k_off = base * s_kp + slot * s_kt
            v_off = base * s_vp + slot * s_vt
            r_off = base * s_rp + slot * s_rt
        else:
            row, ok = logical_to_physical(bt_row, pos, offs_n < end, max_pages, num_pages, PAGE_SIZE)
            page = row // PAGE_SIZE
            slot = row % PAGE_SIZE
            k_off = page * s_kp + slot * s_kt
            v_off = page * s_vp + slot * s_vt
            r_off = page * s_rp + slot * s_rt
        k = tl.load(k_cache + (k_off + k_grp)[:, None] + offs_dh[None, :],
                    mask=ok[:, None] & m_dh[None, :], other=0.0)
        if DR > 0:
            kr = tl.load(kr_cache + r_off[:, None] + offs_dr[None, :], mask=ok[:, None] & m_dr[None, :], other=0.0)
        s = _dot(qn, tl.trans(k), FP32)
        if DR > 0:
            s += _dot(qr, tl.trans(kr), FP32)
        s = scale_scores(s, qk_scale, RAW)
        # every row sees every key of a tile (dense: the loop bounds; sparse: one index row per program)
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new, alpha, p, l_i = softmax_step(s, m_i, l_i, qk_scale, 1, RAW)
        v = tl.load(v_cache + (v_off + v_grp)[:, None] + offs_dv[None, :],
                    mask=ok[:, None] & m_dv[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32)
        m_i = m_new

    if TAIL:  # causal MTP: the keys only later query tokens see, 16 per tile, each entering only those rows
        qpos = seqlen - S_Q + jj  # [BLOCK_M] each row's own position
        for t0 in range(t_lo, t_hi, 16):
            if t0 == t_lo:
                tk, tkr, tv, t_ok = nk, nkr, nv, n_ok
            else:
                tk, tkr, tv, t_ok = _tail_tile(k_cache, v_cache, kr_cache, bt_row, t0, t_hi, grp, max_pages,
                                               num_pages, s_kp, s_kt, s_kg, s_vp, s_vt, s_vg, s_rp, s_rt, offs_dh,
                                               offs_dv, offs_dr, m_dh, m_dv, m_dr, PAGE_SIZE, DR)
            t_pos = t0 + offs_t
            s = _dot(qn, tl.trans(tk), FP32)
            if DR > 0:
                s += _dot(qr, tl.trans(tkr), FP32)
            s = tl.where(t_ok[None, :] & (t_pos[None, :] <= qpos[:, None]), scale_scores(s, qk_scale, RAW),
                         float("-inf"))
            m_i, alpha, p, l_i = softmax_step(s, m_i, l_i, qk_scale, 1, RAW)
            acc = acc * alpha[:, None]
            # one key at a time through P·V, into the rows that see it only (no 0 · v for the others)
            for t in range(t0, tl.minimum(t0 + 16, t_hi)):
                one = offs_t == t - t0
                pv = _dot(tl.where(one[None, :], p, 0.0).to(tv.dtype), tl.where(one[:, None], tv, 0.0), FP32)
                acc += tl.where((t <= qpos)[:, None], pv, 0.0)

    o, lse = finish_rows(acc, m_i, l_i, qk_scale, SPLIT, RAW, LSE_RAW)
    store_rows(o, lse, row_ok[:, None] & m_dv[None, :], row_ok, offs_dv, b64, split, jj.to(tl.int64),
               hh.to(tl.int64), out, s_ob, s_os, s_oh, lse_out, s_lb, s_lh, s_ls,
               o_part, s_pb, s_ps, s_pq, s_ph, lse_part, s_plb, s_pls, s_plq, SPLIT)


def gqa_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                      cache_seqlens: torch.Tensor, k_rope_cache: torch.Tensor | None, rows_src: torch.Tensor | None,
                      topk_length: torch.Tensor | None, qk_scale: float, causal: bool, p: GQAPlan, out: torch.Tensor,
                      lse: torch.Tensor, o_part: torch.Tensor, lse_part: torch.Tensor) -> float:
    """Launch the kernel over plan ``p``. ``rows_src``: ``sparse_rows``' physical rows (``[B, s_q, topk]`` or
    ``[B, s_q, g, topk]``; None: dense); ``qk_scale = softmax_scale · log2(e)``. Writes ``out [B, s_q, h_q, d_v]``
    / ``lse [B, h_q, s_q]`` (one split) or the fp32 partials ``o_part [B, S, s_q, h_q, d_v]`` /
    ``lse_part [B, S, s_q, h_q]``. Returns the unit of the partials' lse, ``combine_splits``' ``unit``
    (``split_lse_unit``; 1.0 with one split)."""
    s_q = q.shape[1]
    num_pages, page_size, g, d_h = k_cache.shape
    d_v = v_cache.shape[-1]
    d_r = 0 if k_rope_cache is None else k_rope_cache.shape[-1]
    sparse = rows_src is not None
    S = p.num_splits
    split = S > 1
    if sparse:
        idx = rows_src if rows_src.dim() == 4 else rows_src.unsqueeze(2)
        s_i = (idx.stride(0), idx.stride(1), idx.stride(2) if rows_src.dim() == 4 else 0)
        topk = rows_src.shape[-1]
    else:
        idx, s_i, topk = block_table, (0, 0, 0), 0
    kr = k_rope_cache if k_rope_cache is not None else k_cache
    s_r = (k_rope_cache.stride(0), k_rope_cache.stride(1)) if k_rope_cache is not None else (0, 0)
    grid = (g * p.num_mt, S, p.nbq)
    qk_scale, raw = score_mode(qk_scale)
    unit = split_lse_unit(qk_scale, raw) if split else 1.0
    with on_device(q.device):
        gqa_decode_fwd_kernel[grid](
            q, k_cache, v_cache, kr, block_table, cache_seqlens, idx,
            topk_length if topk_length is not None else cache_seqlens,
            out, lse, o_part, lse_part,
            qk_scale, num_pages, block_table.shape[1], topk, S, s_q,
            q.stride(0), q.stride(1), q.stride(2),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            *s_r,
            block_table.stride(0),
            *s_i,
            out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1), lse.stride(2),
            *(o_part.stride()[:4] if split else (0, 0, 0, 0)),
            *(lse_part.stride()[:3] if split else (0, 0, 0)),
            G=p.G, NUM_MT=p.num_mt, PAGE_SIZE=page_size, DH=d_h, DR=d_r, DV=d_v,
            BLOCK_M=p.BLOCK_M, BLOCK_N=p.BLOCK_N, BDH=p.BDH, BDR=p.BDR, BDV=p.BDV,
            CAUSAL=bool(causal), SPARSE=sparse, HAS_TOPK_LEN=topk_length is not None, SPLIT=split,
            FP32=q.dtype == torch.float32,
            PAGED=p.cfg.paged and not sparse and page_size % p.BLOCK_N == 0, ROWS_AHEAD=sparse and p.cfg.rows_ahead,
            TAIL=bool(causal) and not sparse and s_q > 1, RAW=raw, LSE_RAW=unit != 1.0,
            num_warps=p.num_warps, num_stages=p.cfg.num_stages,
        )
    return unit
