"""GQLA grouped-path decode (GQA over per-group K/V plus one shared RoPE key), dense and sparse top-k.

One program serves one group's query heads (and, dense, all ``s_q`` query tokens folded into the rows) as a
tile of ``BLOCK_M >= 16`` rows, so every token's K/V bytes are read by one program per group and the
multi-token-prediction tokens ride along for free. The group index is the fastest-varying program id so the
``g`` programs of one (sequence, split) run together and re-read the shared rope key from L2.
Split-KV partials are merged by the shared ``combine_splits`` kernel.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...dispatch import device_info, select_config
from .._common import (
    FLOAT_DTYPES,
    check_decode_inputs,
    check_kernel_device,
    check_same_device,
    check_same_dtype,
    check_tensor,
    combine_splits,
    finish_rows,
    logical_to_physical,
    softmax_step,
    sparse_rows,
    split_bounds,
    store_rows,
)

__all__ = ["gqa_decode", "gqa_decode_fwd"]

_LN2 = 0.6931471805599453
_LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, FP32: tl.constexpr):
    if FP32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


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
    FP32: tl.constexpr, PAGED: tl.constexpr, V_EARLY: tl.constexpr, ROWS_AHEAD: tl.constexpr,
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
    if DR > 0:
        offs_dr = tl.arange(0, BDR)
        m_dr = offs_dr < DR
        qr = tl.load(q_row[:, None] + DH + offs_dr[None, :], mask=row_ok[:, None] & m_dr[None, :], other=0.0)

    if SPARSE:
        length = topk
        if HAS_TOPK_LEN:
            length = tl.minimum(length, tl.load(topk_len + b))
        length = tl.maximum(length, 0)
        idx_row = indices + b64 * s_ib + j0.to(tl.int64) * s_is + grp.to(tl.int64) * s_ig
    else:
        length = seqlen
        qpos = seqlen - S_Q + jj  # causal position of each row's query token
    start, end = split_bounds(length, split, num_splits, BLOCK_N)
    bt_row = block_table + b64 * s_btb
    if SPARSE and ROWS_AHEAD:  # the next tile's row indices load one iteration ahead (loop-carried)
        nxt = tl.load(idx_row + start + tl.arange(0, BLOCK_N), mask=start + tl.arange(0, BLOCK_N) < end, other=-1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BDV], tl.float32)
    arange_n = tl.arange(0, BLOCK_N)
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
            slot = prow % PAGE_SIZE
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
            slot = (n0 % PAGE_SIZE) + arange_n
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
        k = tl.load(k_cache + (k_off + grp * s_kg)[:, None] + offs_dh[None, :],
                    mask=ok[:, None] & m_dh[None, :], other=0.0)
        if DR > 0:
            kr = tl.load(kr_cache + r_off[:, None] + offs_dr[None, :], mask=ok[:, None] & m_dr[None, :], other=0.0)
        if V_EARLY:  # V issued before the QK^T dot: more bytes in flight per program
            v = tl.load(v_cache + (v_off + grp * s_vg)[:, None] + offs_dv[None, :],
                        mask=ok[:, None] & m_dv[None, :], other=0.0)
        s = _dot(qn, tl.trans(k), FP32)
        if DR > 0:
            s += _dot(qr, tl.trans(kr), FP32)
        s = s * qk_scale  # log2 units
        valid = ok[None, :]
        if not SPARSE:
            if CAUSAL:
                valid = valid & (pos[None, :] <= qpos[:, None])
        s = tl.where(valid, s, float("-inf"))
        m_new, alpha, p, l_i = softmax_step(s, m_i, l_i, 1)
        if not V_EARLY:
            v = tl.load(v_cache + (v_off + grp * s_vg)[:, None] + offs_dv[None, :],
                        mask=ok[:, None] & m_dv[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32)
        m_i = m_new

    o, lse = finish_rows(acc, m_i, l_i)
    store_rows(o, lse, row_ok[:, None] & m_dv[None, :], row_ok, offs_dv, b64, split, jj.to(tl.int64),
               hh.to(tl.int64), out, s_ob, s_os, s_oh, lse_out, s_lb, s_lh, s_ls,
               o_part, s_pb, s_ps, s_pq, s_ph, lse_part, s_plb, s_pls, s_plq, SPLIT)


def _launch_params(G: int, rows: int, d_h: int, d_r: int, d_v: int, dtype: torch.dtype, device, sparse: bool) -> dict:
    """Launch params from ``select_config("gqa_decode")``.

    Config fields: ``BLOCK_N, MAX_M, num_warps, num_stages, SMEM, ACC_ELEMS_4W, WAVES`` and the kernel variants
    ``PAGED`` (dense, BLOCK_N | page_size: one block-table lookup per tile, contiguous in-page addressing),
    ``V_EARLY`` (V load issued before the QK^T dot), ``ROWS_AHEAD`` (sparse: the next tile's row indices loaded
    one iteration ahead), ``SPLITS`` (> 0 pins the split-KV count when the caller
    passes ``num_splits=0``).
    """
    key = {"sparse": sparse, "G": G, "rows": rows, "d_h": d_h, "d_r": d_r, "d_v": d_v}
    cfg = select_config("gqa_decode", key, device=device)
    block_m = min(cfg["MAX_M"], max(16, triton.next_power_of_2(rows)))
    block_n = cfg["BLOCK_N"]
    stages = cfg["num_stages"]
    bdh, bdr, bdv = (triton.next_power_of_2(d) for d in (d_h, d_r, d_v))
    elt = 4 if dtype == torch.float32 else 2
    # keep the pipelined K/V tiles within the shared-memory budget (d_R excluded: zero-rope == plain GQA)
    while block_n > 16 and stages * block_n * (bdh + bdv + 64) * elt + block_m * (bdh + 64) * elt > cfg["SMEM"]:
        block_n //= 2
    warps = cfg["num_warps"]
    if block_m * bdv > cfg.get("ACC_ELEMS_4W", 1 << 30):  # fp32 accumulator too large for 4 warps
        warps = max(warps, 8)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BDH=bdh, BDR=max(bdr, 16), BDV=bdv,
                num_warps=warps, num_stages=stages, waves=cfg.get("WAVES", 2), splits=int(cfg.get("SPLITS", 0)),
                paged=bool(cfg.get("PAGED", False)), v_early=bool(cfg.get("V_EARLY", False)),
                rows_ahead=bool(cfg.get("ROWS_AHEAD", False)))


def _num_splits(batch_programs: int, max_len: int, block_n: int, waves: int, device) -> int:
    """Split-KV count from shapes only: about ``waves`` programs per SM, splits of >= 4 tiles."""
    sm = device_info(device).sm_count
    want = max(1, -(-waves * sm // max(1, batch_programs)))
    cap = max(1, max_len // (4 * block_n))
    return int(max(1, min(want, cap, 64)))


def gqa_decode_fwd(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    cache_seqlens: torch.Tensor, k_rope_cache: torch.Tensor | None, softmax_scale: float, causal: bool,
    indices: torch.Tensor | None, topk_length: torch.Tensor | None, num_splits: int,
    out: torch.Tensor, lse: torch.Tensor,
) -> None:
    """Launcher on validated inputs; writes ``out [B, s_q, h_q, d_v]`` and ``lse [B, h_q, s_q]`` in place."""
    B, s_q, h_q, _ = q.shape
    num_pages, page_size, g, d_h = k_cache.shape
    d_v = v_cache.shape[-1]
    d_r = 0 if k_rope_cache is None else k_rope_cache.shape[-1]
    G = h_q // g
    sparse = indices is not None
    rows = G if sparse else G * s_q
    prm = _launch_params(G, rows, d_h, d_r, d_v, q.dtype, q.device, sparse)
    BLOCK_M, BLOCK_N = prm["BLOCK_M"], prm["BLOCK_N"]
    num_mt = triton.cdiv(rows, BLOCK_M)
    nbq = B * s_q if sparse else B
    if sparse:
        topk = indices.shape[-1]
        max_len = topk
    else:
        topk = 0
        max_len = block_table.shape[1] * page_size
    if num_splits == 0 and prm["splits"] > 0:  # config-pinned split count (tuning)
        num_splits = int(min(prm["splits"], max(1, max_len // BLOCK_N)))
    if num_splits == 0:
        num_splits = _num_splits(nbq * g * num_mt, max_len, BLOCK_N, prm["waves"], q.device)
    split = num_splits > 1

    dev = q.device
    dummy_i = block_table
    if sparse:
        rows_ = sparse_rows(indices, block_table, cache_seqlens, topk_length, page_size=page_size,
                            num_pages=num_pages, causal=causal)
        idx = rows_ if rows_.dim() == 4 else rows_.unsqueeze(2)
        s_i = (idx.stride(0), idx.stride(1), idx.stride(2) if rows_.dim() == 4 else 0)
    else:
        idx, s_i = dummy_i, (0, 0, 0)
    kr = k_rope_cache if k_rope_cache is not None else k_cache
    s_r = (k_rope_cache.stride(0), k_rope_cache.stride(1)) if k_rope_cache is not None else (0, 0)
    if split:
        o_part = torch.empty(B, num_splits, s_q, h_q, d_v, device=dev, dtype=torch.float32)
        lse_part = torch.empty(B, num_splits, s_q, h_q, device=dev, dtype=torch.float32)
    else:
        o_part, lse_part = out, lse
    grid = (g * num_mt, num_splits, nbq)
    gqa_decode_fwd_kernel[grid](
        q, k_cache, v_cache, kr, block_table, cache_seqlens, idx,
        topk_length if topk_length is not None else cache_seqlens,
        out, lse, o_part, lse_part,
        softmax_scale * _LOG2E, num_pages, block_table.shape[1], topk, num_splits, s_q,
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
        G=G, NUM_MT=num_mt, PAGE_SIZE=page_size, DH=d_h, DR=d_r, DV=d_v,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BDH=prm["BDH"], BDR=prm["BDR"], BDV=prm["BDV"],
        CAUSAL=bool(causal), SPARSE=sparse, HAS_TOPK_LEN=topk_length is not None, SPLIT=split,
        FP32=q.dtype == torch.float32,
        PAGED=prm["paged"] and not sparse and page_size % BLOCK_N == 0, V_EARLY=prm["v_early"],
        ROWS_AHEAD=sparse and prm["rows_ahead"],
        num_warps=prm["num_warps"], num_stages=prm["num_stages"],
    )
    if split:
        combine_splits(o_part, lse_part, out, lse)


def _check(q, k_cache, v_cache, block_table, cache_seqlens, k_rope_cache, indices, topk_length, num_splits):
    check_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES)
    num_pages, page_size, g, d_h = k_cache.shape
    check_tensor("v_cache", v_cache, shape=(num_pages, page_size, g, None), dtypes=FLOAT_DTYPES)
    if k_rope_cache is not None:
        check_tensor("k_rope_cache", k_rope_cache, shape=(num_pages, page_size, None), dtypes=FLOAT_DTYPES)
    check_same_dtype(q=q, k_cache=k_cache, v_cache=v_cache, k_rope_cache=k_rope_cache)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, k_rope_cache=k_rope_cache, block_table=block_table,
                      cache_seqlens=cache_seqlens, indices=indices, topk_length=topk_length)
    check_kernel_device(q.device, "gqla_triton.ops.gqa.reference.gqa_decode_reference")
    d_v = v_cache.shape[-1]
    d_r = 0 if k_rope_cache is None else k_rope_cache.shape[-1]
    for name, d in (("d_h (k_cache.shape[-1])", d_h), ("d_v (v_cache.shape[-1])", d_v)):
        if d <= 0 or d % 16 != 0 or d > 256:
            raise ValueError(f"{name}: expected a positive multiple of 16 <= 256, got {d}")
    if k_rope_cache is not None and (d_r <= 0 or d_r % 16 != 0 or d_r > 128):
        raise ValueError(f"k_rope_cache: rope dim d_R must be a positive multiple of 16 <= 128, got {d_r}")
    if g == 0:
        raise ValueError("k_cache: number of groups g (dim 2) must be >= 1")
    if q.shape[-1] != d_h + d_r:
        raise ValueError(f"q: last dim must be d_h + d_R = {d_h} + {d_r} = {d_h + d_r}, got {q.shape[-1]}")
    if q.shape[2] == 0 or q.shape[2] % g != 0:
        raise ValueError(f"q: h_q = {q.shape[2]} must be a positive multiple of the number of groups g = {g}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_rope_cache", k_rope_cache)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name}: the last dimension must be contiguous (stride 1)")
    check_decode_inputs(q, block_table, cache_seqlens, num_pages=num_pages, page_size=page_size,
                        indices=indices, topk_length=topk_length, num_groups=g, num_splits=num_splits)


def _gqa_decode_impl(q, k_cache, v_cache, block_table, cache_seqlens, k_rope_cache, softmax_scale, causal, indices,
                     topk_length, num_splits):
    # validated here (eagerly, on real tensors) so torch.compile traces only the op call
    _check(q, k_cache, v_cache, block_table, cache_seqlens, k_rope_cache, indices, topk_length, num_splits)
    B, s_q, h_q, _ = q.shape
    out = torch.empty(B, s_q, h_q, v_cache.shape[-1], device=q.device, dtype=q.dtype)
    lse = torch.empty(B, h_q, s_q, device=q.device, dtype=torch.float32)
    gqa_decode_fwd(q, k_cache, v_cache, block_table, cache_seqlens, k_rope_cache, softmax_scale, causal,
                   indices, topk_length, num_splits, out, lse)
    return out, lse


@torch.library.custom_op("gqla_triton::gqa_decode", mutates_args=())
def _gqa_decode_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    cache_seqlens: torch.Tensor, k_rope_cache: torch.Tensor | None, softmax_scale: float, causal: bool,
    indices: torch.Tensor | None, topk_length: torch.Tensor | None, num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _gqa_decode_impl(q, k_cache, v_cache, block_table, cache_seqlens, k_rope_cache, softmax_scale, causal,
                            indices, topk_length, num_splits)


@_gqa_decode_op.register_fake
def _(q, k_cache, v_cache, block_table, cache_seqlens, k_rope_cache, softmax_scale, causal, indices,
      topk_length, num_splits):
    B, s_q, h_q, _ = q.shape
    return (q.new_empty(B, s_q, h_q, v_cache.shape[-1]), q.new_empty(B, h_q, s_q, dtype=torch.float32))


def gqa_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    k_rope_cache: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = True,
    indices: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    num_splits: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged GQA / GQLA grouped-path decode attention, dense or sparse top-k.

    Args:
        q: ``[B, s_q, h_q, d_h + d_R]`` (bf16 / fp16 / fp32); head ``i`` uses group ``i // (h_q / g)``.
        k_cache: ``[num_pages, page_size, g, d_h]`` per-group keys (no rope part); page_size % 16 == 0.
        v_cache: ``[num_pages, page_size, g, d_v]`` per-group values.
        block_table: ``[B, max_pages]`` int32; token ``p`` of sequence ``b`` lives in page
            ``block_table[b, p // page_size]``. Entries outside ``[0, num_pages)`` are never read through.
        cache_seqlens: ``[B]`` int32 cached tokens per sequence (0 = empty: out 0, lse -inf).
        k_rope_cache: ``[num_pages, page_size, d_R]`` rope key stored once for all groups, or None (plain
            GQA, d_R = 0).
        softmax_scale: default ``(d_h + d_R) ** -0.5``.
        causal: query ``j`` sits at position ``cache_seqlens - s_q + j`` and sees keys up to it.
        indices: sparse top-k, ``[B, s_q, topk]`` int32 logical positions shared by all groups, or
            ``[B, s_q, g, topk]`` one set per group. Entries that are -1, outside ``[0, cache_seqlens)``,
            (causal) after the query's position, or beyond ``topk_length`` are ignored. Duplicates count
            as many times as they appear (exactly like gathering the selected keys, then attending).
        topk_length: ``[B]`` int32; only the first ``topk_length[b]`` entries of each index row count.
        num_splits: split-KV count; 0 = chosen from shapes only (no host sync; CUDA-graph safe).

    Returns:
        ``out [B, s_q, h_q, d_v]`` in q's dtype and ``lse [B, h_q, s_q]`` fp32 (natural log). A query
        that sees no key gives ``out = 0``, ``lse = -inf``.
    """
    check_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits: expected an int >= 0 (0 = choose from shapes), got {num_splits!r}")
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    softmax_scale = float(softmax_scale)
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale: expected a finite float, got {softmax_scale}")
    # eager calls skip torch.library's dispatch (tens of microseconds, the pace of a host-bound decode step);
    # torch.compile traces the custom op
    op = _gqa_decode_op if torch.compiler.is_compiling() else _gqa_decode_impl
    return op(q, k_cache, v_cache, block_table, cache_seqlens, k_rope_cache, softmax_scale, bool(causal), indices,
              topk_length, int(num_splits))
