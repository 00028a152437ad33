"""Stage ``out``: the forward's output from the chunk states and v_new."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _chunk_rows, _chunk_state_row, _empty_slot, _nan_from_first_bad
from .wu import VBAD_V, _vbad_at


@triton.jit(do_not_specialize=["T", "NT", "H", "HV"])
def gdn_output_fwd_kernel(q, k, vnew, gc, h, o, vbad, cu, cidx, coff, scale, T, NT, H,
                          HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                          BV: tl.constexpr, EARLY: tl.constexpr, IS_VARLEN: tl.constexpr, EMPTY_SLOTS: tl.constexpr = False):
    """o = scale·(e^gc·q·h + (q kᵀ ⊙ e^(gc_i−gc_j) ⊙ [i≥j])·v_new) for one chunk, value head and V block.
    q·h and q kᵀ accumulate over BK-wide slices of K (a loop the compiler pipelines). EARLY: v_new and gc are
    loaded before that loop (their latency overlaps it) instead of after it.

    A chunk ``wu`` marked in vbad (a non-finite v) has v_new non-finite in a suffix of each column's rows; its
    product reads the finite entries only (a later row's NaN must not reach an earlier row as 0·NaN), and the rows
    from each column's first non-finite one on are NaN."""
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if EMPTY_SLOTS:  # a device-built plan: the programs past the last chunk have none
        if _empty_slot(cidx, i_t):
            return
    i_b, i_hv, i_h, bos, Tn, t0, t, valid, x = _chunk_rows(i_t, i_bh, cu, cidx, T, H, HV, BT, IS_VARLEN)
    i_ch = _chunk_state_row(i_t, i_b, coff, cidx, NT, IS_VARLEN)
    cv = i_v * BV + tl.arange(0, BV)
    mv = valid[:, None] & (cv[None, :] < V)
    h_blk = h + (i_ch * HV + i_hv) * (K * V)
    oi = tl.zeros([BT, BV], dtype=tl.float32)
    qk = tl.zeros([BT, BT], dtype=tl.float32)
    if EARLY:
        gg = tl.load(gc + x * HV + i_hv, mask=valid, other=0.0)
        vn = tl.load(vnew + x[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0)
    for k0 in range(0, K, BK):
        ck = k0 + tl.arange(0, BK)
        mk = valid[:, None] & (ck[None, :] < K)
        qq = tl.load(q + x[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0)
        kk = tl.load(k + x[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0)
        hh = tl.load(h_blk + ck[:, None] * V + cv[None, :], mask=(ck[:, None] < K) & (cv[None, :] < V), other=0.0)
        oi = tl.dot(qq, hh.to(qq.dtype), oi)
        qk = tl.dot(qq, tl.trans(kk), qk)
    if not EARLY:
        gg = tl.load(gc + x * HV + i_hv, mask=valid, other=0.0)
    r = tl.arange(0, BT)
    m = (r[:, None] >= r[None, :]) & valid[:, None] & valid[None, :]
    P = tl.where(m, qk * tl.exp(tl.where(m, gg[:, None] - gg[None, :], 0.0)), 0.0)
    if not EARLY:
        vn = tl.load(vnew + x[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0)
    oi = oi * tl.exp(gg)[:, None]
    if (tl.load(vbad + _vbad_at(i_t, i_bh, tl.num_programs(1), HV)) & VBAD_V) != 0:
        ok = tl.abs(vn.to(tl.float32)) < float("inf")
        out = _nan_from_first_bad((oi + tl.dot(P.to(vn.dtype), tl.where(ok, vn, 0.0).to(vn.dtype))) * scale, ok, BT)
    else:
        out = (oi + tl.dot(P.to(vn.dtype), vn)) * scale
    tl.store(o + x[:, None] * (HV * V) + i_hv * V + cv[None, :], out.to(o.dtype.element_ty), mask=mv)

