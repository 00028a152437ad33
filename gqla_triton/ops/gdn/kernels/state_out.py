"""Stage ``sout``: a forward without gradient in one sequential pass per (sequence or segment, value head, V block).
Each chunk's w / u products are formed from Ainv on the fly and the state stays in registers: only o and the
final state leave the kernel (no w, u, h or v_new in HBM)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _beta_in, _chunk_k_g, _decay_update, _nan_from_first_bad, _state_begin, _state_end, _vnew_ainv


@triton.jit(do_not_specialize=["T", "NT", "P", "H", "HV"])
def gdn_state_out_kernel(q, k, v, beta, gc, Ainv, o, h0, ht, cu, coff, idx, scale, T, NT, P, H, HV,
                         K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         USE_H0: tl.constexpr, STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr, POOL: tl.constexpr,
                         V_FIRST: tl.constexpr, BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr):
    """Per chunk, from the state S at its start (``gdn_state_fwd_kernel``'s arguments and layouts, plus q, v, beta
    and Ainv ``[rows, HV, BT]``):

        v_new = Ainv·(beta·(v − e^gc·(k S)))          (= u − w S, without w and u)
        o     = scale·(e^gc·q S + (q kᵀ ⊙ e^(gc_i−gc_j) ⊙ [i≥j])·v_new)
        S    ← e^gl·S + kᵀ (e^(gl−gc)·v_new)

    v_new as ``_vnew_ainv`` forms it (non-finite inputs included: gc is NaN from a chunk's first non-finite k, beta
    or decay on, ``wy``). BETA_SIGMOID / NEG_EIGVAL: beta as ``_beta_in`` takes it. In a chunk with non-finite
    inputs P takes the finite v_new entries only and each column of o is NaN from its first non-finite v_new on,
    where ``gdn_output_fwd_kernel`` puts NaN."""
    i_nh, i_hv, i_h, bos, Tn, boh, ck, cv, mkv, S = _state_begin(h0, idx, cu, coff, T, NT, P, H, HV, K, V, BK, BV,
                                                                 USE_H0, IS_VARLEN, POOL, V_FIRST)
    dt = k.dtype.element_ty
    dv = v.dtype.element_ty
    r = tl.arange(0, BT)
    for i_c in range(0, tl.cdiv(Tn, BT)):
        Sd = S.to(dt)
        t = i_c * BT + r
        valid = t < Tn
        x = bos + t
        mk = valid[:, None] & (ck[None, :] < K)
        mv = valid[:, None] & (cv[None, :] < V)
        kk, gg, gl = _chunk_k_g(k, gc, x, valid, mk, bos, i_c * BT, Tn, i_hv, i_h, ck, H, HV, K, BT)
        qq = tl.load(q + x[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0)
        A = tl.load(Ainv + (x[:, None] * HV + i_hv) * BT + r[None, :], mask=valid[:, None], other=0.0).to(dt)
        b = _beta_in(tl.load(beta + x * HV + i_hv, mask=valid, other=0.0).to(tl.float32), valid, BETA_SIGMOID,
                     NEG_EIGVAL)
        vv = tl.load(v + x[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0).to(tl.float32)
        kS = tl.dot(kk, Sd)
        oi = tl.dot(qq, Sd) * tl.exp(gg)[:, None]
        qk = tl.dot(qq, tl.trans(kk))
        m = (r[:, None] >= r[None, :]) & valid[:, None] & valid[None, :]
        Pm = tl.where(m, qk * tl.exp(tl.where(m, gg[:, None] - gg[None, :], 0.0)), 0.0).to(dv)
        vn, clean = _vnew_ainv(A, b, vv, kS, gg, BT)
        vnd = vn.to(dv)
        ok = (tl.abs(vnd.to(tl.float32)) < float("inf")) | clean
        out = (oi + tl.dot(Pm, tl.where(ok, vnd, 0.0).to(dv))) * scale
        if not clean:
            out = _nan_from_first_bad(out, ok, BT)
        tl.store(o + x[:, None] * (HV * V) + i_hv * V + cv[None, :], out.to(o.dtype.element_ty), mask=mv)
        S = _decay_update(S, vn, kk, gg, gl, valid)
    if STORE_HT:
        _state_end(ht, idx, S, i_nh, ck, cv, mkv, HV, P, K, V, POOL, V_FIRST)
