"""Stage ``wy_bwd`` (backward): through w = Ainv·(beta·e^gc·k), u = Ainv·(beta·v) and Ainv = (I + A)^-1: dk, dv,
dbeta, and dg as the reverse within-chunk cumsum of dgc."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _chunk_rows, _empty_slot
from .gva import _gva_program, _head_arrive, _head_pass, _head_publish, _head_wait, _slot_arrive, _slot_sum


@triton.jit
def _wy_bwd_dv(A, b, v, dvn, dv, x, i_hv, valid, HV, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr):
    """wy_bwd's dv = beta·(Aᵀ du) over BV-wide column blocks; returns dbeta's Σ (Aᵀ du)·v term [BT] (fp32)."""
    dt = A.dtype
    db = tl.zeros([BT], dtype=tl.float32)
    for v0 in range(0, V, BV):
        cv = v0 + tl.arange(0, BV)
        mv = valid[:, None] & (cv[None, :] < V)
        vv = tl.load(v + x[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0).to(tl.float32)
        du = tl.load(dvn + x[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0)
        dX = tl.dot(tl.trans(A), du.to(dt))
        tl.store(dv + x[:, None] * (HV * V) + i_hv * V + cv[None, :], (dX * b[:, None]).to(dv.dtype.element_ty),
                 mask=mv)
        db += tl.sum(dX * vv, 1)
    return db


@triton.jit
def _wy_bwd_dk(A, M, MT, b, eg, k, dw, dkp, dk, part, x, i_h, i_hv, valid, n, H, HV, K: tl.constexpr, G,
               BT: tl.constexpr, BK: tl.constexpr, GSUM: tl.constexpr, TRANS_OUT: tl.constexpr,
               SLOTS: tl.constexpr):
    """wy_bwd's dk = dkp + beta·e^gc·(Aᵀ dw) + M k + Mᵀ k over BK-wide column blocks (with GSUM rank n's
    ``_head_pass``, with SLOTS into this value head's slot of ``part``); returns the dbeta and dg terms of the k
    path [BT] (fp32)."""
    dt = A.dtype
    db = tl.zeros([BT], dtype=tl.float32)
    dg = tl.zeros([BT], dtype=tl.float32)
    for k0 in range(0, K, BK):
        ck = k0 + tl.arange(0, BK)
        mk = valid[:, None] & (ck[None, :] < K)
        kk = tl.load(k + x[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0)
        dww = tl.load(dw + x[:, None] * (HV * K) + i_hv * K + ck[None, :], mask=mk, other=0.0)
        dX = tl.dot(tl.trans(A), dww.to(dt))
        dkk = tl.load(dkp + x[:, None] * (HV * K) + i_hv * K + ck[None, :], mask=mk, other=0.0).to(tl.float32)
        dkk += dX * (b * eg)[:, None] + tl.dot(M, kk.to(dt))
        if TRANS_OUT:
            # kᵀ from its own load (as in the first K loop): then every dot operand of this loop is prefetched
            kT = tl.load(k + x[None, :] * (H * K) + i_h * K + ck[:, None], mask=mk.T, other=0.0)
            dkk += tl.trans(tl.dot(kT.to(dt), M))
        else:
            dkk += tl.dot(MT, kk.to(dt))
        ok = x[:, None] * (H * K) + i_h * K + ck[None, :]
        if SLOTS:
            tl.store(part + x[:, None] * (HV * K) + i_hv * K + ck[None, :], dkk, mask=mk)
        elif GSUM:
            _head_pass(dkk, dk, part, ok, mk, n, G)
        else:
            tl.store(dk + ok, dkk.to(dk.dtype.element_ty), mask=mk)
        t1 = tl.sum(dX * kk.to(tl.float32), 1) * eg
        db += t1
        dg += t1 * b
    return db, dg


@triton.jit(do_not_specialize=["T", "H", "HV"])
def gdn_wy_bwd_kernel(k, v, beta, gc, Ainv, dw, dvn, dkp, dk, dgc, dv, dbeta, dg, cnt, part, cu, cidx, T, H,
                      HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, GSUM: tl.constexpr, TRANS_OUT: tl.constexpr, LATE_WAIT: tl.constexpr,
                      IS_VARLEN: tl.constexpr, SLOTS: tl.constexpr = False, EMPTY_SLOTS: tl.constexpr = False,
                      NO_H0: tl.constexpr = False):
    """Through w = Ainv·(beta·e^gc·k), u = Ainv·(beta·v) and Ainv = (I + A)^-1 (du = dv_new): dk = dkp + these
    terms ([rows, H, K], k's dtype; with GSUM / SLOTS summed over the value heads like grad_chunk's dq), dv, dbeta and
    dg = reverse within-chunk cumsum of dgc. TRANS_OUT: the Mᵀ·k term of dk as (kᵀ·M)ᵀ, a transposed dot result
    added to dk, instead of Mᵀ built from its own dots (dTT, dAT); one [BT, BT] accumulator and four dots fewer.
    LATE_WAIT: see the comment at the dk loop. beta is beta as taken and dbeta, dg are the gradients of beta as
    taken and of the decay: fla's beta and gate options are chained on outside this kernel (``options.py``). NO_H0
    (no initial state): a sequence's first decay scales a zero state, so its gradient is 0 exactly, not the residue
    of the chunk's cancelling terms."""
    i_t, i_bh, tile = _gva_program(H, HV, GSUM)
    if EMPTY_SLOTS:  # a device-built plan: the programs past the last chunk have none
        if _empty_slot(cidx, i_t):
            return
    i_b, i_hv, i_h, bos, Tn, t0, t, valid, x = _chunk_rows(i_t, i_bh, cu, cidx, T, H, HV, BT, IS_VARLEN)
    r = tl.arange(0, BT)
    dt = dw.dtype.element_ty  # operand dtype of this kernel's dots: bf16, or fp32 (tf32) for fp16/fp32 inputs
    A = tl.load(Ainv + (x[:, None] * HV + i_hv) * BT + r[None, :], mask=valid[:, None], other=0.0).to(dt)
    b = tl.load(beta + x * HV + i_hv, mask=valid, other=0.0).to(tl.float32)
    gg = tl.load(gc + x * HV + i_hv, mask=valid, other=0.0)
    eg = tl.exp(gg)
    dgl = tl.load(dgc + x * HV + i_hv, mask=valid, other=0.0)  # loaded early: no load latency at the end
    dT = tl.zeros([BT, BT], dtype=tl.float32)
    dTT = tl.zeros([BT, BT], dtype=tl.float32)
    KK = tl.zeros([BT, BT], dtype=tl.float32)
    for k0 in range(0, K, BK):
        ck = k0 + tl.arange(0, BK)
        mk = valid[:, None] & (ck[None, :] < K)
        kk = tl.load(k + x[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0)
        dww = tl.load(dw + x[:, None] * (HV * K) + i_hv * K + ck[None, :], mask=mk, other=0.0)
        ks = (kk.to(tl.float32) * (b * eg)[:, None]).to(dt)
        dT += tl.dot(dww.to(dt), tl.trans(ks))
        if not TRANS_OUT:
            dTT += tl.dot(ks, tl.trans(dww.to(dt)))
        # k kᵀ with kᵀ from its own (transposed) load: one loaded tile as both operands of a pipelined wgmma gives
        # run-to-run different KK (dbeta, dg) on the H200 with Triton 3.6; pipelined at all, KK still differed
        # between calls with hundreds of programs in flight (dk, dv, which do not use it, did not), so the kernel
        # runs in one stage (ChunkConfig.check)
        kT = tl.load(k + x[None, :] * (H * K) + i_h * K + ck[:, None], mask=mk.T, other=0.0)
        KK += tl.dot(kk, kT)
    for v0 in range(0, V, BV):
        cv = v0 + tl.arange(0, BV)
        mv = valid[:, None] & (cv[None, :] < V)
        vv = tl.load(v + x[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0).to(tl.float32)
        du = tl.load(dvn + x[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0)
        vs = (vv * b[:, None]).to(dt)
        dT += tl.dot(du.to(dt), tl.trans(vs))
        if not TRANS_OUT:
            dTT += tl.dot(vs, tl.trans(du.to(dt)))
    ml = (r[:, None] > r[None, :]) & valid[:, None] & valid[None, :]
    mlT = (r[:, None] < r[None, :]) & valid[:, None] & valid[None, :]
    # dA and dAᵀ each from their own dots: no tl.trans of a dot result as a dot operand (Triton 3.4-3.7.0
    # miscompiles it on Hopper, fla #640 / #984)
    dA = -tl.dot(tl.trans(A), tl.dot(dT.to(dt), tl.trans(A)).to(dt))
    KD = tl.where(ml, KK * tl.exp(tl.where(ml, gg[:, None] - gg[None, :], 0.0)), 0.0)
    dA = tl.where(ml, dA, 0.0)
    dAK = dA * KD
    db = tl.sum(dAK, 1)
    dAA = dAK * b[:, None]
    dgg = tl.sum(dAA, 1) - tl.sum(dAA, 0)
    M = tl.where(ml, dA * b[:, None]  # dA·beta_i·decay
                * tl.exp(tl.where(ml, gg[:, None] - gg[None, :], 0.0)), 0.0).to(dt)
    if not TRANS_OUT:
        dAT = -tl.dot(A, tl.dot(dTT.to(dt), A).to(dt))
        MT = tl.where(mlT, dAT * b[None, :] * tl.exp(tl.where(mlT, gg[None, :] - gg[:, None], 0.0)), 0.0).to(dt)
    else:
        MT = M  # unused
    G = HV // H
    # the dk loop waits for the earlier value heads' running sum a single time, before it starts (a wait or barrier in
    # it would stop its software pipelining); with LATE_WAIT rank 0 runs its dk loop first and the later ranks
    # their dv loop first, so that they wait less
    if GSUM and not SLOTS:
        n = _head_arrive(cnt, tile)
    else:
        n = 0
    if SLOTS:  # no rank waits: each stores its slot, the last adds them
        dbv = _wy_bwd_dv(A, b, v, dvn, dv, x, i_hv, valid, HV, V, BT, BV)
        dbk, dgk = _wy_bwd_dk(A, M, MT, b, eg, k, dw, dkp, dk, part, x, i_h, i_hv, valid, n, H, HV, K, G, BT, BK,
                              GSUM, TRANS_OUT, SLOTS)
        if _slot_arrive(cnt, tile) == G - 1:
            for k0 in range(0, K, BK):
                ck = k0 + tl.arange(0, BK)
                mk = valid[:, None] & (ck[None, :] < K)
                _slot_sum(dk, x[:, None] * (H * K) + i_h * K + ck[None, :], part,
                          x[:, None] * (HV * K) + i_h * G * K + ck[None, :], mk, G, K)
    elif LATE_WAIT and n == 0:
        dbk, dgk = _wy_bwd_dk(A, M, MT, b, eg, k, dw, dkp, dk, part, x, i_h, i_hv, valid, n, H, HV, K, G, BT, BK,
                              GSUM, TRANS_OUT, SLOTS)
        if GSUM:
            _head_publish(cnt, tile, n, G)
        dbv = _wy_bwd_dv(A, b, v, dvn, dv, x, i_hv, valid, HV, V, BT, BV)
    else:
        dbv = _wy_bwd_dv(A, b, v, dvn, dv, x, i_hv, valid, HV, V, BT, BV)
        if GSUM:
            _head_wait(cnt, tile, n)
        dbk, dgk = _wy_bwd_dk(A, M, MT, b, eg, k, dw, dkp, dk, part, x, i_h, i_hv, valid, n, H, HV, K, G, BT, BK,
                              GSUM, TRANS_OUT, SLOTS)
        if GSUM:
            _head_publish(cnt, tile, n, G)
    db += dbv
    db += dbk
    dgg += dgk
    dgg += dgl
    rev = tl.cumsum(dgg, 0, reverse=True)  # a suffix sum, not total - prefix sum (which cancels at the chunk end)
    if NO_H0:
        rev = tl.where(t == 0, 0.0, rev)
    tl.store(dg + x * HV + i_hv, rev.to(dg.dtype.element_ty), mask=valid)
    tl.store(dbeta + x * HV + i_hv, db.to(dbeta.dtype.element_ty), mask=valid)
