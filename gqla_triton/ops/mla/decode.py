"""MLA absorb-path decode (DeepSeek MLA / GQLA absorb): MQA over a paged latent cache, dense or sparse top-k.

One program per (batch entry, KV split, row tile). A row tile folds ``HPT`` query heads and ``QPT`` query
tokens into ``BLOCK_H`` rows (>= 64 where h_q·s_q allows) so both products run on tensor cores:
``S = Q_lat·K_latᵀ + Q_rope·K_ropeᵀ`` and ``acc += P·V`` with ``V`` = the latent tile already loaded for
``S`` (never reloaded). Keys are gathered per token through the block table (``logical_to_physical``), so
``BLOCK_N`` need not divide the page size. Sparse tiles hold one query token (each token has its own
index row), all heads share the gathered tile, whose rows come translated to physical cache rows by
``sparse_rows`` (one small kernel per call) so the tile loop loads one row index per key. Definitions of
masking, empty rows and duplicate indices: ``reference.py``.
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
    choose_num_splits,
    combine_splits,
    finish_rows,
    logical_to_physical,
    softmax_step,
    sparse_rows,
    split_bounds,
    store_rows,
)
from .decode_ws import mla_decode_ws_fwd, ws_supported

__all__ = ["mla_decode", "mla_decode_fwd"]

IMPLS = ("auto", "triton", "gluon")
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


# lengths and tile geometry are runtime values: one compiled variant serves every h_q / s_q / causal flag
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
def _unchained_scores(q_lat, k_lat, q_rope, k_rope, qk_scale, ok, pos, last, rvalid, m_i, l_i,
                      DOT_PREC: tl.constexpr, SPARSE: tl.constexpr):
    """S = Q·Kᵀ of one key tile (latent and rope dots added, not accumulated into each other, which would chain
    them), masked, and one online-softmax step: ``(m_new, alpha, p, l_new)`` (CARRY_P and P_SCRATCH)."""
    s = (tl.dot(q_lat, tl.trans(k_lat), input_precision=DOT_PREC) * qk_scale
         + tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PREC) * qk_scale)
    if SPARSE:
        keep = ok[None, :] & rvalid[:, None]
    else:
        keep = ok[None, :] & (pos[None, :] <= last[:, None])
    return softmax_step(tl.where(keep, s, float("-inf")), m_i, l_i, 1)


@triton.jit(do_not_specialize=["s_q", "h_q", "max_pages", "num_pages", "topk", "num_splits", "h_tiles", "HPT", "QPT",
                               "causal"])
def mla_decode_fwd_kernel(
    q, kv, block_table, seqlens, indices, topk_length,
    out, lse, o_part, lse_part, pbuf, abuf,
    qk_scale,  # softmax_scale * log2(e)
    s_q, h_q, max_pages, num_pages, topk, num_splits, h_tiles, HPT, QPT, causal,
    s_qb, s_qq, s_qh,
    s_kvp, s_kvt,
    s_btb,
    s_ib, s_iq,
    s_ob, s_oq, s_oh,
    s_lb, s_lh, s_lq,
    s_pb, s_ps, s_pq, s_ph,
    s_plb, s_pls, s_plq,
    DV: tl.constexpr, DR: tl.constexpr, BDV: tl.constexpr, BDR: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    SPARSE: tl.constexpr, HAS_TOPK_LEN: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PREC: tl.constexpr, PAGED_TILES: tl.constexpr, DV_SPLIT: tl.constexpr, TRANS: tl.constexpr,
    CARRY_P: tl.constexpr, P_SCRATCH: tl.constexpr, ASM_SYNC: tl.constexpr, ROWS_AHEAD: tl.constexpr,
):
    pid_bs = tl.program_id(0)
    pid_t = tl.program_id(1)
    if DV_SPLIT == 2:  # this program owns value columns [c·BDV/2, (c+1)·BDV/2); S is computed in full
        chunk = pid_t % 2
        pid_t = pid_t // 2
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

    seqlen = tl.load(seqlens + b)
    # [BLOCK_H] last key position each row sees (its own position under causal MTP)
    last = seqlen - 1 + tl.where(causal != 0, qi + 1 - s_q, 0)

    offs_r = tl.arange(0, BDR)
    mr = offs_r < DR
    q_row = q + b64 * s_qb + qi.to(tl.int64) * s_qq + h.to(tl.int64) * s_qh
    if DV_SPLIT == 2:
        offs_v = chunk * (BDV // 2) + tl.arange(0, BDV // 2)  # own value columns (PV operand, output)
        offs_o = (1 - chunk) * (BDV // 2) + tl.arange(0, BDV // 2)  # the other half (only for S)
        mo = offs_o < DV
        if TRANS:
            q_oth = tl.load(q_row[None, :] + offs_o[:, None], mask=rvalid[None, :] & mo[:, None], other=0.0)
        else:
            q_oth = tl.load(q_row[:, None] + offs_o[None, :], mask=rvalid[:, None] & mo[None, :], other=0.0)
    else:
        offs_v = tl.arange(0, BDV)
    mv = offs_v < DV
    if TRANS:  # Qᵀ tiles [channels, rows]: the B operand of Sᵀ = K·Qᵀ (kept in shared memory, not registers)
        q_lat = tl.load(q_row[None, :] + offs_v[:, None], mask=rvalid[None, :] & mv[:, None], other=0.0)
        q_rope = tl.load(q_row[None, :] + DV + offs_r[:, None], mask=rvalid[None, :] & mr[:, None], other=0.0)
    else:
        q_lat = tl.load(q_row[:, None] + offs_v[None, :], mask=rvalid[:, None] & mv[None, :], other=0.0)
        q_rope = tl.load(q_row[:, None] + DV + offs_r[None, :], mask=rvalid[:, None] & mr[None, :], other=0.0)

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
        lo, hi = split_bounds(seqlen, split, num_splits, BLOCK_N)
        if causal != 0:  # no key after the tile's last query
            q_hi = tl.minimum(qt * QPT + QPT, s_q)
            hi = tl.minimum(hi, seqlen - s_q + q_hi)
        if PAGED_TILES and ROWS_AHEAD:  # the next tile's block-table entry loads one iteration ahead
            nxt = _tile_block(bt_row, lo, max_pages, PAGE_SIZE)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    if TRANS:
        acc = tl.zeros([BDV // DV_SPLIT, BLOCK_H], tl.float32)  # Oᵀ
    else:
        acc = tl.zeros([BLOCK_H, BDV // DV_SPLIT], tl.float32)
    if CARRY_P:  # P·V of the previous key tile, run one iteration late (see the CARRY_P branch below)
        p_prev = tl.zeros([BLOCK_H, BLOCK_N], kv.dtype.element_ty)
        alpha = tl.full([BLOCK_H], 1.0, tl.float32)
        # the previous tile's rows: its value tile is loaded again (an L2 hit) rather than held in registers
        prev_row = kv + tl.zeros([BLOCK_N], tl.int64)
        prev_ok = tl.zeros([BLOCK_N], tl.int1)
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
            kv_row = kv + (prow // PAGE_SIZE).to(tl.int64) * s_kvp + (prow % PAGE_SIZE) * s_kvt
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
            kv_row = (kv + tl.where(pok, blk, 0).to(tl.int64) * s_kvp
                      + ((start % PAGE_SIZE) + tl.arange(0, BLOCK_N)) * s_kvt)
        else:
            row, ok = logical_to_physical(bt_row, pos, offs_n < hi, max_pages, num_pages, PAGE_SIZE)
            kv_row = kv + (row // PAGE_SIZE) * s_kvp + (row % PAGE_SIZE) * s_kvt
        k_lat = tl.load(kv_row[:, None] + offs_v[None, :], mask=ok[:, None] & mv[None, :], other=0.0)
        k_rope = tl.load(kv_row[:, None] + DV + offs_r[None, :], mask=ok[:, None] & mr[None, :], other=0.0)
        if TRANS:  # Sᵀ = K·Qᵀ [BLOCK_N, BLOCK_H]; Oᵀ += Vᵀ·Pᵀ
            st = tl.dot(k_lat, q_lat, input_precision=DOT_PREC)
            if DV_SPLIT == 2:
                k_oth = tl.load(kv_row[:, None] + offs_o[None, :], mask=ok[:, None] & mo[None, :], other=0.0)
                st = tl.dot(k_oth, q_oth, st, input_precision=DOT_PREC)
            st = tl.dot(k_rope, q_rope, st, input_precision=DOT_PREC)
            if SPARSE:
                keep = ok[:, None] & rvalid[None, :]
            else:
                keep = ok[:, None] & (pos[:, None] <= last[None, :])
            st = tl.where(keep, st * qk_scale, float("-inf"))
            m_new, alpha, pt, l_i = softmax_step(st, m_i, l_i, 0)
            acc = acc * alpha[None, :]
            acc = tl.dot(tl.trans(k_lat), pt.to(k_lat.dtype), acc, input_precision=DOT_PREC)
        elif P_SCRATCH:
            # P and alpha cross a global scratch tile (an L2 round trip): the store / load ends S's forward slice
            # like CARRY_P's loop edge, so Triton splits S's keys over the warpgroups (no duplicated QKᵀ, no dv
            # split), while P·V stays in the iteration of its tile. The tiles alternate between two buffers, so one
            # barrier per tile orders both the read after this tile's writes and the next write to the same buffer
            # (two tiles later) after every read.
            m_new, alpha, p, l_i = _unchained_scores(q_lat, k_lat, q_rope, k_rope, qk_scale, ok, pos, last, rvalid,
                                                     m_i, l_i, DOT_PREC, SPARSE)
            nb = ((start - lo) // BLOCK_N) % 2
            tl.store(p_tile + nb * (BLOCK_H * BLOCK_N), p.to(pbuf.dtype.element_ty))
            tl.store(a_row + nb * BLOCK_H, alpha)  # alpha too: it reaches the PV dot through the accumulator
            z = _cta_sync(nb, ASM_SYNC)
            pp = tl.load(p_tile + (nb * (BLOCK_H * BLOCK_N) + z))
            aa = tl.load(a_row + (nb * BLOCK_H + z))
            acc = acc * aa[:, None]
            acc = tl.dot(pp, k_lat, acc, input_precision=DOT_PREC)
        elif CARRY_P:
            # Triton gives a dot whose result reaches another dot the warp layout [num_warps, 1]: with 64 rows
            # and 8 warps both warpgroups would compute the whole S. P and alpha cross the loop edge instead
            # (a loop-carried value ends the forward slice), so S splits its keys over the two warpgroups and
            # the PV product of tile j runs in iteration j + 1.
            v_prev = tl.load(prev_row[:, None] + offs_v[None, :], mask=prev_ok[:, None] & mv[None, :], other=0.0)
            acc = acc * alpha[:, None]
            acc = tl.dot(p_prev, v_prev, acc, input_precision=DOT_PREC)
            m_new, alpha, p, l_i = _unchained_scores(q_lat, k_lat, q_rope, k_rope, qk_scale, ok, pos, last, rvalid,
                                                     m_i, l_i, DOT_PREC, SPARSE)
            p_prev = p.to(kv.dtype.element_ty)
            prev_row = kv_row
            prev_ok = ok
        else:
            s = tl.dot(q_lat, tl.trans(k_lat), input_precision=DOT_PREC)
            if DV_SPLIT == 2:
                k_oth = tl.load(kv_row[:, None] + offs_o[None, :], mask=ok[:, None] & mo[None, :], other=0.0)
                s = tl.dot(q_oth, tl.trans(k_oth), s, input_precision=DOT_PREC)
            s = tl.dot(q_rope, tl.trans(k_rope), s, input_precision=DOT_PREC)
            if SPARSE:
                keep = ok[None, :] & rvalid[:, None]
            else:
                keep = ok[None, :] & (pos[None, :] <= last[:, None])
            s = tl.where(keep, s * qk_scale, float("-inf"))
            m_new, alpha, p, l_i = softmax_step(s, m_i, l_i, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(k_lat.dtype), k_lat, acc, input_precision=DOT_PREC)
        m_i = m_new
    if CARRY_P:
        v_prev = tl.load(prev_row[:, None] + offs_v[None, :], mask=prev_ok[:, None] & mv[None, :], other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p_prev, v_prev, acc, input_precision=DOT_PREC)

    o, lse_row = finish_rows(tl.trans(acc) if TRANS else acc, m_i, l_i)
    # both halves of a DV split compute S, in a different fp32 summation order: one of them owns lse, so that
    # the result does not depend on which program stores last
    lse_mask = rvalid
    if DV_SPLIT == 2:
        lse_mask = rvalid & ((r * 0 + chunk) == 0)
    store_rows(o, lse_row, rvalid[:, None] & mv[None, :], lse_mask, offs_v, b64, split, qi.to(tl.int64),
               h.to(tl.int64), out, s_ob, s_oq, s_oh, lse, s_lb, s_lh, s_lq,
               o_part, s_pb, s_ps, s_pq, s_ph, lse_part, s_plb, s_pls, s_plq, SPLIT)


def _choose_splits(programs: int, max_len: int, sm_count: int, cfg: dict) -> int:
    """Split count from shapes only (no device values). Minimises the wave-quantised time of the main kernel,
    ``ceil(programs·S / slots) / S`` (in units of one unsplit program), plus the combine's cost, which grows
    with the number of partial tiles: ``split_cost · programs·S / slots`` when S > 1. ``slots = sm_count ·
    ctas_per_sm`` (one ~147 KB program per SM on H200). Splits never get shorter than four key blocks.
    ``split_rule: "even"`` in the config table selects ``_common.choose_num_splits`` instead."""
    if cfg.get("split_rule", "waves") != "waves":
        return choose_num_splits(programs, 1, max_len, sm_count, block_n=cfg["BLOCK_N"],
                                 max_splits=cfg.get("max_splits", 64))
    slots = max(1, sm_count * cfg.get("ctas_per_sm", 1))
    cap = max(1, min(cfg.get("max_splits", 64), max_len // (4 * cfg["BLOCK_N"])))
    penalty = cfg.get("split_cost", 0.02)
    best, best_cost = 1, float("inf")
    for S in range(1, cap + 1):
        cost = -(-programs * S // slots) / S + (penalty * programs * S / slots if S > 1 else 0.0)
        if cost < best_cost - 1e-9:
            best, best_cost = S, cost
    return best


def _config_key(q, head_dim_v, sparse, impl) -> dict:
    return {"D": q.shape[-1], "DV": head_dim_v, "sparse": sparse, "s_q": q.shape[1], "impl": impl,
            "fp32": q.dtype == torch.float32}


def _use_ws(impl, q, kv_cache, head_dim_v, sparse) -> bool:
    """Whether ``impl`` runs the warp-specialised Gluon kernel (``decode_ws``): ``"gluon"`` always (ValueError
    where it cannot), ``"auto"`` where the inputs allow it and this GPU's table has an ``impl: ws`` entry."""
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    if impl == "triton":
        return False
    info = device_info(q)
    why = ("the Triton interpreter runs no Gluon kernel" if info.interpreter
           else f"{info.name} is not a Hopper GPU (sm_90)" if info.capability[0] != 9
           else ws_supported(q, kv_cache, head_dim_v))
    if impl == "gluon":
        if why is not None:
            raise ValueError(f"impl='gluon': the warp-specialised MLA kernel cannot run here: {why}")
        return True
    return why is None and select_config("mla_decode", _config_key(q, head_dim_v, sparse, "ws"),
                                         device=q.device).get("impl") == "ws"


