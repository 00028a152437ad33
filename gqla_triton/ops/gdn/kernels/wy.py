"""Stage ``wy``: gc (chunk-local cumsum of g) and Ainv = (I + A)^-1 of each chunk (layouts: ``common.py``)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..reference import G_FLOOR
from .common import _beta_in, _chunk_rows, _empty_slot, _gate_in, _gate_par
from .plan import zero_padding_block

_G_FLOOR = tl.constexpr(G_FLOOR)


@triton.jit
def _inv16(L):
    """(I + L)^-1 of each strictly lower triangular 16x16 fp32 block of the stack ``L [NB, 16, 16]`` by row-wise
    forward substitution on the CUDA cores, X_i = e_i − Σ_{k<i} L_ik X_k, all NB blocks in one sweep of 15 steps.
    Not the finite series (I − L)(I + L²)(I + L⁴)(I + L⁸): on chunks of correlated keys L⁸'s entries are hundreds
    of times the inverse's, and their cancellation loses that factor."""
    r = tl.arange(0, 16)
    ri, rj = r[None, :, None], r[None, None, :]
    X = tl.zeros_like(L) + (ri == rj).to(tl.float32)
    Lt = tl.permute(L, (0, 2, 1))  # Lt[b, k, i] = L[b, i, k]: row i of L comes out along X's row axis
    for i in tl.static_range(1, 16):
        li = tl.sum(tl.where(rj == i, Lt, 0.0), 2)
        X = tl.where(ri == i, X - tl.sum(li[:, :, None] * X, 1)[:, None, :], X)
    return X


@triton.jit
def _stack2(a, b):
    """[16, 16] x 2 -> [2, 16, 16]."""
    return tl.permute(tl.join(a, b), (2, 0, 1))


@triton.jit
def _unstack2(x):
    """[2, 16, 16] -> its two blocks."""
    return tl.split(tl.permute(x, (1, 2, 0)))


@triton.jit
def _dot32(a, b, PREC: tl.constexpr):
    """fp32 product of the inverse's block merges: PREC "ieee" (FMA) or "tf32x3" (three tf32 tensor-core
    products)."""
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
def _ld_row(x, rows, valid, i_hv, HV):
    """One value per row of a ``[rows, HV]`` tensor (g or beta) at value head i_hv, fp32, 0 past the sequence."""
    return tl.load(x + rows * HV + i_hv, mask=valid, other=0.0).to(tl.float32)


@triton.jit
def _g_in(x, na, bias, valid, GATE: tl.constexpr):
    """The loaded g of 16 rows (fp32) as the cumulative sum takes it, in fp64, floored at G_FLOOR: every fp32 decay
    through a floored token is 0, as for g = -inf, and the cumulative sums stay finite. GATE: x holds the raw gate
    input (``_gate_in`` with the parameters (na, bias) of ``_gate_par``); rows past the sequence are 0."""
    if GATE:
        gv, _ = _gate_in(x, na, bias)
        x = tl.where(valid, gv, 0.0)
    x = x.to(tl.float64)
    return tl.where(x < _G_FLOOR, _G_FLOOR, x)  # not tl.maximum: on the GPU it returns the non-NaN operand


