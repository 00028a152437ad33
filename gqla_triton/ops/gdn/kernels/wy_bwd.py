"""Stage ``wy_bwd`` (backward): through w = Ainv·(beta·e^gc·k), u = Ainv·(beta·v) and Ainv = (I + A)^-1: dk, dv,
dbeta, and dg as the reverse within-chunk cumsum of dgc."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _chunk_rows, _empty_slot
from .gva import _gva_program, _head_arrive, _head_pass, _head_publish, _head_wait, _slot_arrive, _slot_sum


@triton.jit
def _k_tiles(k, dw, dkp, x, i_h, i_hv, valid, k0, H, HV, K: tl.constexpr, BK: tl.constexpr, DKP: tl.constexpr):
    """Columns ``k0 .. k0 + BK`` (masked past K) of k [BT, BK], dw [BT, BK], kᵀ [BK, BT] (its own transposed load)
    and, with DKP, dkp [BT, BK] (else dw again)."""
    ck = k0 + tl.arange(0, BK)
    mk = valid[:, None] & (ck[None, :] < K)
    kk = tl.load(k + x[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0)
    dww = tl.load(dw + x[:, None] * (HV * K) + i_hv * K + ck[None, :], mask=mk, other=0.0)
    kT = tl.load(k + x[None, :] * (H * K) + i_h * K + ck[:, None], mask=mk.T, other=0.0)
    if DKP:
        dkk = tl.load(dkp + x[:, None] * (HV * K) + i_hv * K + ck[None, :], mask=mk, other=0.0)
    else:
        dkk = dww
    return kk, dww, kT, dkk


@triton.jit
def _v_tiles(v, dvn, x, i_hv, valid, v0, HV, V: tl.constexpr, BV: tl.constexpr):
    """Columns ``v0 .. v0 + BV`` (masked past V) of v and du = dv_new [BT, BV]."""
    cv = v0 + tl.arange(0, BV)
    mv = valid[:, None] & (cv[None, :] < V)
    vv = tl.load(v + x[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0)
    du = tl.load(dvn + x[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0)
    return vv, du


@triton.jit
def _wy_bwd_dv(A, b, v, dvn, dv, x, i_hv, valid, HV, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr):
    """wy_bwd's dv = beta·(Aᵀ du) over BV-wide column blocks, a pass of its own; returns dbeta's Σ (Aᵀ du)·v term
    [BT] (fp32)."""
    dt = A.dtype
    db = tl.zeros([BT], dtype=tl.float32)
    for v0 in range(0, V, BV):
        vv, du = _v_tiles(v, dvn, x, i_hv, valid, v0, HV, V, BV)
        dX = tl.dot(tl.trans(A), du.to(dt))
        cv = v0 + tl.arange(0, BV)
        tl.store(dv + x[:, None] * (HV * V) + i_hv * V + cv[None, :], (dX * b[:, None]).to(dv.dtype.element_ty),
                 mask=valid[:, None] & (cv[None, :] < V))
        db += tl.sum(dX * vv.to(tl.float32), 1)
    return db


@triton.jit
def _wy_bwd_dk(A, M, MT, b, eg, k, dw, dkp, dk, part, x, i_h, i_hv, valid, n, H, HV, K: tl.constexpr, G,
               BT: tl.constexpr, BK: tl.constexpr, GSUM: tl.constexpr, TRANS_OUT: tl.constexpr,
               SLOTS: tl.constexpr):
    """wy_bwd's dk = dkp + beta·e^gc·(Aᵀ dw) + M k + Mᵀ k over BK-wide column blocks (with GSUM rank n's
    ``_head_pass``, with SLOTS into this value head's slot of ``part``); returns the dbeta and dg terms of the k path
    [BT] (fp32)."""
    dt = A.dtype
    db = tl.zeros([BT], dtype=tl.float32)
    dg = tl.zeros([BT], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk, dww, kT, dkk = _k_tiles(k, dw, dkp, x, i_h, i_hv, valid, k0, H, HV, K, BK, True)
        ck = k0 + tl.arange(0, BK)
        mk = valid[:, None] & (ck[None, :] < K)
        dX = tl.dot(tl.trans(A), dww.to(dt))
        acc = dkk.to(tl.float32)
        acc += dX * (b * eg)[:, None] + tl.dot(M, kk.to(dt))
        if TRANS_OUT:  # kᵀ from its own load (as in the first K loop): every dot operand of this loop is loaded
            acc += tl.trans(tl.dot(kT.to(dt), M))
        else:
            acc += tl.dot(MT, kk.to(dt))
        ok = x[:, None] * (H * K) + i_h * K + ck[None, :]
        if SLOTS:
            tl.store(part + x[:, None] * (HV * K) + i_hv * K + ck[None, :], acc, mask=mk)
        elif GSUM:
            _head_pass(acc, dk, part, ok, mk, n, G)
        else:
            tl.store(dk + ok, acc.to(dk.dtype.element_ty), mask=mk)
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
    dg = reverse within-chunk cumsum of dgc. dv = beta·(Aᵀ du) needs no other gradient: it is formed in the pass
    over V that adds du's term to dAinv (with LATE_WAIT, in a pass of its own). TRANS_OUT: the Mᵀ·k term of dk as
    (kᵀ·M)ᵀ, a transposed dot result added to dk, instead of Mᵀ built from its own dots (dTT, dAT); one [BT, BT]
    accumulator and four dots fewer. LATE_WAIT (value heads passing dk's running sum along): see the comment at the
    dk loop. beta is beta as taken and dbeta, dg are the gradients of beta as taken and of the decay: fla's beta and
    gate options are chained on outside this kernel (``options.py``). NO_H0 (no initial state): a sequence's first
    decay scales a zero state, so its gradient is 0 exactly, not the residue of the chunk's cancelling terms."""
    i_t, i_bh, tile = _gva_program(H, HV, GSUM)
    if EMPTY_SLOTS:  # a device-built plan: the programs past the last chunk have none
        if _empty_slot(cidx, i_t):
            return
    i_b, i_hv, i_h, bos, Tn, t0, t, valid, x = _chunk_rows(i_t, i_bh, cu, cidx, T, H, HV, BT, IS_VARLEN)
    # GSUM without SLOTS: the value heads pass dk's running sum along (gva.py); with LATE_WAIT dv is formed in a pass
    # of its own, placed by the rank (below), else in the pass over V
    if GSUM and not SLOTS and LATE_WAIT:
        n = _head_arrive(cnt, tile)
    else:
        n = 0
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
    db = tl.zeros([BT], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk, dww, kT, _ = _k_tiles(k, dw, dkp, x, i_h, i_hv, valid, k0, H, HV, K, BK, False)
        ks = (kk.to(tl.float32) * (b * eg)[:, None]).to(dt)
        dT += tl.dot(dww.to(dt), tl.trans(ks))
        if not TRANS_OUT:
            dTT += tl.dot(ks, tl.trans(dww.to(dt)))
        # k kᵀ with kᵀ from its own (transposed) load: one loaded tile as both operands of a pipelined wgmma gives
        # run-to-run different KK (dbeta, dg) on the H200 with Triton 3.6; pipelined at all, KK still differed
        # between calls with hundreds of programs in flight (dk, dv, which do not use it, did not), so the kernel
        # runs in one stage (ChunkConfig.check)
        KK += tl.dot(kk, kT)
    for v0 in range(0, V, BV):
        vv, du = _v_tiles(v, dvn, x, i_hv, valid, v0, HV, V, BV)
        vf = vv.to(tl.float32)
        vs = (vf * b[:, None]).to(dt)
        dT += tl.dot(du.to(dt), tl.trans(vs))
        if not TRANS_OUT:
            dTT += tl.dot(vs, tl.trans(du.to(dt)))
        if not (GSUM and not SLOTS and LATE_WAIT):
            dX = tl.dot(tl.trans(A), du.to(dt))
            cv = v0 + tl.arange(0, BV)
            tl.store(dv + x[:, None] * (HV * V) + i_hv * V + cv[None, :],
                     (dX * b[:, None]).to(dv.dtype.element_ty), mask=valid[:, None] & (cv[None, :] < V))
            db += tl.sum(dX * vf, 1)
    ml = (r[:, None] > r[None, :]) & valid[:, None] & valid[None, :]
    mlT = (r[:, None] < r[None, :]) & valid[:, None] & valid[None, :]
    # dA and dAᵀ each from their own dots: no tl.trans of a dot result as a dot operand (Triton 3.4-3.7.0
    # miscompiles it on Hopper, fla #640 / #984)
    dA = -tl.dot(tl.trans(A), tl.dot(dT.to(dt), tl.trans(A)).to(dt))
    KD = tl.where(ml, KK * tl.exp(tl.where(ml, gg[:, None] - gg[None, :], 0.0)), 0.0)
    dA = tl.where(ml, dA, 0.0)
    dAK = dA * KD
    dbA = tl.sum(dAK, 1)
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
    # the dk loop waits for the earlier value heads' running sum a single time, before it starts; with LATE_WAIT (ranks
    # taken at the start) rank 0 runs its dk loop at once and its dv pass after passing its sum on, the later ranks
    # their dv pass first, so that they wait less
    if SLOTS:  # no rank waits: each stores its slot, the last adds them
        dbk, dgk = _wy_bwd_dk(A, M, MT, b, eg, k, dw, dkp, dk, part, x, i_h, i_hv, valid, 0, H, HV, K, G, BT, BK,
                              GSUM, TRANS_OUT, SLOTS)
        if _slot_arrive(cnt, tile) == G - 1:
            for k0 in range(0, K, BK):
                ck = k0 + tl.arange(0, BK)
                mk = valid[:, None] & (ck[None, :] < K)
                _slot_sum(dk, x[:, None] * (H * K) + i_h * K + ck[None, :], part,
                          x[:, None] * (HV * K) + i_h * G * K + ck[None, :], mk, G, K)
    elif GSUM and LATE_WAIT:
        if n == 0:
            dbk, dgk = _wy_bwd_dk(A, M, MT, b, eg, k, dw, dkp, dk, part, x, i_h, i_hv, valid, n, H, HV, K, G, BT,
                                  BK, GSUM, TRANS_OUT, SLOTS)
            _head_publish(cnt, tile, n, G)
            db += _wy_bwd_dv(A, b, v, dvn, dv, x, i_hv, valid, HV, V, BT, BV)
        else:
            db += _wy_bwd_dv(A, b, v, dvn, dv, x, i_hv, valid, HV, V, BT, BV)
            _head_wait(cnt, tile, n)
            dbk, dgk = _wy_bwd_dk(A, M, MT, b, eg, k, dw, dkp, dk, part, x, i_h, i_hv, valid, n, H, HV, K, G, BT,
                                  BK, GSUM, TRANS_OUT, SLOTS)
            _head_publish(cnt, tile, n, G)
    else:
        if GSUM:
            n = _head_arrive(cnt, tile)
            _head_wait(cnt, tile, n)
        dbk, dgk = _wy_bwd_dk(A, M, MT, b, eg, k, dw, dkp, dk, part, x, i_h, i_hv, valid, n, H, HV, K, G, BT, BK,
                              GSUM, TRANS_OUT, SLOTS)
        if GSUM:
            _head_publish(cnt, tile, n, G)
    db = dbA + db
    db += dbk
    dgg += dgk
    dgg += dgl
    rev = tl.cumsum(dgg, 0, reverse=True)  # a suffix sum, not total - prefix sum (which cancels at the chunk end)
    if NO_H0:
        rev = tl.where(t == 0, 0.0, rev)
    tl.store(dg + x * HV + i_hv, rev.to(dg.dtype.element_ty), mask=valid)
    tl.store(dbeta + x * HV + i_hv, db.to(dbeta.dtype.element_ty), mask=valid)
