"""Backward stages of the chunked gated delta rule (layouts as in ``chunk_fwd.py``).

Stages (after recomputing w, u, h, v_new with the forward kernels):
``dv_local`` (scale·Pᵀ·dO) -> ``state_bwd`` (reverse pass: dS at each chunk end, dv_new, dh0) ->
``grad_chunk`` (dq, the k terms of the state and intra-chunk paths, dw, dgc) -> ``wy_bwd`` (through
Ainv = (I + A)^-1: dk, dv, dbeta, and dg as the reverse within-chunk cumsum of dgc).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_fwd import _chunk_rows, _chunk_state_row, _state_heads


@triton.jit(do_not_specialize=["T", "H", "HV"])
def gdn_dv_local_kernel(q, k, gc, do, dvl, cu, cidx, scale, T, H, HV,
                        K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        EARLY: tl.constexpr, IS_VARLEN: tl.constexpr):
    """dvl_j = scale·Σ_{i≥j} (q_i·k_j) e^(gc_i−gc_j) dO_i ([rows, HV, V]); k qᵀ over BK-wide slices of K. EARLY:
    dO and gc are loaded before that loop instead of after it."""
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv, i_h, bos, Tn, t0, t, valid, x = _chunk_rows(i_t, i_bh, cu, cidx, T, H, HV, BT, IS_VARLEN)
    cv = i_v * BV + tl.arange(0, BV)
    mv = valid[:, None] & (cv[None, :] < V)
    kq = tl.zeros([BT, BT], dtype=tl.float32)
    if EARLY:
        gg = tl.load(gc + x * HV + i_hv, mask=valid, other=0.0)
        dd = tl.load(do + x[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0)
    for k0 in range(0, K, BK):
        ck = k0 + tl.arange(0, BK)
        mk = valid[:, None] & (ck[None, :] < K)
        qq = tl.load(q + x[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0)
        kk = tl.load(k + x[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0)
        kq = tl.dot(kk, tl.trans(qq), kq)
    if not EARLY:
        gg = tl.load(gc + x * HV + i_hv, mask=valid, other=0.0)
    r = tl.arange(0, BT)
    m = (r[None, :] >= r[:, None]) & valid[:, None] & valid[None, :]  # rows j, cols i
    PT = tl.where(m, kq * tl.exp(tl.where(m, gg[None, :] - gg[:, None], 0.0)), 0.0)
    if not EARLY:
        dd = tl.load(do + x[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0)
    dvv = tl.dot(PT.to(dd.dtype), dd) * scale
    tl.store(dvl + x[:, None] * (HV * V) + i_hv * V + cv[None, :], dvv.to(dvl.dtype.element_ty), mask=mv)


@triton.jit(do_not_specialize=["T", "NT", "H", "HV"])
def gdn_state_bwd_kernel(q, k, w, gc, do, dvl, dhe, dvn, dht, dh0, cu, coff, scale, T, NT, H,
                         HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
                         STORE_STEPS: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Reverse pass over chunks: dhe[c] = dL/d(state at chunk c's end); dv_new = dvl + e^(gl−gc)·(k dS);
    dS ← e^gl·dS + qᵀ (scale·e^gc·dO) − wᵀ dv_new; dh0 = dS at the sequence start. Without STORE_STEPS only
    dh0 is written (sequence splitting: a segment's dS contribution from a zero start)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_hv, i_h, bos, Tn, boh = _state_heads(i_nh, cu, coff, T, NT, H, HV, IS_VARLEN)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    mkv = (ck[:, None] < K) & (cv[None, :] < V)
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        dS += tl.load(dht + (i_nh.to(tl.int64) * K + ck[:, None]) * V + cv[None, :], mask=mkv, other=0.0)
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
        tl.store(dh0 + (i_nh.to(tl.int64) * K + ck[:, None]) * V + cv[None, :], dS, mask=mkv)


@triton.jit
def _gva_program(H, HV, GSUM: tl.constexpr):
    """(i_t, i_bh, tile) of a chunk program on the (chunks, B·HV) grid; tile numbers (chunk, batch row, q/k head).
    With GSUM the launch order puts the HV/H value heads of one tile next to each other: they run together, share
    the q / k tiles in L2 and pass their running sum (``_head_arrive``) while it is in L2."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    G = HV // H
    if GSUM:
        lin = i_t + tl.num_programs(0) * i_bh
        rest = lin // G
        i_t = rest % tl.num_programs(0)
        i_bh = (rest // tl.num_programs(0)) * G + lin % G
    return i_t, i_bh, (i_t * tl.num_programs(1) + i_bh) // G


@triton.jit
def _head_arrive(cnt, slot):
    """GVA sums over the G value heads of one q/k head, for one tile (counter ``slot``; ``cnt`` int32, zeroed,
    holds per slot [arrivals, sums passed on]): in the order the heads arrive here (rank n), each adds the fp32
    running sum of the earlier ones and passes the new sum on (``_head_pass`` or ``_head_add``, then
    ``_head_publish``); the last stores the total. Returns the rank n. Before reading the sum, rank n waits
    (``_head_wait``) for the heads that arrived earlier, which are resident and wait only for earlier ones, so this
    cannot deadlock. Deterministic for G <= 2 (a + b is b + a); beyond that the order of the additions follows
    arrival."""
    return tl.atomic_add(cnt + 2 * slot, 1, sem="relaxed")


@triton.jit
def _head_wait(cnt, slot, n):
    """Returns once ranks 0 .. n-1 of ``slot`` have passed their sums on."""
    if n > 0:
        done = tl.atomic_add(cnt + 2 * slot + 1, 0, sem="acquire")
        while done < n:
            done = tl.atomic_add(cnt + 2 * slot + 1, 0, sem="acquire")


@triton.jit
def _head_pass(acc, out, part, o, mask, n, G):
    """Rank n's piece of the running sum (``part``, out's layout, read past L1): branch-free masked loads and
    stores, so that a loop around it stays software-pipelined. The last rank stores the total in out's dtype."""
    nt = o * 0 + n  # the rank as a tile (the interpreter rejects masks combined with the scalar's comparison)
    acc += tl.load(part + o, mask=mask & (nt > 0), other=0.0, cache_modifier=".cg")
    tl.store(part + o, acc, mask=mask & (nt < G - 1))
    tl.store(out + o, acc.to(out.dtype.element_ty), mask=mask & (nt == G - 1))


@triton.jit
def _head_add(acc, out, part, o, mask, cnt, slot, n, G):
    """Rank n's ``_head_pass``, ``_head_publish`` of one tile outside a loop, with branches instead of masks
    (after ``_head_wait``)."""
    if n > 0:
        acc += tl.load(part + o, mask=mask, other=0.0, cache_modifier=".cg")
    if n < G - 1:
        tl.store(part + o, acc, mask=mask)
        _head_publish(cnt, slot, n, G)
    else:
        tl.store(out + o, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _head_publish(cnt, slot, n, G):
    """After every ``_head_pass`` of rank n: the sum is passed on (CTA barrier, then a gpu-scope release)."""
    if n < G - 1:
        tl.debug_barrier()  # every thread's part of the sum is stored before the release
        tl.atomic_xchg(cnt + 2 * slot + 1, n + 1, sem="release")


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
                          USE_H0: tl.constexpr, USE_DHT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Per chunk and value head: dq ([rows, H, K], q's dtype; with GSUM summed over the value heads of each q/k head
    through ``part`` and ``cnt``, see ``_head_arrive``), the state + intra-chunk part of dk (dkp [rows, HV, K]),
    dw = −dv_new·hᵀ, dgc (fp32).
    TRANS_OUT: dk's dPmᵀ·q term as (qᵀ·dPm)ᵀ, a transposed dot result, instead of dPmᵀ from its own dots.
    EARLY: the epilogue's q / k loads are issued before the V loop (their latency then overlaps it; sm_90: the
    tiles wait in shared memory, 32 KB more) instead of after it.
    LATE_WAIT (GSUM): rank 0 passes its dq on before its dk work, the later ranks wait and add after theirs (by
    then the earlier ranks have passed theirs on), instead of every rank passing dq on at its end.
    USE_H0 / USE_DHT: dg's decay term Σ h⊙dh takes the fp32 initial state h0 [N, HV, K, V] for a sequence's first
    chunk and the fp32 dht for its last, not their rounded copies in h / dhe (in a short sequence that term can be
    most of dg, a sum with cancellation)."""
    i_t, i_bh, tile = _gva_program(H, HV, GSUM)
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
        # elementwise here, dk differed between two runs on the H200 (Triton 3.6; wy_bwd's k kᵀ had the same issue)
        os = ((i_ch * HV + i_hv) * K + ck[:, None]) * V + cv[None, :]
        if USE_H0 or USE_DHT:
            on = ((i_n * HV + i_hv) * K + ck[:, None]) * V + cv[None, :]
        if USE_H0:  # masked loads (a branch here would stop the loop's pipelining); ex as a tile for the interpreter
            ex = (on * 0 + first) != 0
            h2 = (tl.load(h + os, mask=mkv & ~ex, other=0.0, cache_modifier=".cg").to(tl.float32)
                  + tl.load(h0 + on, mask=mkv & ex, other=0.0))
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
    # used as a dot operand on Hopper (fla #640, #984); on the GPU it showed as run-to-run differences in dg
    dqq += tl.dot(dPm.to(dt), kk)
    oq = x[:, None] * (H * K) + i_h * K + ck[None, :]
    G = HV // H
    if GSUM and LATE_WAIT:
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
    if GSUM:
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
               BT: tl.constexpr, BK: tl.constexpr, GSUM: tl.constexpr, TRANS_OUT: tl.constexpr):
    """wy_bwd's dk = dkp + beta·e^gc·(Aᵀ dw) + M k + Mᵀ k over BK-wide column blocks (with GSUM rank n's
    ``_head_pass``); returns the dbeta and dg terms of the k path [BT] (fp32)."""
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
        if GSUM:
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
                      IS_VARLEN: tl.constexpr):
    """Through w = Ainv·(beta·e^gc·k), u = Ainv·(beta·v) and Ainv = (I + A)^-1 (du = dv_new): dk = dkp + these
    terms ([rows, H, K], k's dtype; with GSUM summed over the value heads like grad_chunk's dq), dv, dbeta and
    dg = reverse within-chunk cumsum of dgc. TRANS_OUT: the Mᵀ·k term of dk as (kᵀ·M)ᵀ, a transposed dot result
    added to dk, instead of Mᵀ built from its own dots (dTT, dAT); one [BT, BT] accumulator and four dots fewer.
    LATE_WAIT: see the comment at the dk loop."""
    i_t, i_bh, tile = _gva_program(H, HV, GSUM)
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
        # k kᵀ with kᵀ from its own (transposed) load: one loaded tile as both operands of a pipelined wgmma gave
        # run-to-run different KK (dbeta, dg) on the H200 with Triton 3.6
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
    # the dk loop waits for the earlier value heads' running sum once, before it starts (a wait or barrier inside
    # it would stop its software pipelining); with LATE_WAIT rank 0 runs its dk loop first and the later ranks
    # their dv loop first, so that they wait less
    if GSUM:
        n = _head_arrive(cnt, tile)
    else:
        n = 0
    if LATE_WAIT and n == 0:
        dbk, dgk = _wy_bwd_dk(A, M, MT, b, eg, k, dw, dkp, dk, part, x, i_h, i_hv, valid, n, H, HV, K, G, BT, BK,
                              GSUM, TRANS_OUT)
        if GSUM:
            _head_publish(cnt, tile, n, G)
        dbv = _wy_bwd_dv(A, b, v, dvn, dv, x, i_hv, valid, HV, V, BT, BV)
    else:
        dbv = _wy_bwd_dv(A, b, v, dvn, dv, x, i_hv, valid, HV, V, BT, BV)
        if GSUM:
            _head_wait(cnt, tile, n)
        dbk, dgk = _wy_bwd_dk(A, M, MT, b, eg, k, dw, dkp, dk, part, x, i_h, i_hv, valid, n, H, HV, K, G, BT, BK,
                              GSUM, TRANS_OUT)
        if GSUM:
            _head_publish(cnt, tile, n, G)
    db += dbv
    db += dbk
    dgg += dgk
    dgg += dgl
    rev = tl.cumsum(dgg, 0, reverse=True)  # a suffix sum, not total - prefix sum (which cancels at the chunk end)
    tl.store(dg + x * HV + i_hv, rev.to(dg.dtype.element_ty), mask=valid)
    tl.store(dbeta + x * HV + i_hv, db.to(dbeta.dtype.element_ty), mask=valid)
