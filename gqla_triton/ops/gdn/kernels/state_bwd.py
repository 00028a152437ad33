"""Stage ``state_bwd``: the reverse pass over chunks (dS at each chunk end, dv_new, dh0)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _state_begin, _state_end


@triton.jit(do_not_specialize=["T", "NT", "H", "HV"])
def gdn_state_bwd_kernel(q, k, w, gc, do, dvl, dhe, dvn, dht, dh0, cu, coff, scale, T, NT, H,
                         HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
                         STORE_STEPS: tl.constexpr, IS_VARLEN: tl.constexpr, V_FIRST: tl.constexpr = False):
    """Reverse pass over chunks: dhe[c] = dL/d(state at chunk c's end); dv_new = dvl + e^(gl−gc)·(k dS);
    dS ← e^gl·dS + qᵀ (scale·e^gc·dO) − wᵀ dv_new; dh0 = dS at the sequence start. Without STORE_STEPS only
    dh0 is written (sequence splitting: a segment's dS contribution from a zero start). dht is fp32, dh0 fp32, bf16
    or fp16; V_FIRST: the rows of both are ``[V, K]``."""
    i_nh, i_hv, i_h, bos, Tn, boh, ck, cv, mkv, dS = _state_begin(dht, dht, cu, coff, T, NT, 0, H, HV, K, V, BK, BV,
                                                                  USE_DHT, IS_VARLEN, False, V_FIRST)
    dt = k.dtype.element_ty
    NTn = tl.cdiv(Tn, BT)
    for j in range(0, NTn):
        i_c = NTn - 1 - j
        if STORE_STEPS:
            tl.store(dhe + (((boh + i_c) * HV + i_hv) * K + ck[:, None]) * V + cv[None, :],
                     dS.to(dhe.dtype.element_ty), mask=mkv)
        t = i_c * BT + tl.arange(0, BT)
        valid = t < Tn
        x = bos + t
        mk = valid[:, None] & (ck[None, :] < K)
        mv = valid[:, None] & (cv[None, :] < V)
        last = tl.minimum(i_c * BT + BT, Tn) - 1
        gl = tl.load(gc + (bos + last) * HV + i_hv)
        gg = tl.load(gc + x * HV + i_hv, mask=valid, other=0.0)
        # row scalings (decays, scale) act on the [BT, BV] operands and results, never on the [BT, K] q / k tiles,
        # which go from memory to the dots as they are
        kk = tl.load(k + x[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0)
        qq = tl.load(q + x[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0)
        dd = tl.load(do + x[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0)
        dv = tl.load(dvl + x[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0).to(tl.float32)
        dv += tl.dot(kk, dS.to(dt)) * tl.exp(tl.where(valid, gl - gg, 0.0))[:, None]
        if STORE_STEPS:
            tl.store(dvn + x[:, None] * (HV * V) + i_hv * V + cv[None, :], dv.to(dvn.dtype.element_ty), mask=mv)
        ddq = dd.to(tl.float32) * (tl.exp(gg) * scale)[:, None]
        ww = tl.load(w + x[:, None] * (HV * K) + i_hv * K + ck[None, :], mask=mk, other=0.0)
        dS = dS * tl.exp(gl) + tl.dot(tl.trans(qq), ddq.to(dt)) - tl.dot(tl.trans(ww), dv.to(dt))
    if STORE_DH0:
        _state_end(dh0, dh0, dS, i_nh, ck, cv, mkv, HV, 0, K, V, False, V_FIRST)

