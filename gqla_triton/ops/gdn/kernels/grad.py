"""Stage ``grad`` (backward): dq, the state and intra-chunk terms of dk, dw and dgc per chunk."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _chunk_rows, _chunk_state_row, _empty_slot
from .gva import _gva_program, _head_add, _head_arrive, _head_publish, _head_wait, _slot_arrive, _slot_sum


@triton.jit
def _grad_qk(q, k, x, i_h, mk, ck, H, K):
    """grad_chunk's q and k tiles [BT, BK]."""
    qq = tl.load(q + x[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0)
    kk = tl.load(k + x[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0)
    return qq, kk


@triton.jit(do_not_specialize=["T", "NT", "H", "HV"])
def gdn_grad_chunk_kernel(q, k, vnew, gc, h, dhe, h0, dht, do, dvn, dq, dkp, dw, dgc, cnt, part, cu, cidx, coff,
                          scale, T, NT, H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                          BK: tl.constexpr, BV: tl.constexpr, GSUM: tl.constexpr,
                          TRANS_OUT: tl.constexpr, EARLY: tl.constexpr, LATE_WAIT: tl.constexpr,
                          USE_H0: tl.constexpr, USE_DHT: tl.constexpr, IS_VARLEN: tl.constexpr,
                          V_FIRST: tl.constexpr = False, SLOTS: tl.constexpr = False,
                          EMPTY_SLOTS: tl.constexpr = False):
    """Per chunk and value head: dq ([rows, H, K], q's dtype; with GSUM summed over the value heads of each q/k head
    through ``part`` and ``cnt``, see ``gva.py``; SLOTS: one slot per value head), the state + intra-chunk part of
    dk (dkp [rows, HV, K]), dw = −dv_new·hᵀ, dgc (fp32).
    TRANS_OUT: dk's dPmᵀ·q term as (qᵀ·dPm)ᵀ, a transposed dot result, instead of dPmᵀ from its own dots.
    EARLY: the epilogue's q / k loads are issued before the V loop (their latency then overlaps it; sm_90: the
    tiles wait in shared memory, 32 KB more) instead of after it.
    LATE_WAIT (GSUM): rank 0 passes its dq on before its dk work, the later ranks wait and add after theirs (by
    then the earlier ranks have passed theirs on), instead of every rank passing dq on at its end.
    USE_H0 / USE_DHT: dg's decay term Σ h⊙dh takes the fp32 initial state h0 [N, HV, K, V] for a sequence's first
    chunk and the fp32 dht for its last, not their rounded copies in h / dhe (in a short sequence that term can be
    most of dg, a sum with cancellation). h0 is fp32, bf16 or fp16 (read to fp32); V_FIRST: h0 and dht rows are
    ``[V, K]``."""
    i_t, i_bh, tile = _gva_program(H, HV, GSUM)
    if EMPTY_SLOTS:  # a device-built plan: the programs past the last chunk have none
        if _empty_slot(cidx, i_t):
            return
    i_b, i_hv, i_h, bos, Tn, t0, t, valid, x = _chunk_rows(i_t, i_bh, cu, cidx, T, H, HV, BT, IS_VARLEN)
    i_ch = _chunk_state_row(i_t, i_b, coff, cidx, NT, IS_VARLEN)
    ck = tl.arange(0, BK)
    mk = valid[:, None] & (ck[None, :] < K)
    dqi = tl.zeros([BT, BK], dtype=tl.float32)
    dki = tl.zeros([BT, BK], dtype=tl.float32)
    dww = tl.zeros([BT, BK], dtype=tl.float32)
    dP = tl.zeros([BT, BT], dtype=tl.float32)
    dPT = tl.zeros([BT, BT], dtype=tl.float32)
    hs = tl.zeros([BK], dtype=tl.float32)
    dt = k.dtype.element_ty
    if USE_H0 or USE_DHT:
        if IS_VARLEN:
            i_n = tl.load(cidx + 2 * i_t).to(tl.int64)
        else:
            i_n = i_b.to(tl.int64)
        first = (t0 == 0).to(tl.int32)
        lastc = (t0 + BT >= Tn).to(tl.int32)
    if EARLY:
        qq, kk = _grad_qk(q, k, x, i_h, mk, ck, H, K)
    for v0 in range(0, V, BV):
        cv = v0 + tl.arange(0, BV)
        mv = valid[:, None] & (cv[None, :] < V)
        mkv = (ck[:, None] < K) & (cv[None, :] < V)
        hh = tl.load(h + ((i_ch * HV + i_hv) * K + ck[:, None]) * V + cv[None, :], mask=mkv, other=0.0)
        de = tl.load(dhe + ((i_ch * HV + i_hv) * K + ck[:, None]) * V + cv[None, :], mask=mkv, other=0.0)
        vn = tl.load(vnew + x[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0)
        dd = tl.load(do + x[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0).to(dt)
        dv = tl.load(dvn + x[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0)
        dqi += tl.dot(dd, tl.trans(hh.to(dt)))
        dki += tl.dot(vn.to(dt), tl.trans(de.to(dt)))
        dww += tl.dot(dv.to(dt), tl.trans(hh.to(dt)))
        dP += tl.dot(dd, tl.trans(vn.to(dt)))
        if not TRANS_OUT:
            dPT += tl.dot(vn.to(dt), tl.trans(dd))
        # dg's per-chunk decay term Σ h⊙dh, h and dh from their own (L2) loads: with the dots' tiles also used
        # elementwise here, dk is not bitwise reproducible on the H200 (Triton 3.6; likewise wy_bwd's k kᵀ)
        os = ((i_ch * HV + i_hv) * K + ck[:, None]) * V + cv[None, :]
        if USE_H0 or USE_DHT:
            if V_FIRST:
                on = ((i_n * HV + i_hv) * V + cv[None, :]) * K + ck[:, None]
            else:
                on = ((i_n * HV + i_hv) * K + ck[:, None]) * V + cv[None, :]
        if USE_H0:  # masked loads (a branch here would stop the loop's pipelining); ex as a tile for the interpreter
            ex = (on * 0 + first) != 0
            h2 = (tl.load(h + os, mask=mkv & ~ex, other=0.0, cache_modifier=".cg").to(tl.float32)
                  + tl.load(h0 + on, mask=mkv & ex, other=0.0).to(tl.float32))
        else:
            h2 = tl.load(h + os, mask=mkv, other=0.0, cache_modifier=".cg").to(tl.float32)
        if USE_DHT:
            ex = (on * 0 + lastc) != 0
            d2 = (tl.load(dhe + os, mask=mkv & ~ex, other=0.0, cache_modifier=".cg").to(tl.float32)
                  + tl.load(dht + on, mask=mkv & ex, other=0.0))
        else:
            d2 = tl.load(dhe + os, mask=mkv, other=0.0, cache_modifier=".cg").to(tl.float32)
        hs += tl.sum(h2 * d2, 1)
    if not EARLY:
        qq, kk = _grad_qk(q, k, x, i_h, mk, ck, H, K)
    last = tl.minimum(t0 + BT, Tn) - 1
    gl = tl.load(gc + (bos + last) * HV + i_hv)
    gg = tl.load(gc + x * HV + i_hv, mask=valid, other=0.0)
    dqq = dqi * (tl.exp(gg) * scale)[:, None]
    dg = tl.sum(dqq * qq.to(tl.float32), 1)
    dkk = dki * tl.exp(tl.where(valid, gl - gg, 0.0))[:, None]
    dkt = tl.sum(dkk * kk.to(tl.float32), 1)
    dg -= dkt
    dgl = tl.sum(dkt, 0) + tl.exp(gl) * tl.sum(hs, 0)
    r = tl.arange(0, BT)
    m = (r[:, None] >= r[None, :]) & valid[:, None] & valid[None, :]
    dPm = tl.where(m, dP * scale * tl.exp(tl.where(m, gg[:, None] - gg[None, :], 0.0)), 0.0)
    dPP = dPm * tl.dot(qq, tl.trans(kk))
    dg += tl.sum(dPP, 1) - tl.sum(dPP, 0)
    dg += tl.where(t == last, dgl, 0.0)
    # dPmᵀ from its own dot, not tl.trans of dPm: Triton 3.4-3.7.0 miscompiles the transpose of a dot result
    # used as a dot operand on Hopper (fla #640, #984): dg would differ from run to run on the GPU
    dqq += tl.dot(dPm.to(dt), kk)
    oq = x[:, None] * (H * K) + i_h * K + ck[None, :]
    G = HV // H
    if GSUM and LATE_WAIT and not SLOTS:
        n = _head_arrive(cnt, tile)
        if n == 0:
            tl.store(part + oq, dqq, mask=mk)
            _head_publish(cnt, tile, n, G)
    if TRANS_OUT:
        dkk += tl.trans(tl.dot(tl.trans(qq), dPm.to(dt)))
    else:
        mT = (r[:, None] <= r[None, :]) & valid[:, None] & valid[None, :]
        dPmT = tl.where(mT, dPT * scale * tl.exp(tl.where(mT, gg[None, :] - gg[:, None], 0.0)), 0.0)
        dkk += tl.dot(dPmT.to(dt), qq)
    o = x[:, None] * (HV * K) + i_hv * K + ck[None, :]
    tl.store(dkp + o, dkk.to(dkp.dtype.element_ty), mask=mk)
    tl.store(dw + o, (-dww).to(dw.dtype.element_ty), mask=mk)
    if SLOTS:
        tl.store(part + o, dqq, mask=mk)
        n = _slot_arrive(cnt, tile)
        if n == G - 1:
            _slot_sum(dq, oq, part, x[:, None] * (HV * K) + i_h * G * K + ck[None, :], mk, G, K)
    elif GSUM:
        if LATE_WAIT:
            if n > 0:
                _head_wait(cnt, tile, n)
                _head_add(dqq, dq, part, oq, mk, cnt, tile, n, G)
        else:
            n = _head_arrive(cnt, tile)
            _head_wait(cnt, tile, n)
            _head_add(dqq, dq, part, oq, mk, cnt, tile, n, G)
    else:
        tl.store(dq + oq, dqq.to(dq.dtype.element_ty), mask=mk)
    tl.store(dgc + x * HV + i_hv, dg, mask=valid)