def _plan(q, kv_cache, block_table, head_dim_v, sparse, topk, num_splits, impl="triton"):
    """Launch geometry from shapes only (no device values). ``impl``: "triton" or "ws" (the config key)."""
    B, s_q, h_q, D = q.shape
    page_size = kv_cache.shape[1]
    cfg = select_config("mla_decode", _config_key(q, head_dim_v, sparse, impl), device=q.device)
    rows = cfg["BLOCK_H"]
    HPT = min(h_q, rows)
    QPT = 1 if sparse else max(1, min(s_q, rows // HPT))
    BLOCK_H = max(16, triton.next_power_of_2(HPT * QPT))
    h_tiles = triton.cdiv(h_q, HPT)
    q_tiles = triton.cdiv(s_q, QPT)
    if num_splits == 0:
        cap = topk if sparse else block_table.shape[1] * page_size
        programs = B * h_tiles * q_tiles * (2 if cfg.get("dv_split", 1) == 2 else 1)
        num_splits = _choose_splits(programs, cap, device_info(q.device).sm_count, cfg)
    return cfg, HPT, QPT, BLOCK_H, h_tiles, q_tiles, num_splits


def mla_decode_fwd(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal,
                   indices, topk_length, num_splits, *, impl="auto", out=None, lse=None, poison_partials=False):
    """Launcher (inputs already validated). Returns ``(out [B, s_q, h_q, head_dim_v] q.dtype, lse [B, h_q, s_q])``.

    ``impl``: ``"triton"`` (the portable kernel below), ``"gluon"`` (the warp-specialised Hopper kernel of
    ``decode_ws``; ValueError where it cannot run) or ``"auto"`` (the config table's ``impl`` where the inputs
    allow it). ``out`` / ``lse`` may be given (written in place); ``poison_partials`` NaN-fills the split buffers.
    """
    B, s_q, h_q, D = q.shape
    num_pages, page_size = kv_cache.shape[:2]
    sparse = indices is not None
    topk = indices.shape[-1] if sparse else 0
    use_ws = _use_ws(impl, q, kv_cache, head_dim_v, sparse)
    cfg, HPT, QPT, BLOCK_H, h_tiles, q_tiles, S = _plan(q, kv_cache, block_table, head_dim_v, sparse, topk,
                                                         num_splits, "ws" if use_ws else "triton")
    if q.stride(-1) != 1:
        q = q.contiguous()
    DV = head_dim_v
    DR = D - DV
    if out is None:
        out = torch.empty(B, s_q, h_q, DV, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(B, h_q, s_q, dtype=torch.float32, device=q.device)
    if S > 1:
        o_part = torch.empty(B, S, s_q, h_q, DV, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(B, S, s_q, h_q, dtype=torch.float32, device=q.device)
        if poison_partials:
            o_part.fill_(float("nan"))
            lse_part.fill_(float("nan"))
    else:
        o_part, lse_part = out.new_empty(1, 1, 1, 1), lse.new_empty(1, 1, 1)
    idx = (sparse_rows(indices, block_table, cache_seqlens, topk_length, page_size=page_size, num_pages=num_pages,
                       causal=causal) if sparse else block_table)
    if use_ws:
        mla_decode_ws_fwd(q, kv_cache, idx, cache_seqlens, head_dim_v, causal, topk_length, sparse, cfg, HPT, QPT,
                          h_tiles, q_tiles, S, out, lse, o_part, lse_part, softmax_scale * _LOG2E)
        if S > 1:
            combine_splits(o_part, lse_part, out, lse)
        return out, lse
    tkl = topk_length if topk_length is not None else cache_seqlens
    BDV = max(16, triton.next_power_of_2(DV))
    # variants (config fields): one block-table load per page-aligned tile; value columns split over 2 programs;
    # transposed products (Sᵀ = K·Qᵀ, Oᵀ += Vᵀ·Pᵀ) so Q is a shared-memory operand instead of living in registers
    paged = bool(cfg.get("paged_tiles", False)) and not sparse and page_size % cfg["BLOCK_N"] == 0
    dv_split = 2 if cfg.get("dv_split", 1) == 2 and BDV >= 32 else 1
    carry = bool(cfg.get("carry_p", False))
    pscr = bool(cfg.get("p_scratch", False))
    if (carry or pscr) and (dv_split == 2 or cfg.get("transposed", False) or (carry and pscr)):
        raise ValueError(f"mla_decode config: carry_p / p_scratch need dv_split 1, transposed false and exclude "
                         f"each other, got {cfg}")
    grid = (B * S, h_tiles * q_tiles * dv_split)
    # p_scratch: two [BLOCK_H, BLOCK_N] tiles per program (in q's dtype: the PV operand) and two alpha rows
    pbuf = (torch.empty(grid[0] * grid[1] * 2 * BLOCK_H * cfg["BLOCK_N"], dtype=q.dtype, device=q.device) if pscr
            else out)
    abuf = torch.empty(grid[0] * grid[1] * 2 * BLOCK_H, dtype=torch.float32, device=q.device) if pscr else lse
    mla_decode_fwd_kernel[grid](
        q, kv_cache, block_table, cache_seqlens, idx, tkl,
        out, lse, o_part, lse_part, pbuf, abuf,
        softmax_scale * _LOG2E,
        s_q, h_q, block_table.shape[1], num_pages, topk, S, h_tiles, HPT, QPT, int(bool(causal)),
        q.stride(0), q.stride(1), q.stride(2),
        kv_cache.stride(0), kv_cache.stride(1),
        block_table.stride(0),
        idx.stride(0), idx.stride(1) if sparse else 0,
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2),
        *(o_part.stride()[:4] if S > 1 else (0, 0, 0, 0)),
        *(lse_part.stride()[:3] if S > 1 else (0, 0, 0)),
        DV=DV, DR=DR, BDV=BDV, BDR=max(16, triton.next_power_of_2(max(DR, 1))),
        PAGE_SIZE=page_size, BLOCK_H=BLOCK_H, BLOCK_N=cfg["BLOCK_N"], SPARSE=sparse, HAS_TOPK_LEN=topk_length is not None, SPLIT=S > 1,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", PAGED_TILES=paged, DV_SPLIT=dv_split,
        TRANS=bool(cfg.get("transposed", False)), CARRY_P=carry, P_SCRATCH=pscr,
        ASM_SYNC=not device_info(q).interpreter,
        ROWS_AHEAD=(sparse or paged) and bool(cfg.get("rows_ahead", False)),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),  # register cap (2 CTAs per SM)
    )
    if S > 1:
        combine_splits(o_part, lse_part, out, lse)
    return out, lse


def _validate(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, indices, topk_length,
              num_splits):
    check_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("kv_cache", kv_cache, ndim=4, dtypes=FLOAT_DTYPES)
    check_same_dtype(q=q, kv_cache=kv_cache)
    check_same_device(q=q, kv_cache=kv_cache, block_table=block_table, cache_seqlens=cache_seqlens,
                      indices=indices, topk_length=topk_length)
    D = q.shape[-1]
    if kv_cache.shape[2] != 1:
        raise ValueError(f"kv_cache: expected one latent head (dim 2 == 1), got shape {list(kv_cache.shape)}")
    if kv_cache.shape[3] != D:
        raise ValueError(f"kv_cache: last dim {kv_cache.shape[3]} != q's last dim {D} (latent + rope)")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache: the last dimension must be contiguous (stride 1)")
    if q.shape[2] == 0:
        raise ValueError(f"q: expected at least one head, got shape {list(q.shape)}")
    if not isinstance(head_dim_v, int) or not 0 < head_dim_v <= D:
        raise ValueError(f"head_dim_v: expected an int in [1, {D}] (value = first head_dim_v channels), "
                         f"got {head_dim_v!r}")
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale)):
        raise ValueError(f"softmax_scale: expected a finite float or None, got {softmax_scale!r}")
    check_decode_inputs(q, block_table, cache_seqlens, num_pages=kv_cache.shape[0], page_size=kv_cache.shape[1],
                        indices=indices, topk_length=topk_length, num_splits=num_splits)
    if indices is not None and indices.dim() != 3:
        raise ValueError(f"indices: expected shape [B, s_q, topk] (shared by all heads), got {list(indices.shape)}")
    check_kernel_device(q.device, "gqla_triton.ops.mla.reference.mla_decode_ref")


