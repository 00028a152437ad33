"""Stage ``dvl`` (backward): the intra-chunk term of dv_new, scale·Pᵀ·dO."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _chunk_rows, _empty_slot


@triton.jit(do_not_specialize=["T", "H", "HV"])
def gdn_dv_local_kernel(q, k, gc, do, dvl, cu, cidx, scale, T, H, HV,
                        K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        EARLY: tl.constexpr, IS_VARLEN: tl.constexpr, EMPTY_SLOTS: tl.constexpr = False):
    """dvl_j = scale·Σ_{i≥j} (q_i·k_j) e^(gc_i−gc_j) dO_i ([rows, HV, V]); k qᵀ over BK-wide slices of K. EARLY:
    dO and gc are loaded before that loop instead of after it."""
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if EMPTY_SLOTS:  # a device-built plan: the programs past the last chunk have none
        if _empty_slot(cidx, i_t):
            return
    i_b, i_hv, i_h, bos, Tn, t0, t, valid, x = _chunk_rows(i_t, i_bh, cu, cidx, T, H, HV, BT, IS_VARLEN)
    cv = i_v * BV + tl.arange(0, BV)
    mv = valid[:, None] & (cv[None, :] < V)
    kq = tl.zeros([BT, BT], dtype=tl.float32)
    if EARLY:
        gg = tl.load(gc + x * HV + i_hv, mask=valid, other=0.0)
        dd = tl.load(do + x[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0)
    for k0 in range(0, K, BK):
        ck = k0 + tl.arange(0, BK)
        mk = valid[:, None] & (ck[None, :] < K)
        qq = tl.load(q + x[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0)
        kk = tl.load(k + x[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0)
        kq = tl.dot(kk, tl.trans(qq), kq)
    if not EARLY:
        gg = tl.load(gc + x * HV + i_hv, mask=valid, other=0.0)
    r = tl.arange(0, BT)
    m = (r[None, :] >= r[:, None]) & valid[:, None] & valid[None, :]  # rows j, cols i
    PT = tl.where(m, kq * tl.exp(tl.where(m, gg[None, :] - gg[:, None], 0.0)), 0.0)
    if not EARLY:
        dd = tl.load(do + x[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0)
    dvv = tl.dot(PT.to(dd.dtype), dd) * scale
    tl.store(dvl + x[:, None] * (HV * V) + i_hv * V + cv[None, :], dvv.to(dvl.dtype.element_ty), mask=mv)

