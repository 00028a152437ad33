"""Forward stages of the chunked gated delta rule (chunk BT = 64, fp32 accumulation).

Layouts (rows = flattened tokens ``B*T``): q, k ``[rows, H, K]``; v, u, v_new, o ``[rows, HV, V]``;
w ``[rows, HV, K]``; g, gc (chunk-local cumsum, fp32), beta ``[rows, HV]``; Ainv ``[rows, HV, BT]`` (bf16 for
bf16 inputs, else fp32; row t holds row t mod BT of its chunk's ``(I + A)^-1``); chunk states h
``[chunks, HV, K, V]`` (state at each chunk's start). Sequences come from ``cu_seqlens`` (varlen) or are the B
rows of length T. Stages: ``wy`` (gc, Ainv) -> ``wu`` (w, u; or inside ``wy``) -> ``state`` (h, v_new, final;
long sequences split into segments: ``state_seg`` maps, ``state_prefix`` starts, then ``state`` per segment)
-> ``output`` (o).
Head counts and lengths are runtime values that Triton does not specialise on: one compiled variant per
(K, V, dtype, launch config) serves every H, HV and T.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _seq_bounds(i_t, i_b, cu, cidx, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(bos int64, sequence length, chunk start within the sequence) of chunk program i_t."""
    if IS_VARLEN:
        i_n = tl.load(cidx + 2 * i_t).to(tl.int64)
        i_c = tl.load(cidx + 2 * i_t + 1)
        bos = tl.load(cu + i_n).to(tl.int64)
        eos = tl.load(cu + i_n + 1).to(tl.int64)
    else:
        i_c = i_t
        bos = i_b.to(tl.int64) * T
        eos = bos + T
    return bos, (eos - bos).to(tl.int32), i_c * BT


