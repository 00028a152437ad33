"""Stage ``state``: the sequential pass over each sequence's chunks (chunk states h, v_new, final state), and with
OUT the forward's output as well (the ``out`` stage fused into it)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _chunk_k_g, _decay_update, _h_row, _nan_from_first_bad, _state_heads, _state_ptr
from .wu import VBAD_V


@triton.jit(do_not_specialize=["T", "NT", "P", "H", "HV"])
def gdn_state_fwd_kernel(k, w, u, gc, h, vnew, h0, ht, cu, coff, idx, q, o, vbad, scale, T, NT, P, H, HV,
                         K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                         BV: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr,
                         POOL: tl.constexpr, V_FIRST: tl.constexpr = False, OUT: tl.constexpr = False,
                         STORE_STEPS: tl.constexpr = True):
    """Sequential pass over one sequence's chunks for (value head, V block): h[c] = state at chunk start
    (h's dtype), v_new = u − w·S, S ← e^gl·S + kᵀ (e^(gl−gc)·v_new); with STORE_HT the final S (fp32) to ht.
    BK = K rounded up to a power of two. Under sequence splitting cu / coff index segments and h0 holds each
    segment's start state. POOL: h0 and ht are one state pool ``[P, HV, K, V]``, sequence n reads and then writes
    row idx[n] (none outside [0, P): a zero start, no write). h0 and ht may be fp32, bf16 or fp16 (h0 is read to
    fp32, S is rounded to ht's dtype); V_FIRST: their rows are ``[V, K]``.

    OUT: also o = scale·(e^gc·q·S + (q kᵀ ⊙ e^(gc_i−gc_j) ⊙ [i≥j])·v_new) per chunk, from S and v_new rounded to
    the dtypes the ``out`` stage reads them in (``gdn_output_fwd_kernel``'s result). vbad ``[chunk-state rows,
    HV]`` marks the chunks with a non-finite v: their product reads v_new's finite entries only and each column
    is NaN from its first non-finite row on (a later row's NaN must not reach an earlier row as 0·NaN).
    STORE_STEPS: h and v_new are stored (off: only o and the final state leave the kernel)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_hv, i_h, bos, Tn, boh = _state_heads(i_nh, cu, coff, T, NT, H, HV, IS_VARLEN)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    mkv = (ck[:, None] < K) & (cv[None, :] < V)
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        row, mrow = _h_row(idx, i_nh, ck, cv, mkv, HV, P, K, V, POOL)
        S += tl.load(_state_ptr(h0, row, ck, cv, K, V, V_FIRST), mask=mrow, other=0.0).to(tl.float32)
    dt = w.dtype.element_ty
    dv = u.dtype.element_ty
    r = tl.arange(0, BT)
    for i_c in range(0, tl.cdiv(Tn, BT)):
        Sd = S.to(dt)
        if STORE_STEPS:
            tl.store(h + (((boh + i_c) * HV + i_hv) * K + ck[:, None]) * V + cv[None, :], S.to(h.dtype.element_ty),
                     mask=mkv)
        t = i_c * BT + r
        valid = t < Tn
        x = bos + t
        mk = valid[:, None] & (ck[None, :] < K)
        mv = valid[:, None] & (cv[None, :] < V)
        ww = tl.load(w + x[:, None] * (HV * K) + i_hv * K + ck[None, :], mask=mk, other=0.0)
        uu = tl.load(u + x[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0).to(tl.float32)
        if OUT:
            qq = tl.load(q + x[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0)
            oi = tl.dot(qq, Sd)
        vn = uu - tl.dot(ww, Sd)
        if STORE_STEPS:
            tl.store(vnew + x[:, None] * (HV * V) + i_hv * V + cv[None, :], vn.to(vnew.dtype.element_ty), mask=mv)
        kk, gg, gl = _chunk_k_g(k, gc, x, valid, mk, bos, i_c * BT, Tn, i_hv, i_h, ck, H, HV, K, BT)
        if OUT:
            qk = tl.dot(qq, tl.trans(kk))
            m = (r[:, None] >= r[None, :]) & valid[:, None] & valid[None, :]
            Pm = tl.where(m, qk * tl.exp(tl.where(m, gg[:, None] - gg[None, :], 0.0)), 0.0).to(dv)
            oi = oi * tl.exp(gg)[:, None]
            if (tl.load(vbad + (boh + i_c) * HV + i_hv) & VBAD_V) != 0:
                ok = tl.abs(vn.to(dv).to(tl.float32)) < float("inf")
                out = _nan_from_first_bad((oi + tl.dot(Pm, tl.where(ok, vn, 0.0).to(dv))) * scale, ok, BT)
            else:
                out = (oi + tl.dot(Pm, vn.to(dv))) * scale
            tl.store(o + x[:, None] * (HV * V) + i_hv * V + cv[None, :], out.to(o.dtype.element_ty), mask=mv)
        S = _decay_update(S, vn, kk, gg, gl, valid)
    if STORE_HT:
        row, mrow = _h_row(idx, i_nh, ck, cv, mkv, HV, P, K, V, POOL)  # formed again: nothing of it lives in the loop
        tl.store(_state_ptr(ht, row, ck, cv, K, V, V_FIRST), S.to(ht.dtype.element_ty), mask=mrow)