@torch.library.custom_op("gqla_triton::mla_decode", mutates_args=())
def _mla_decode_op(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                   head_dim_v: int, softmax_scale: float, causal: bool, indices: torch.Tensor | None,
                   topk_length: torch.Tensor | None, num_splits: int, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    return mla_decode_fwd(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, indices,
                          topk_length, num_splits, impl=impl)


@_mla_decode_op.register_fake
def _(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, indices, topk_length, num_splits,
      impl):
    B, s_q, h_q, _ = q.shape
    return q.new_empty(B, s_q, h_q, head_dim_v), q.new_empty(B, h_q, s_q, dtype=torch.float32)


def mla_decode(q, kv_cache, block_table, cache_seqlens, head_dim_v=512, softmax_scale=None, causal=True,
               indices=None, topk_length=None, num_splits=0, *, impl="auto"):
    """MLA decode over a paged latent cache (absorb path), dense or sparse top-k. Forward only.

    Args:
        q: ``[B, s_q, h_q, D]`` bf16/fp16/fp32, ``D = r + d_R`` (latent first, then rope; 512 + 64 tuned).
        kv_cache: ``[num_pages, page_size, 1, D]``, same dtype; the value of a token is the first
            ``head_dim_v`` channels of its row. ``page_size`` a multiple of 16.
        block_table: ``[B, max_pages]`` int32; token ``p`` of sequence ``b`` lives in page
            ``block_table[b, p // page_size]``. Pages outside the table or the cache are ignored.
        cache_seqlens: ``[B]`` int32 tokens in the cache per sequence (0 allowed).
        head_dim_v: value width (default 512).
        softmax_scale: default ``D ** -0.5``.
        causal: with ``s_q > 1``, query ``j`` sits at ``cache_seqlens - s_q + j`` and sees keys up to it.
        indices: optional ``[B, s_q, topk]`` int32 logical positions shared by all heads (sparse). Entries
            < 0, >= ``cache_seqlens[b]`` or after the query's position (causal) are ignored; a duplicated
            entry counts once per occurrence. Any value is safe (never addresses outside the cache).
        topk_length: optional ``[B]`` int32: only the first ``topk_length[b]`` entries of each row count.
        num_splits: split-KV count; 0 = chosen from shapes (no host sync, CUDA-graph safe).
        impl: ``"auto"`` (the GPU's config table: on Hopper the warp-specialised Gluon kernel for bf16/fp16 with
            latent 512 + rope 64, the portable Triton kernel otherwise), ``"triton"`` or
            ``"gluon"`` (ValueError where that kernel cannot run).

    bf16/fp16 run on tensor cores (the tuned path); fp32 is exact (IEEE dot, small tiles) and slow on GPUs.

    Returns:
        ``out [B, s_q, h_q, head_dim_v]`` in q's dtype and ``lse [B, h_q, s_q]`` fp32 (natural log). A query
        that sees no key gives ``out = 0`` and ``lse = -inf``.
    """
    _validate(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, indices, topk_length,
              num_splits)
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    scale = float(q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale)
    # eager calls skip torch.library's dispatch (tens of microseconds, the pace of a host-bound decode step);
    # torch.compile traces the custom op
    op = _mla_decode_op if torch.compiler.is_compiling() else mla_decode_fwd
    return op(q, kv_cache, block_table, cache_seqlens, int(head_dim_v), scale, bool(causal), indices, topk_length,
              int(num_splits), impl=impl)