@triton.jit
def _state_span(i_n, cu, coff, T, NT, IS_VARLEN: tl.constexpr):
    """(bos int64, length, first chunk-state row int64) of sequence i_n, for the sequential state passes."""
    if IS_VARLEN:
        bos = tl.load(cu + i_n).to(tl.int64)
        Tn = (tl.load(cu + i_n + 1).to(tl.int64) - bos).to(tl.int32)
        boh = tl.load(coff + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        Tn = T
        boh = i_n.to(tl.int64) * NT
    return bos, Tn, boh


@triton.jit
def _chunk_rows(i_t, i_bh, cu, cidx, T, H, HV, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Chunk program (i_t, i_bh = batch row x value head): (i_b, i_hv, i_h, bos, length, chunk start,
    t [BT] positions in the sequence, valid [BT], x [BT] int64 flat rows)."""
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    bos, Tn, t0 = _seq_bounds(i_t, i_b, cu, cidx, T, BT, IS_VARLEN)
    t = t0 + tl.arange(0, BT)
    return i_b, i_hv, i_h, bos, Tn, t0, t, t < Tn, bos + t


@triton.jit
def _state_heads(i_nh, cu, coff, T, NT, H, HV, IS_VARLEN: tl.constexpr):
    """Sequential state program over sequence x value head i_nh: (i_hv, i_h, bos, length, first state row)."""
    i_n, i_hv = i_nh // HV, i_nh % HV
    bos, Tn, boh = _state_span(i_n, cu, coff, T, NT, IS_VARLEN)
    return i_hv, i_hv // (HV // H), bos, Tn, boh


@triton.jit
def _chunk_state_row(i_t, i_b, coff, cidx, NT, IS_VARLEN: tl.constexpr):
    """Row (int64) of chunk program i_t's state in h ``[chunks, HV, K, V]``."""
    if IS_VARLEN:
        i_ch = tl.load(coff + tl.load(cidx + 2 * i_t)).to(tl.int64) + tl.load(cidx + 2 * i_t + 1)
    else:
        i_ch = i_b.to(tl.int64) * NT + i_t
    return i_ch


@triton.jit
def _inv16(L, PREC: tl.constexpr):
    """(I + L)^-1 of a strictly lower triangular 16x16 fp32 block. L is nilpotent (L^16 = 0), so the inverse is
    the finite series sum_k (-L)^k = (I - L)(I + L^2)(I + L^4)(I + L^8): six fp32 dots, no sequential
    row-by-row substitution."""
    r = tl.arange(0, 16)
    L2 = _dot32(L, L, PREC)
    L4 = _dot32(L2, L2, PREC)
    L8 = _dot32(L4, L4, PREC)
    X = (r[:, None] == r[None, :]).to(tl.float32) - L
    X += _dot32(X, L2, PREC)
    X += _dot32(X, L4, PREC)
    X += _dot32(X, L8, PREC)
    return X


@triton.jit
def _dot32(a, b, PREC: tl.constexpr):
    """fp32 product for the inverse: PREC "ieee" (FMA) or "tf32x3" (three tf32 tensor-core products)."""
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _store16(ptr, rows, valid, c0, blk, HV, BT: tl.constexpr):
    c = tl.arange(0, 16)
    tl.store(ptr + rows[:, None] * (HV * BT) + c0 + c[None, :], blk.to(ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _ld16(k, rows, valid, i_h, c, H, K: tl.constexpr):
    return tl.load(k + rows[:, None] * (H * K) + i_h * K + c[None, :], mask=valid[:, None] & (c[None, :] < K),
                   other=0.0)


@triton.jit
def _decay(acc, vi, vj, gci, gcj, bi, DIAG: tl.constexpr):
    """acc · beta_i · exp(gc_i − gc_j) on one 16x16 block of k kᵀ (strictly lower if DIAG)."""
    r = tl.arange(0, 16)
    if DIAG:
        m = r[:, None] > r[None, :]
    else:
        m = r[:, None] >= 0
    m = m & vi[:, None] & vj[None, :]
    return tl.where(m, acc * bi[:, None] * tl.exp(tl.where(m, gci[:, None] - gcj[None, :], 0.0)), 0.0)


@triton.jit(do_not_specialize=["T", "H", "HV"])
def gdn_wy_fwd_kernel(k, v, g, beta, gc, Ainv, w, u, cu, cidx, T, H, HV, K: tl.constexpr, V: tl.constexpr,
                      BT: tl.constexpr, BK: tl.constexpr, BKW: tl.constexpr, BVW: tl.constexpr, PREC: tl.constexpr,
                      FUSE_WU: tl.constexpr, IS_VARLEN: tl.constexpr):
    """gc = chunk-local cumsum of g (fp32) and Ainv = (I + A)^-1, A = tril(beta_i k_i·k_j e^(gc_i-gc_j), -1),
    solved in fp32 and stored in Ainv's dtype (bf16 for bf16 inputs: it is only ever a tensor-core operand).
    FUSE_WU: then also w and u as ``gdn_wu_fwd_kernel`` (tiles BKW, BVW), reading back this program's Ainv and
    k rows from cache instead of a second pass over memory."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv, i_h, bos, Tn, t0, t, valid, x = _chunk_rows(i_t, i_bh, cu, cidx, T, H, HV, BT, IS_VARLEN)
    r = tl.arange(0, 16)
    t_0, t_1, t_2, t_3 = t0 + r, t0 + 16 + r, t0 + 32 + r, t0 + 48 + r
    v0, v1, v2, v3 = t_0 < Tn, t_1 < Tn, t_2 < Tn, t_3 < Tn
    x0, x1, x2, x3 = bos + t_0, bos + t_1, bos + t_2, bos + t_3
    # the chunk-local cumsum in fp64, rounded once: with strong decay it reaches |gc| ~ 1e3, where fp32's
    # accumulated rounding would make the decays e^(gc_i - gc_j) of nearby rows visibly inexact
    g0 = tl.load(g + x0 * HV + i_hv, mask=v0, other=0.0).to(tl.float64)
    g1 = tl.load(g + x1 * HV + i_hv, mask=v1, other=0.0).to(tl.float64)
    g2 = tl.load(g + x2 * HV + i_hv, mask=v2, other=0.0).to(tl.float64)
    g3 = tl.load(g + x3 * HV + i_hv, mask=v3, other=0.0).to(tl.float64)
    c0 = tl.cumsum(g0, 0).to(tl.float32)
    c1 = (tl.cumsum(g1, 0) + tl.sum(g0, 0)).to(tl.float32)
    c2 = (tl.cumsum(g2, 0) + tl.sum(g0, 0) + tl.sum(g1, 0)).to(tl.float32)
    c3 = (tl.cumsum(g3, 0) + tl.sum(g0, 0) + tl.sum(g1, 0) + tl.sum(g2, 0)).to(tl.float32)
    tl.store(gc + x0 * HV + i_hv, c0, mask=v0)
    tl.store(gc + x1 * HV + i_hv, c1, mask=v1)
    tl.store(gc + x2 * HV + i_hv, c2, mask=v2)
    tl.store(gc + x3 * HV + i_hv, c3, mask=v3)
    b0 = tl.load(beta + x0 * HV + i_hv, mask=v0, other=0.0).to(tl.float32)
    b1 = tl.load(beta + x1 * HV + i_hv, mask=v1, other=0.0).to(tl.float32)
    b2 = tl.load(beta + x2 * HV + i_hv, mask=v2, other=0.0).to(tl.float32)
    b3 = tl.load(beta + x3 * HV + i_hv, mask=v3, other=0.0).to(tl.float32)
    z = tl.zeros([16, 16], dtype=tl.float32)
    a00, a11, a22, a33, a10, a20, a21, a30, a31, a32 = z, z, z, z, z, z, z, z, z, z
    for k0 in range(0, K, BK):
        c = k0 + tl.arange(0, BK)
        k0t = _ld16(k, x0, v0, i_h, c, H, K)
        k1t = _ld16(k, x1, v1, i_h, c, H, K)
        k2t = _ld16(k, x2, v2, i_h, c, H, K)
        k3t = _ld16(k, x3, v3, i_h, c, H, K)
        a00 += tl.dot(k0t, tl.trans(k0t))
        a11 += tl.dot(k1t, tl.trans(k1t))
        a22 += tl.dot(k2t, tl.trans(k2t))
        a33 += tl.dot(k3t, tl.trans(k3t))
        a10 += tl.dot(k1t, tl.trans(k0t))
        a20 += tl.dot(k2t, tl.trans(k0t))
        a21 += tl.dot(k2t, tl.trans(k1t))
        a30 += tl.dot(k3t, tl.trans(k0t))
        a31 += tl.dot(k3t, tl.trans(k1t))
        a32 += tl.dot(k3t, tl.trans(k2t))
    T00 = _inv16(_decay(a00, v0, v0, c0, c0, b0, True), PREC)
    T11 = _inv16(_decay(a11, v1, v1, c1, c1, b1, True), PREC)
    T22 = _inv16(_decay(a22, v2, v2, c2, c2, b2, True), PREC)
    T33 = _inv16(_decay(a33, v3, v3, c3, c3, b3, True), PREC)
    A10 = _decay(a10, v1, v0, c1, c0, b1, False)
    A20 = _decay(a20, v2, v0, c2, c0, b2, False)
    A21 = _decay(a21, v2, v1, c2, c1, b2, False)
    A30 = _decay(a30, v3, v0, c3, c0, b3, False)
    A31 = _decay(a31, v3, v1, c3, c1, b3, False)
    A32 = _decay(a32, v3, v2, c3, c2, b3, False)
    T10 = -_dot32(_dot32(T11, A10, PREC), T00, PREC)
    T21 = -_dot32(_dot32(T22, A21, PREC), T11, PREC)
    T32 = -_dot32(_dot32(T33, A32, PREC), T22, PREC)
    T20 = -_dot32(T22, _dot32(A20, T00, PREC) + _dot32(A21, T10, PREC), PREC)
    T31 = -_dot32(T33, _dot32(A31, T11, PREC) + _dot32(A32, T21, PREC), PREC)
    T30 = -_dot32(T33, _dot32(A30, T00, PREC) + _dot32(A31, T10, PREC) + _dot32(A32, T20, PREC), PREC)
    Z = tl.zeros([16, 16], dtype=tl.float32)
    p = Ainv + i_hv * BT
    _store16(p, x0, v0, 0, T00, HV, BT)
    _store16(p, x0, v0, 16, Z, HV, BT)
    _store16(p, x0, v0, 32, Z, HV, BT)
    _store16(p, x0, v0, 48, Z, HV, BT)
    _store16(p, x1, v1, 0, T10, HV, BT)
    _store16(p, x1, v1, 16, T11, HV, BT)
    _store16(p, x1, v1, 32, Z, HV, BT)
    _store16(p, x1, v1, 48, Z, HV, BT)
    _store16(p, x2, v2, 0, T20, HV, BT)
    _store16(p, x2, v2, 16, T21, HV, BT)
    _store16(p, x2, v2, 32, T22, HV, BT)
    _store16(p, x2, v2, 48, Z, HV, BT)
    _store16(p, x3, v3, 0, T30, HV, BT)
    _store16(p, x3, v3, 16, T31, HV, BT)
    _store16(p, x3, v3, 32, T32, HV, BT)
    _store16(p, x3, v3, 48, T33, HV, BT)
    if FUSE_WU:
        tl.debug_barrier()  # this program's Ainv and gc stores are visible to all of its threads
        _wu_rows(k, v, beta, gc, Ainv, w, u, x, valid, i_h, i_hv, H, HV, K, V, BT, BKW, BVW)


@triton.jit
def _wu_rows(k, v, beta, gc, Ainv, w, u, x, valid, i_h, i_hv, H, HV, K: tl.constexpr, V: tl.constexpr,
             BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """w = Ainv·(beta·e^gc·k), u = Ainv·(beta·v) for the chunk rows x (valid: inside the sequence)."""
    c = tl.arange(0, BT)
    A = tl.load(Ainv + (x[:, None] * HV + i_hv) * BT + c[None, :], mask=valid[:, None], other=0.0)
    b = tl.load(beta + x * HV + i_hv, mask=valid, other=0.0).to(tl.float32)
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


@triton.jit(do_not_specialize=["T", "H", "HV"])
def gdn_wu_fwd_kernel(k, v, beta, gc, Ainv, w, u, cu, cidx, T, H, HV,
                      K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      IS_VARLEN: tl.constexpr):
    """w = Ainv·(beta·e^gc·k) [rows, HV, K], u = Ainv·(beta·v) [rows, HV, V] (stored in the input dtype)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv, i_h, bos, Tn, t0, t, valid, x = _chunk_rows(i_t, i_bh, cu, cidx, T, H, HV, BT, IS_VARLEN)
    _wu_rows(k, v, beta, gc, Ainv, w, u, x, valid, i_h, i_hv, H, HV, K, V, BT, BK, BV)


@triton.jit
def _chunk_k_g(k, gc, x, valid, mk, bos, t0, Tn, i_hv, i_h, ck, H, HV, K: tl.constexpr, BT: tl.constexpr):
    """One chunk's k rows [BT, BK], gc [BT] and gl = gc of its last valid row (the chunk starts at token t0)."""
    last = tl.minimum(t0 + BT, Tn) - 1
    gl = tl.load(gc + (bos + last) * HV + i_hv)
    gg = tl.load(gc + x * HV + i_hv, mask=valid, other=0.0)
    kk = tl.load(k + x[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0)
    return kk, gg, gl


@triton.jit
def _decay_update(S, vn, kk, gg, gl, valid):
    """End of one chunk step of the state recurrence: S ← e^gl·S + kᵀ (e^(gl−gc)·v_new). The decay scales the
    rows of v_new ([BT, BV]), not of k ([BT, K]): k goes from memory to the dot as is."""
    vd = vn * tl.exp(tl.where(valid, gl - gg, 0.0))[:, None]
    return S * tl.exp(gl) + tl.dot(tl.trans(kk), vd.to(kk.dtype))


@triton.jit(do_not_specialize=["T", "NT", "H", "HV"])
def gdn_state_fwd_kernel(k, w, u, gc, h, vnew, h0, ht, cu, coff, q, o, scale, T, NT, H, HV,
                         K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                         BV: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr,
                         STORE_H: tl.constexpr, FUSE_OUT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Sequential pass over one sequence's chunks for (value head, V block): h[c] = state at chunk start,
    v_new = u − w·S, S ← e^gl·S + kᵀ (e^(gl−gc)·v_new). BK = K rounded up to a power of two.
    FUSE_OUT: also the chunk's output, as ``gdn_output_fwd_kernel`` computes it from h[c] and v_new; h and
    v_new are then stored only with STORE_H (the backward's recomputation keeps them)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_hv, i_h, bos, Tn, boh = _state_heads(i_nh, cu, coff, T, NT, H, HV, IS_VARLEN)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    mkv = (ck[:, None] < K) & (cv[None, :] < V)
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        S += tl.load(h0 + (i_nh.to(tl.int64) * K + ck[:, None]) * V + cv[None, :], mask=mkv, other=0.0)
    dt = w.dtype.element_ty
    r = tl.arange(0, BT)
    for i_c in range(0, tl.cdiv(Tn, BT)):
        if STORE_H:
            tl.store(h + (((boh + i_c) * HV + i_hv) * K + ck[:, None]) * V + cv[None, :],
                     S.to(h.dtype.element_ty), mask=mkv)
        t = i_c * BT + r
        valid = t < Tn
        x = bos + t
        mk = valid[:, None] & (ck[None, :] < K)
        mv = valid[:, None] & (cv[None, :] < V)
        ww = tl.load(w + x[:, None] * (HV * K) + i_hv * K + ck[None, :], mask=mk, other=0.0)
        uu = tl.load(u + x[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0).to(tl.float32)
        vn = uu - tl.dot(ww, S.to(dt))
        if STORE_H:
            tl.store(vnew + x[:, None] * (HV * V) + i_hv * V + cv[None, :], vn.to(vnew.dtype.element_ty), mask=mv)
        kk, gg, gl = _chunk_k_g(k, gc, x, valid, mk, bos, i_c * BT, Tn, i_hv, i_h, ck, H, HV, K, BT)
        if FUSE_OUT:
            # the operands rounded as the unfused path stores them (h and v_new in the input dtype)
            qq = tl.load(q + x[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0)
            m = (r[:, None] >= r[None, :]) & valid[:, None] & valid[None, :]
            P = tl.where(m, tl.dot(qq, tl.trans(kk)) * tl.exp(tl.where(m, gg[:, None] - gg[None, :], 0.0)), 0.0)
            out = tl.dot(qq, S.to(dt)) * tl.exp(gg)[:, None] + tl.dot(P.to(dt), vn.to(vnew.dtype.element_ty).to(dt))
            tl.store(o + x[:, None] * (HV * V) + i_hv * V + cv[None, :], (out * scale).to(o.dtype.element_ty),
                     mask=mv)
        S = _decay_update(S, vn, kk, gg, gl, valid)
    if STORE_HT:
        tl.store(ht + (i_nh.to(tl.int64) * K + ck[:, None]) * V + cv[None, :], S, mask=mkv)


@triton.jit(do_not_specialize=["H", "HV"])
def gdn_state_seg_kernel(k, w, u, gc, mb, cu, coff, H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr):
    """Sequence splitting, pass 1: per segment (cu/coff index segments, not sequences) and value head, the state
    map S_end = M·S_start + b over the segment's chunks, as the state recurrence on X = [M | b] from [I | 0]
    (u = 0 in the M columns). Program i_c < BK/BV owns BV columns of M, the others BV columns of b; X is stored
    to mb ``[segments, HV, K, K + V]`` fp32."""
    i_c, i_sh = tl.program_id(0), tl.program_id(1)
    i_hv, i_h, bos, Tn, _ = _state_heads(i_sh, cu, coff, 0, 0, H, HV, True)
    ck = tl.arange(0, BK)
    c = i_c * BV + tl.arange(0, BV)  # column of X: c < BK in M, else value column c - BK in b
    cv = c - BK
    X = ((ck[:, None] == c[None, :]) & (ck[:, None] < K)).to(tl.float32)
    mu = (c >= BK) & (cv < V)
    dt = w.dtype.element_ty
    for i_n in range(0, tl.cdiv(Tn, BT)):
        t = i_n * BT + tl.arange(0, BT)
        valid = t < Tn
        x = bos + t
        mk = valid[:, None] & (ck[None, :] < K)
        ww = tl.load(w + x[:, None] * (HV * K) + i_hv * K + ck[None, :], mask=mk, other=0.0)
        uu = tl.load(u + x[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=valid[:, None] & mu[None, :],
                     other=0.0).to(tl.float32)
        vn = uu - tl.dot(ww, X.to(dt))
        kk, gg, gl = _chunk_k_g(k, gc, x, valid, mk, bos, i_n * BT, Tn, i_hv, i_h, ck, H, HV, K, BT)
        X = _decay_update(X, vn, kk, gg, gl, valid)
    col = tl.where(c < BK, c, K + cv)
    mcol = tl.where(c < BK, c < K, mu)
    tl.store(mb + (i_sh.to(tl.int64) * K + ck[:, None]) * (K + V) + col[None, :], X,
             mask=(ck[:, None] < K) & mcol[None, :])


@triton.jit(do_not_specialize=["HV"])
def gdn_state_prefix_kernel(mb, rb, h0, s0, ht, soff, HV, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                            BV: tl.constexpr, USE_H0: tl.constexpr, REVERSE: tl.constexpr):
    """Sequence splitting, pass 2: per sequence, value head and V block, walk the segment maps in order:
    s0[seg] = state at the segment's start (fp32 ``[segments, HV, K, V]``), then S ← M·S + b (tf32x3 dot,
    near fp32); the last S is the final state ht. REVERSE (backward): segments last to first, s0[seg] = dS at
    the segment's end, dS ← Mᵀ·dS + r with r from rb ``[segments, HV, K, V]``; the last dS is dh0."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    mkk = (ck[:, None] < K) & (ck[None, :] < K)
    mkv = (ck[:, None] < K) & (cv[None, :] < V)
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        S += tl.load(h0 + (i_nh.to(tl.int64) * K + ck[:, None]) * V + cv[None, :], mask=mkv, other=0.0)
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
    tl.store(ht + (i_nh.to(tl.int64) * K + ck[:, None]) * V + cv[None, :], S, mask=mkv)


@triton.jit(do_not_specialize=["T", "NT", "H", "HV"])
def gdn_output_fwd_kernel(q, k, vnew, gc, h, o, cu, cidx, coff, scale, T, NT, H,
                          HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                          BV: tl.constexpr, EARLY: tl.constexpr, IS_VARLEN: tl.constexpr):
    """o = scale·(e^gc·q·h + (q kᵀ ⊙ e^(gc_i−gc_j) ⊙ [i≥j])·v_new) for one chunk, value head and V block.
    q·h and q kᵀ accumulate over BK-wide slices of K (a loop the compiler pipelines). EARLY: v_new and gc are
    loaded before that loop (their latency overlaps it) instead of after it."""
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
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
    out = (oi * tl.exp(gg)[:, None] + tl.dot(P.to(vn.dtype), vn)) * scale
    tl.store(o + x[:, None] * (HV * V) + i_hv * V + cv[None, :], out.to(o.dtype.element_ty), mask=mv)
