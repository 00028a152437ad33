"""Stage ``seg`` (sequence splitting of the state passes): per-segment state maps, then their chaining per
sequence."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _beta_in, _chunk_k_g, _decay_update, _h_row, _state_heads, _state_ptr, _vnew_ainv


@triton.jit(do_not_specialize=["H", "HV"])
def gdn_state_seg_kernel(k, w, u, v, beta, Ainv, gc, mb, cu, coff, H, HV, K: tl.constexpr, V: tl.constexpr,
                         BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FROM_AINV: tl.constexpr = False,
                         BETA_SIGMOID: tl.constexpr = False, NEG_EIGVAL: tl.constexpr = False):
    """Sequence splitting, pass 1: per segment (cu/coff index segments, not sequences) and value head, the state
    map S_end = M·S_start + b over the segment's chunks, as the state recurrence on X = [M | b] from [I | 0]
    (v = 0 in the M columns). Program i_c < BK/BV owns BV columns of M, the others BV columns of b; X is stored
    to mb ``[segments, HV, K, K + V]`` fp32. Each chunk's v_new is u − w X from ``wu``'s w and u, or with FROM_AINV
    (a forward without gradient, which needs no w or u) ``_vnew_ainv``'s Ainv·(beta·(v − e^gc·k X)) from v, beta
    (BETA_SIGMOID / NEG_EIGVAL as ``_beta_in`` takes it) and Ainv ``[rows, HV, BT]``; w, u and v, beta, Ainv are
    the pointers the other form does not read."""
    i_c, i_sh = tl.program_id(0), tl.program_id(1)
    i_hv, i_h, bos, Tn, _ = _state_heads(i_sh, cu, coff, 0, 0, H, HV, True)
    ck = tl.arange(0, BK)
    r = tl.arange(0, BT)
    c = i_c * BV + tl.arange(0, BV)  # column of X: c < BK in M, else value column c - BK in b
    cv = c - BK
    X = ((ck[:, None] == c[None, :]) & (ck[:, None] < K)).to(tl.float32)
    mu = (c >= BK) & (cv < V)
    dt = k.dtype.element_ty
    for i_n in range(0, tl.cdiv(Tn, BT)):
        t = i_n * BT + r
        valid = t < Tn
        x = bos + t
        mk = valid[:, None] & (ck[None, :] < K)
        mv = valid[:, None] & mu[None, :]
        kk, gg, gl = _chunk_k_g(k, gc, x, valid, mk, bos, i_n * BT, Tn, i_hv, i_h, ck, H, HV, K, BT)
        if FROM_AINV:
            A = tl.load(Ainv + (x[:, None] * HV + i_hv) * BT + r[None, :], mask=valid[:, None], other=0.0).to(dt)
            b = _beta_in(tl.load(beta + x * HV + i_hv, mask=valid, other=0.0).to(tl.float32), valid, BETA_SIGMOID,
                         NEG_EIGVAL)
            vv = tl.load(v + x[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0).to(tl.float32)
            vn, clean = _vnew_ainv(A, b, vv, tl.dot(kk, X.to(dt)), gg, BT)
        else:
            ww = tl.load(w + x[:, None] * (HV * K) + i_hv * K + ck[None, :], mask=mk, other=0.0)
            uu = tl.load(u + x[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0).to(tl.float32)
            vn = uu - tl.dot(ww, X.to(dt))
        X = _decay_update(X, vn, kk, gg, gl, valid)
    col = tl.where(c < BK, c, K + cv)
    mcol = tl.where(c < BK, c < K, mu)
    tl.store(mb + (i_sh.to(tl.int64) * K + ck[:, None]) * (K + V) + col[None, :], X,
             mask=(ck[:, None] < K) & mcol[None, :])


@triton.jit(do_not_specialize=["HV", "P"])
def gdn_state_prefix_kernel(mb, rb, h0, s0, ht, soff, idx, HV, P, K: tl.constexpr, V: tl.constexpr,
                            BK: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr, REVERSE: tl.constexpr,
                            POOL: tl.constexpr, V_FIRST: tl.constexpr = False):
    """Sequence splitting, pass 2: per sequence, value head and V block, walk the segment maps in order:
    s0[seg] = state at the segment's start (fp32 ``[segments, HV, K, V]``), then S ← M·S + b (tf32x3 dot,
    near fp32); the last S is the final state ht. REVERSE (backward): segments last to first, s0[seg] = dS at
    the segment's end, dS ← Mᵀ·dS + r with r from rb ``[segments, HV, K, V]``; the last dS is dh0. POOL (forward):
    h0 and ht are one state pool ``[P, HV, K, V]``, sequence n reads and then writes row idx[n] (none outside
    [0, P): a zero start, no write). h0 / ht may be fp32, bf16 or fp16 (h0 is read to fp32, the last S rounded to
    ht's dtype); V_FIRST: their rows are ``[V, K]`` (s0, mb and rb keep ``[K, ...]``)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    mkk = (ck[:, None] < K) & (ck[None, :] < K)
    mkv = (ck[:, None] < K) & (cv[None, :] < V)
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        row, mrow = _h_row(idx, i_nh, ck, cv, mkv, HV, P, K, V, POOL)
        S += tl.load(_state_ptr(h0, row, ck, cv, K, V, V_FIRST), mask=mrow, other=0.0).to(tl.float32)
    first = tl.load(soff + i_n)
    nseg = tl.load(soff + i_n + 1) - first
    for j in range(0, nseg):
        i_s = first + nseg - 1 - j if REVERSE else first + j
        i_sh = (i_s * HV + i_hv).to(tl.int64)
        tl.store(s0 + (i_sh * K + ck[:, None]) * V + cv[None, :], S, mask=mkv)
        base = mb + i_sh * K * (K + V)
        if REVERSE:
            M = tl.load(base + ck[None, :] * (K + V) + ck[:, None], mask=mkk, other=0.0)
            b = tl.load(rb + (i_sh * K + ck[:, None]) * V + cv[None, :], mask=mkv, other=0.0)
        else:
            M = tl.load(base + ck[:, None] * (K + V) + ck[None, :], mask=mkk, other=0.0)
            b = tl.load(base + ck[:, None] * (K + V) + K + cv[None, :], mask=mkv, other=0.0)
        S = tl.dot(M, S, input_precision="tf32x3") + b
    row, mrow = _h_row(idx, i_nh, ck, cv, mkv, HV, P, K, V, POOL)
    tl.store(_state_ptr(ht, row, ck, cv, K, V, V_FIRST), S.to(ht.dtype.element_ty), mask=mrow)