@triton.jit
def _first_bad(acc, b, gc, t0, BT: tl.constexpr):
    """The first chunk row of block rows t0 + 0..15 whose token has a non-finite k, beta or cumulative decay
    (beta·|k|²·gc not finite; acc: the block's diagonal block of k kᵀ), else BT."""
    r = tl.arange(0, 16)
    d = tl.sum(tl.where(r[:, None] == r[None, :], acc, 0.0), 1) * b * gc
    return tl.min(tl.where(tl.abs(d) < float("inf"), BT, t0 + r), 0)


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
def gdn_wy_fwd_kernel(k, g, beta, gc, Ainv, cu, cidx, T, H, HV, K: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr, PREC: tl.constexpr, IS_VARLEN: tl.constexpr,
                      BETA_SIGMOID: tl.constexpr = False, NEG_EIGVAL: tl.constexpr = False, a_log=None,
                      dt_bias=None, GATE: tl.constexpr = False, HAS_BIAS: tl.constexpr = False,
                      EMPTY_SLOTS: tl.constexpr = False, o=None, N=0, V: tl.constexpr = 1, PAD: tl.constexpr = False,
                      BW: tl.constexpr = 16):
    """gc = chunk-local cumsum of g (floored at G_FLOOR; fp32) and Ainv = (I + A)^-1,
    A = tril(beta_i k_i·k_j e^(gc_i-gc_j), -1), solved in fp32 (16x16 diagonal blocks by substitution, merged by
    dots at precision PREC) and stored in Ainv's dtype (bf16 for bf16 inputs: it is only ever a tensor-core
    operand). BT: 16, 32 or 64 (one, two or four 16-row blocks; the blocks past BT are compiled out). BETA_SIGMOID / NEG_EIGVAL: beta as ``_beta_in`` takes it.
    GATE: g is the raw gate input, the decay ``-exp(a_log)·softplus(g + dt_bias)`` (``HAS_BIAS``: with dt_bias
    ``[HV]``). PAD (varlen, a program per BT-token block): the output o ``[1, T, HV, V]``'s rows of tokens outside
    [cu[0], cu[N]), which no later stage writes, are zeroed here, each program its value head's in block ``i_t``."""
    NB: tl.constexpr = BT // 16
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    if PAD:
        zero_padding_block(o + i_bh * V, cu, N, T, i_t, HV * V, V, BT, BW)
    if EMPTY_SLOTS:  # a device-built plan: the programs past the last chunk have none
        if _empty_slot(cidx, i_t):
            return
    i_b, i_hv, i_h, bos, Tn, t0, t, valid, x = _chunk_rows(i_t, i_bh, cu, cidx, T, H, HV, BT, IS_VARLEN)
    r = tl.arange(0, 16)
    t_0 = t0 + r
    if NB >= 2:
        t_1 = t0 + 16 + r
    if NB == 4:
        t_2, t_3 = t0 + 32 + r, t0 + 48 + r
    v0 = t_0 < Tn
    if NB >= 2:
        v1 = t_1 < Tn
    if NB == 4:
        v2, v3 = t_2 < Tn, t_3 < Tn
    x0 = bos + t_0
    if NB >= 2:
        x1 = bos + t_1
    if NB == 4:
        x2, x3 = bos + t_2, bos + t_3
    # g, beta (and the gate's parameters) are loaded before the K loop and transformed after it
    na, bias = 0.0, 0.0
    if GATE:  # the parameters once, for every block
        na, bias = _gate_par(a_log, dt_bias, i_hv, HAS_BIAS)
    g0, b0 = _ld_row(g, x0, v0, i_hv, HV), _ld_row(beta, x0, v0, i_hv, HV)
    if NB >= 2:
        g1, b1 = _ld_row(g, x1, v1, i_hv, HV), _ld_row(beta, x1, v1, i_hv, HV)
    if NB == 4:
        g2, b2 = _ld_row(g, x2, v2, i_hv, HV), _ld_row(beta, x2, v2, i_hv, HV)
        g3, b3 = _ld_row(g, x3, v3, i_hv, HV), _ld_row(beta, x3, v3, i_hv, HV)
    z = tl.zeros([16, 16], dtype=tl.float32)
    a00 = z
    if NB >= 2:
        a11 = z
    if NB == 4:
        a22, a33 = z, z
    if NB >= 2:
        a10 = z
    if NB == 4:
        a20, a21, a30, a31, a32 = z, z, z, z, z
    for k0 in range(0, K, BK):
        c = k0 + tl.arange(0, BK)
        k0t = _ld16(k, x0, v0, i_h, c, H, K)
        if NB >= 2:
            k1t = _ld16(k, x1, v1, i_h, c, H, K)
        if NB == 4:
            k2t = _ld16(k, x2, v2, i_h, c, H, K)
            k3t = _ld16(k, x3, v3, i_h, c, H, K)
        a00 += tl.dot(k0t, tl.trans(k0t))
        if NB >= 2:
            a11 += tl.dot(k1t, tl.trans(k1t))
        if NB == 4:
            a22 += tl.dot(k2t, tl.trans(k2t))
            a33 += tl.dot(k3t, tl.trans(k3t))
        if NB >= 2:
            a10 += tl.dot(k1t, tl.trans(k0t))
        if NB == 4:
            a20 += tl.dot(k2t, tl.trans(k0t))
            a21 += tl.dot(k2t, tl.trans(k1t))
            a30 += tl.dot(k3t, tl.trans(k0t))
            a31 += tl.dot(k3t, tl.trans(k1t))
            a32 += tl.dot(k3t, tl.trans(k2t))
    # the chunk-local cumsum in fp64, then rounded to fp32: with strong decay it reaches |gc| ~ 1e3, where fp32's
    # accumulated rounding would make the decays e^(gc_i - gc_j) of nearby rows visibly inexact
    g0 = _g_in(g0, na, bias, v0, GATE)
    if NB >= 2:
        g1 = _g_in(g1, na, bias, v1, GATE)
    if NB == 4:
        g2, g3 = _g_in(g2, na, bias, v2, GATE), _g_in(g3, na, bias, v3, GATE)
    c0 = tl.cumsum(g0, 0).to(tl.float32)
    if NB >= 2:
        c1 = (tl.cumsum(g1, 0) + tl.sum(g0, 0)).to(tl.float32)
    if NB == 4:
        c2 = (tl.cumsum(g2, 0) + tl.sum(g0, 0) + tl.sum(g1, 0)).to(tl.float32)
        c3 = (tl.cumsum(g3, 0) + tl.sum(g0, 0) + tl.sum(g1, 0) + tl.sum(g2, 0)).to(tl.float32)
    b0 = _beta_in(b0, v0, BETA_SIGMOID, NEG_EIGVAL)
    if NB >= 2:
        b1 = _beta_in(b1, v1, BETA_SIGMOID, NEG_EIGVAL)
    if NB == 4:
        b2, b3 = _beta_in(b2, v2, BETA_SIGMOID, NEG_EIGVAL), _beta_in(b3, v3, BETA_SIGMOID, NEG_EIGVAL)
    # Non-finite inputs: from the chunk's first token with a non-finite k, beta or decay (row fb) on, the recurrence
    # is NaN. gc is stored NaN from fb on, which carries that to every output and state downstream; the inverse
    # runs on the rows before fb (the A rows from fb on are zeroed, so no 0·NaN reaches the earlier rows). The rows
    # of Ainv from fb on are then finite but meaningless: every consumer scales them by e^gc.
    fb = _first_bad(a00, b0, c0, 0, BT)
    if NB >= 2:
        fb = tl.minimum(fb, _first_bad(a11, b1, c1, 16, BT))
    if NB == 4:
        fb = tl.minimum(fb, tl.minimum(_first_bad(a22, b2, c2, 32, BT), _first_bad(a33, b3, c3, 48, BT)))
    l0 = v0 & (r < fb)
    L00 = _decay(a00, l0, v0, c0, c0, b0, True)
    if NB >= 2:
        l1 = v1 & (16 + r < fb)
        L11 = _decay(a11, l1, v1, c1, c1, b1, True)
        A10 = _decay(a10, l1, v0, c1, c0, b1, False)
    if NB == 4:
        l2, l3 = v2 & (32 + r < fb), v3 & (48 + r < fb)
        L22 = _decay(a22, l2, v2, c2, c2, b2, True)
        L33 = _decay(a33, l3, v3, c3, c3, b3, True)
        A20 = _decay(a20, l2, v0, c2, c0, b2, False)
        A21 = _decay(a21, l2, v1, c2, c1, b2, False)
        A30 = _decay(a30, l3, v0, c3, c0, b3, False)
        A31 = _decay(a31, l3, v1, c3, c1, b3, False)
        A32 = _decay(a32, l3, v2, c3, c2, b3, False)
    nan = float("nan")
    tl.store(gc + x0 * HV + i_hv, tl.where(t_0 - t0 < fb, c0, nan), mask=v0)
    if NB >= 2:
        tl.store(gc + x1 * HV + i_hv, tl.where(t_1 - t0 < fb, c1, nan), mask=v1)
    if NB == 4:
        tl.store(gc + x2 * HV + i_hv, tl.where(t_2 - t0 < fb, c2, nan), mask=v2)
        tl.store(gc + x3 * HV + i_hv, tl.where(t_3 - t0 < fb, c3, nan), mask=v3)
    if NB == 1:
        T00 = tl.reshape(_inv16(L00[None, :, :]), [16, 16])
    if NB == 2:
        T00, T11 = _unstack2(_inv16(_stack2(L00, L11)))
    if NB == 4:
        # block 2q + w of the stack is element [w, q] of the join of the two pairs
        S = tl.reshape(tl.permute(tl.join(tl.join(L00, L11), tl.join(L22, L33)), (3, 2, 0, 1)), [4, 16, 16])
        P01, P23 = tl.split(tl.permute(tl.reshape(_inv16(S), [2, 2, 16, 16]), (2, 3, 1, 0)))
        T00, T11 = tl.split(P01)
        T22, T33 = tl.split(P23)
    if NB >= 2:
        T10 = -_dot32(_dot32(T11, A10, PREC), T00, PREC)
    if NB == 4:
        T21 = -_dot32(_dot32(T22, A21, PREC), T11, PREC)
        T32 = -_dot32(_dot32(T33, A32, PREC), T22, PREC)
        T20 = -_dot32(T22, _dot32(A20, T00, PREC) + _dot32(A21, T10, PREC), PREC)
        T31 = -_dot32(T33, _dot32(A31, T11, PREC) + _dot32(A32, T21, PREC), PREC)
        T30 = -_dot32(T33, _dot32(A30, T00, PREC) + _dot32(A31, T10, PREC) + _dot32(A32, T20, PREC), PREC)
    Z = tl.zeros([16, 16], dtype=tl.float32)
    p = Ainv + i_hv * BT
    _store16(p, x0, v0, 0, T00, HV, BT)
    if NB >= 2:
        _store16(p, x0, v0, 16, Z, HV, BT)
    if NB == 4:
        _store16(p, x0, v0, 32, Z, HV, BT)
        _store16(p, x0, v0, 48, Z, HV, BT)
    if NB >= 2:
        _store16(p, x1, v1, 0, T10, HV, BT)
        _store16(p, x1, v1, 16, T11, HV, BT)
    if NB == 4:
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
