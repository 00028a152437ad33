"""Stage ``state``: the sequential pass over each sequence's chunks (chunk states h, v_new, final state)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _chunk_k_g, _decay_update, _state_begin, _state_end


@triton.jit(do_not_specialize=["T", "NT", "P", "H", "HV"])
def gdn_state_fwd_kernel(k, w, u, gc, h, vnew, h0, ht, cu, coff, idx, T, NT, P, H, HV,
                         K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                         BV: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr,
                         POOL: tl.constexpr, V_FIRST: tl.constexpr = False):
    """Sequential pass over one sequence's chunks for (value head, V block): h[c] = state at chunk start
    (h's dtype), v_new = u − w·S, S ← e^gl·S + kᵀ (e^(gl−gc)·v_new); with STORE_HT the final S (fp32) to ht.
    BK = K rounded up to a power of two. Under sequence splitting cu / coff index segments and h0 holds each
    segment's start state. POOL: h0 and ht are one state pool ``[P, HV, K, V]``, sequence n reads and then writes
    row idx[n] (none outside [0, P): a zero start, no write). h0 and ht may be fp32, bf16 or fp16 (h0 is read to
    fp32, S is rounded to ht's dtype); V_FIRST: their rows are ``[V, K]``."""
    i_nh, i_hv, i_h, bos, Tn, boh, ck, cv, mkv, S = _state_begin(h0, idx, cu, coff, T, NT, P, H, HV, K, V, BK, BV,
                                                                 USE_H0, IS_VARLEN, POOL, V_FIRST)
    dt = w.dtype.element_ty
    r = tl.arange(0, BT)
    for i_c in range(0, tl.cdiv(Tn, BT)):
        Sd = S.to(dt)
        tl.store(h + (((boh + i_c) * HV + i_hv) * K + ck[:, None]) * V + cv[None, :], S.to(h.dtype.element_ty),
                 mask=mkv)
        t = i_c * BT + r
        valid = t < Tn
        x = bos + t
        mk = valid[:, None] & (ck[None, :] < K)
        mv = valid[:, None] & (cv[None, :] < V)
        ww = tl.load(w + x[:, None] * (HV * K) + i_hv * K + ck[None, :], mask=mk, other=0.0)
        uu = tl.load(u + x[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0).to(tl.float32)
        vn = uu - tl.dot(ww, Sd)
        tl.store(vnew + x[:, None] * (HV * V) + i_hv * V + cv[None, :], vn.to(vnew.dtype.element_ty), mask=mv)
        kk, gg, gl = _chunk_k_g(k, gc, x, valid, mk, bos, i_c * BT, Tn, i_hv, i_h, ck, H, HV, K, BT)
        S = _decay_update(S, vn, kk, gg, gl, valid)
    if STORE_HT:
        _state_end(ht, idx, S, i_nh, ck, cv, mkv, HV, P, K, V, POOL, V_FIRST)
