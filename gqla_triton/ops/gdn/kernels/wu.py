"""Stage ``wu``: w = Ainv·(beta·e^gc·k) and u = Ainv·(beta·v) (forward, and again in a backward that recomputes the
states)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _beta_in, _chunk_rows


@triton.jit(do_not_specialize=["T", "H", "HV"])
def gdn_wu_fwd_kernel(k, v, beta, gc, Ainv, w, u, cu, cidx, T, H, HV,
                      K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      IS_VARLEN: tl.constexpr, BETA_SIGMOID: tl.constexpr = False, NEG_EIGVAL: tl.constexpr = False):
    """w = Ainv·(beta·e^gc·k) [rows, HV, K], u = Ainv·(beta·v) [rows, HV, V] (stored in the input dtype).
    BETA_SIGMOID / NEG_EIGVAL: beta as ``_beta_in`` takes it."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv, i_h, bos, Tn, t0, t, valid, x = _chunk_rows(i_t, i_bh, cu, cidx, T, H, HV, BT, IS_VARLEN)
    _wu_rows(k, v, beta, gc, Ainv, w, u, x, valid, i_h, i_hv, H, HV, K, V, BT, BK, BV, BETA_SIGMOID, NEG_EIGVAL)


@triton.jit
def _wu_rows(k, v, beta, gc, Ainv, w, u, x, valid, i_h, i_hv, H, HV, K: tl.constexpr, V: tl.constexpr,
             BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BETA_SIGMOID: tl.constexpr,
             NEG_EIGVAL: tl.constexpr):
    """w = Ainv·(beta·e^gc·k), u = Ainv·(beta·v) for the chunk rows x (valid: inside the sequence)."""
    c = tl.arange(0, BT)
    A = tl.load(Ainv + (x[:, None] * HV + i_hv) * BT + c[None, :], mask=valid[:, None], other=0.0)
    b = _beta_in(tl.load(beta + x * HV + i_hv, mask=valid, other=0.0).to(tl.float32), valid, BETA_SIGMOID,
                 NEG_EIGVAL)
    eg = tl.exp(tl.load(gc + x * HV + i_hv, mask=valid, other=0.0))
    Ad = A.to(k.dtype.element_ty)
    for k0 in range(0, K, BK):
        ck = k0 + tl.arange(0, BK)
        mk = valid[:, None] & (ck[None, :] < K)
        kk = tl.load(k + x[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0).to(tl.float32)
        wk = tl.dot(Ad, (kk * (b * eg)[:, None]).to(Ad.dtype))
        tl.store(w + x[:, None] * (HV * K) + i_hv * K + ck[None, :], wk.to(w.dtype.element_ty), mask=mk)
    for v0 in range(0, V, BV):
        cv = v0 + tl.arange(0, BV)
        mv = valid[:, None] & (cv[None, :] < V)
        vv = tl.load(v + x[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0).to(tl.float32)
        uv = tl.dot(Ad, (vv * b[:, None]).to(Ad.dtype))
        tl.store(u + x[:, None] * (HV * V) + i_hv * V + cv[None, :], uv.to(u.dtype.element_ty), mask=mv)

