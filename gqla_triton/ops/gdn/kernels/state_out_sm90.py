"""Stage ``sout`` for Hopper (sm_90): ``gdn_state_out_kernel``'s pass as a warp-specialised Gluon kernel.

One program per (sequence or segment of a split one, value head, V block of ``BV``), the chunk size 64 and K = 128
(two 64-column slabs), four partitions of four warps each:

* the producer copies each chunk's k, q (two slabs each), its v block, Ainv rows, gates and beta into a ring of
  ``STAGES`` shared-memory stages with ``cp.async`` (rows past the sequence end zero-filled; beta through its
  registers, as fp32);
* the chain carries the fp32 state ``S = [S0; S1]`` (K rows 0-63 and 64-127, ``[64, BV]`` each) in registers and
  runs the dependent products of each chunk: ``k·S``, then ``v_new = Ainv·(beta·(v − e^gc·k S))``, then
  ``S ← e^gl·S + kᵀ(e^(gl−gc)·v_new)``; it publishes the chunk's start state and v_new (bf16, two buffers each)
  and, for a chunk with non-finite inputs, the row from which each column of o is NaN;
* the scores partition forms ``P = q kᵀ ⊙ e^(gc_i−gc_j) ⊙ [i≥j]`` of each chunk (two buffers);
* the output partition (the default one) adds ``o = scale·(e^gc·q S + P·v_new)`` and stores it.

Only the chain's three products per chunk are sequential; the scores and the output of a chunk overlap the chain's
next one. No consumer loads from global memory inside its loop: the proxy fence before each product that reads
shared memory written by threads (``fence_async_shared``, a ``MEMBAR`` in SASS) waits for every load and store the
thread has in flight, so a gate loaded ahead from global memory would be waited for at the next fence. The output
partition stores each chunk's o after the next chunk's fence for the same reason, and the chain fences once per
chunk for both the stage it waited for and the state it stores.

The arithmetic and its roundings are ``gdn_state_out_kernel``'s (the difference in fp32, rounded once; the same
non-finite placement), so the portable kernel, which serves other GPUs, shapes and the interpreter, is its reference
as well as the float64 recurrence.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..._common.gluon import async_load

__all__ = ["BT", "K", "MAXNREG", "compile_sm90", "gdn_state_out_sm90_kernel"]

# the kernel's constants: the defaults of its trailing constexpr parameters (so Triton's cache key holds them)
BT = 64  # chunk size
K = 128  # key head dim: two 64-column slabs
SLAB = 64
PRODUCER_WARPS = 4
PRODUCER_REGS = 56  # registers per thread of each partition (setmaxnreg; 16 warps share 64K)
CHAIN_REGS = 168
SCORES_REGS = 152
MAXNREG = 128  # register cap of the launch: the output warpgroup's (the default partition)


@gluon.jit
def _coords(cu, T, H, HV, IS_VARLEN: gl.constexpr):
    """(V block, sequence x value head, value head, q/k head, first row int64, length) of this program."""
    i_v = gl.program_id(0)
    i_nh = gl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    if IS_VARLEN:
        bos = gl.load(cu + i_n).to(gl.int64)
        Tn = (gl.load(cu + i_n + 1).to(gl.int64) - bos).to(gl.int32)
    else:
        bos = i_n.to(gl.int64) * T
        Tn = T
    return i_v, i_nh, i_hv, i_hv // (HV // H), bos, Tn


@gluon.jit
def _state_rows(idx, i_nh, r, cv, HV, P, V: gl.constexpr, POOL: gl.constexpr, V_FIRST: gl.constexpr,
                K: gl.constexpr):
    """Element offsets (int64) of state slice (K rows ``r``, V columns ``cv``) of sequence x value head i_nh and its
    mask: row i_nh of ``[N, HV, K, V]`` (``[.., V, K]`` with V_FIRST), or with POOL row ``idx[i_nh // HV]`` of the
    pool, masked off entirely where that row is outside [0, P) (as ``common._h_row``)."""
    if POOL:
        pr = gl.load(idx + i_nh // HV).to(gl.int64)
        live = (pr >= 0) & (pr < P)
        row = gl.where(live, pr, 0) * HV + i_nh % HV
        mask = (r[:, None] < K) & (cv[None, :] < gl.where(live, V, 0))
    else:
        row = i_nh.to(gl.int64)
        mask = (r[:, None] < K) & (cv[None, :] < V)
    if V_FIRST:
        off = (row * V + cv[None, :]) * K + r[:, None]
    else:
        off = (row * K + r[:, None]) * V + cv[None, :]
    return off, mask


@gluon.jit
def _load_state(h0, idx, i_nh, r, cv, zero, HV, P, USE_H0: gl.constexpr, V: gl.constexpr, POOL: gl.constexpr,
                V_FIRST: gl.constexpr, K: gl.constexpr, SLAB: gl.constexpr):
    """The start state's two fp32 slabs (K rows ``r`` and ``r + SLAB``, V columns ``cv``; ``zero``'s layout) of
    sequence x value head ``i_nh`` from ``h0`` (``_state_rows``), or zeros without USE_H0."""
    S0 = zero
    S1 = zero
    if USE_H0:
        off, m = _state_rows(idx, i_nh, r, cv, HV, P, V, POOL, V_FIRST, K)
        S0 = gl.load(h0 + off, mask=m, other=0.0).to(gl.float32)
        off, m = _state_rows(idx, i_nh, r + SLAB, cv, HV, P, V, POOL, V_FIRST, K)
        S1 = gl.load(h0 + off, mask=m, other=0.0).to(gl.float32)
    return S0, S1


@gluon.jit
def _store_state(ht, S0, S1, idx, i_nh, r, cv, HV, P, V: gl.constexpr, POOL: gl.constexpr, V_FIRST: gl.constexpr,
                 K: gl.constexpr, SLAB: gl.constexpr):
    """The final state's two slabs into ``ht`` (``_load_state``'s rows, in ht's dtype)."""
    off, m = _state_rows(idx, i_nh, r, cv, HV, P, V, POOL, V_FIRST, K)
    gl.store(ht + off, S0.to(ht.dtype.element_ty), mask=m)
    off, m = _state_rows(idx, i_nh, r + SLAB, cv, HV, P, V, POOL, V_FIRST, K)
    gl.store(ht + off, S1.to(ht.dtype.element_ty), mask=m)


@gluon.jit
def _beta_in(b, mask, BETA_SIGMOID: gl.constexpr, NEG_EIGVAL: gl.constexpr):
    """beta as the recurrence takes it (``common._beta_in``)."""
    if BETA_SIGMOID:
        b = gl.where(mask, 1.0 / (1.0 + gl.exp(-b)), 0.0)
    if NEG_EIGVAL:
        b = b * 2.0
    return b


@gluon.jit
def _nan_from_first_bad(x, ok, r, BT: gl.constexpr):
    """x with each column NaN from its first row where ok is False on (``common._nan_from_first_bad``)."""
    first = gl.min(gl.where(ok, BT, r[:, None]), 0)
    return gl.where(r[:, None] >= first[None, :], float("nan"), x)


@gluon.jit
def _ring(dt: gl.constexpr, dv: gl.constexpr, v_layout: gl.constexpr, STAGES: gl.constexpr, BT: gl.constexpr,
          BV: gl.constexpr, SLAB: gl.constexpr, NK: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
          CONSUMERS: gl.constexpr):
    """The ring ``_producer`` fills: per stage k and q (``NK`` slabs of ``[BT, SLAB]``), Ainv rows, the v block
    (``v_layout``) and the chunk's gates, beta and last gate (fp32), with its ``ready`` barriers (one cp.async arrival
    per producer thread and one after the producer's stores) and ``empty`` ones (one arrival per consumer
    warpgroup)."""
    sw: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    k_smem = gl.allocate_shared_memory(dt, [STAGES * NK, BT, SLAB], sw)
    q_smem = gl.allocate_shared_memory(dt, [STAGES * NK, BT, SLAB], sw)
    a_smem = gl.allocate_shared_memory(dt, [STAGES, BT, BT], sw)
    v_smem = gl.allocate_shared_memory(dv, [STAGES, BT, BV], v_layout)
    g_smem = gl.allocate_shared_memory(gl.float32, [STAGES * 3, BT], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=PRODUCER_WARPS * 32 + 1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    return k_smem, q_smem, a_smem, v_smem, g_smem, ready, empty


@gluon.jit
def _producer(ring, V: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr, IS_VARLEN: gl.constexpr,
              BT: gl.constexpr, K: gl.constexpr, SLAB: gl.constexpr, NK: gl.constexpr,
              PRODUCER_WARPS: gl.constexpr):
    """The producer: each chunk's k, q, v block, Ainv rows, gates, last gate and beta (fp32) into ring stage
    ``c % STAGES``. ``ring``: ``(q, k, v, beta, gc, Ainv, cu, T, H, HV, k_smem, q_smem, v_smem, a_smem, g_smem,
    ready, empty)``."""
    q, k, v, beta, gc, Ainv, cu, T, H, HV, k_smem, q_smem, v_smem, a_smem, g_smem, ready, empty = ring
    i_v, i_nh, i_hv, i_h, bos, Tn = _coords(cu, T, H, HV, IS_VARLEN)
    cp: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS, 1], [1, 0])
    TPV: gl.constexpr = BV // 8  # threads along a v row (16-byte copies)
    cpv: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPV, TPV], [PRODUCER_WARPS, 1], [1, 0])
    r = gl.arange(0, BT, layout=gl.SliceLayout(1, cp))
    cc = gl.arange(0, SLAB, layout=gl.SliceLayout(0, cp))
    rv = gl.arange(0, BT, layout=gl.SliceLayout(1, cpv))
    cv = i_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, cpv))
    rg = gl.arange(0, BT, layout=gl.BlockedLayout([1], [32], [PRODUCER_WARPS], [0]))
    # element offsets within a chunk (int32, the same for every chunk: the launch keeps them below 2^31) from
    # base pointers per chunk, so the loop holds no 64-bit address per row
    okq = r[:, None] * (H * K) + cc[None, :]
    oa = r[:, None] * (HV * BT) + cc[None, :]
    ov = rv[:, None] * (HV * V) + cv[None, :]
    og = rg * HV
    for c in range(gl.cdiv(Tn, BT)):
        s = c % STAGES
        x0 = bos + c * BT  # the chunk's first row
        nv = Tn - c * BT  # rows from there to the sequence's end
        gb = x0 * HV + i_hv
        bx = gl.load(beta + gb + og, mask=rg < nv, other=0.0)  # before the wait, which hides its latency
        mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
        # the chunk's gates, and its last gate in every row
        async_load(g_smem.index(s * 3), gc + gb + og, mask=rg < nv)
        async_load(g_smem.index(s * 3 + 2), gc + (gb + (gl.minimum(nv, BT) - 1) * HV) + rg * 0)
        ok = (r < nv)[:, None]
        kb = x0 * (H * K) + i_h * K
        for j in gl.static_range(NK):
            async_load(k_smem.index(s * NK + j), k + kb + (okq + j * SLAB), mask=ok)
            async_load(q_smem.index(s * NK + j), q + kb + (okq + j * SLAB), mask=ok)
        async_load(a_smem.index(s), Ainv + gb * BT + oa, mask=ok)
        async_load(v_smem.index(s), v + (x0 * (HV * V) + i_hv * V) + ov, mask=(rv < nv)[:, None])
        g_smem.index(s * 3 + 1).store(bx.to(gl.float32))
        async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
        mbarrier.arrive(ready.index(s), count=1)  # after beta's store (the arrival releases it)


@gluon.jit
def _chain(rt, V: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr, USE_H0: gl.constexpr,
           STORE_HT: gl.constexpr, IS_VARLEN: gl.constexpr, POOL: gl.constexpr, V_FIRST: gl.constexpr,
           BETA_SIGMOID: gl.constexpr, NEG_EIGVAL: gl.constexpr, BT: gl.constexpr, K: gl.constexpr,
           SLAB: gl.constexpr, NK: gl.constexpr):
    """The chain: the state recurrence, v_new and the final state (``gdn_state_out_kernel``'s arithmetic)."""
    (q, k, v, beta, gc, Ainv, o, h0, ht, cu, idx, scale, T, P, H, HV, k_smem, q_smem, v_smem, a_smem, g_smem,
     sd_smem, xs_smem, vn_smem, fb_smem, p_smem, ready, empty, sd_ready, vn_ready, ofree, p_ready, p_free) = rt
    i_v, i_nh, i_hv, i_h, bos, Tn = _coords(cu, T, H, HV, IS_VARLEN)
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 16])
    rows: gl.constexpr = gl.SliceLayout(1, o_l)
    cols: gl.constexpr = gl.SliceLayout(0, o_l)
    r = gl.arange(0, BT, layout=rows)
    cv = i_v * BV + gl.arange(0, BV, layout=cols)
    dt = k.dtype.element_ty
    dv = v.dtype.element_ty
    zero = gl.zeros([BT, BV], gl.float32, layout=o_l)
    S0, S1 = _load_state(h0, idx, i_nh, r, cv, zero, HV, P, USE_H0, V, POOL, V_FIRST, K, SLAB)
    for c in range(gl.cdiv(Tn, BT)):
        s = c % STAGES
        b2 = c % 2
        valid = c * BT + r < Tn

        # publish the state at the chunk's start (the output warpgroup reads it for q S)
        mbarrier.wait(ofree.index(b2), ((c // 2) & 1) ^ 1)
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        sd_smem.index(b2 * NK).store(S0.to(dt))
        sd_smem.index(b2 * NK + 1).store(S1.to(dt))
        # one fence for both the stage (written through cp.async, the generic proxy) and the state: wgmma reads
        # the async proxy
        fence_async_shared()
        mbarrier.arrive(sd_ready.index(b2), count=1)
        ks = warpgroup_mma(k_smem.index(s * NK), sd_smem.index(b2 * NK), zero, use_acc=False, is_async=True)
        ks = warpgroup_mma(k_smem.index(s * NK + 1), sd_smem.index(b2 * NK + 1), ks, is_async=True)
        # while k S runs: v, its finiteness and the gate factors (none of them depends on the state)
        gg = g_smem.index(s * 3).load(rows)
        b = _beta_in(g_smem.index(s * 3 + 1).load(rows), valid, BETA_SIGMOID, NEG_EIGVAL)
        glast = g_smem.index(s * 3 + 2).load(rows)  # the chunk's last gate in every row
        vv = v_smem.index(s).load(o_l).to(gl.float32)
        eg = gl.exp(gg)
        okv = gl.abs(vv) < float("inf")
        live = gg == gg
        keep = okv & live[:, None]
        rdec = gl.exp(gl.where(valid, glast - gg, 0.0))
        el = gl.exp(glast)[:, None]
        ks = warpgroup_mma_wait(num_outstanding=0, deps=(ks,))
        xs = b[:, None] * (vv - eg[:, None] * ks)
        xs_smem.store(gl.where(keep, xs, 0.0).to(dt))
        fence_async_shared()
        vn = warpgroup_mma(a_smem.index(s), xs_smem, zero, use_acc=False, is_async=True)
        clean = gl.sum(gl.sum(gl.where(keep, 0, 1), 1), 0) == 0  # (a cross-warp reduction, in Ainv·xs's shadow)
        vn = warpgroup_mma_wait(num_outstanding=0, deps=(vn,))
        # what the output multiplies: v_new, or in a chunk with non-finite inputs its finite entries, and the row
        # from which each column of o is NaN (BT: none)
        if clean:
            vo = vn.to(dv)
            fb = gl.full([BV], BT, gl.int32, layout=cols)
        else:
            vn = _nan_from_first_bad(vn, okv, r, BT)
            vnd = vn.to(dv)
            okn = gl.abs(vnd.to(gl.float32)) < float("inf")
            vo = gl.where(okn, vnd, gl.zeros_like(vnd))
            fb = gl.min(gl.where(okn, BT, r[:, None]), 0)
        vn_smem.index(b2).store(vo)
        fb_smem.index(b2).store(fb)
        vd = vn * rdec[:, None]
        xs_smem.store(vd.to(dt))  # Ainv·xs is complete: xs's buffer is free
        fence_async_shared()
        mbarrier.arrive(vn_ready.index(b2), count=1)
        S0 = warpgroup_mma(k_smem.index(s * NK).permute((1, 0)), xs_smem, S0 * el, is_async=True)
        S1 = warpgroup_mma(k_smem.index(s * NK + 1).permute((1, 0)), xs_smem, S1 * el, is_async=True)
        S0, S1 = warpgroup_mma_wait(num_outstanding=0, deps=(S0, S1))
        mbarrier.arrive(empty.index(s), count=1)
    if STORE_HT:
        _store_state(ht, S0, S1, idx, i_nh, r, cv, HV, P, V, POOL, V_FIRST, K, SLAB)


@gluon.jit
def _scores(rt, V: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr, IS_VARLEN: gl.constexpr, BT: gl.constexpr,
            NK: gl.constexpr):
    """The scores warpgroup: each chunk's ``P = q kᵀ ⊙ e^(gc_i−gc_j) ⊙ [i≥j]`` (v's dtype) into ``p_smem``."""
    (q, k, v, beta, gc, Ainv, o, h0, ht, cu, idx, scale, T, P, H, HV, k_smem, q_smem, v_smem, a_smem, g_smem,
     sd_smem, xs_smem, vn_smem, fb_smem, p_smem, ready, empty, sd_ready, vn_ready, ofree, p_ready, p_free) = rt
    i_v, i_nh, i_hv, i_h, bos, Tn = _coords(cu, T, H, HV, IS_VARLEN)
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
    ri = gl.arange(0, BT, layout=gl.SliceLayout(1, s_l))
    rj = gl.arange(0, BT, layout=gl.SliceLayout(0, s_l))
    zs = gl.zeros([BT, BT], gl.float32, layout=s_l)
    for c in range(gl.cdiv(Tn, BT)):
        s = c % STAGES
        b2 = c % 2
        t0 = c * BT
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        fence_async_shared()  # the stage arrived through cp.async (generic proxy); wgmma reads the async proxy
        qk = warpgroup_mma(q_smem.index(s * NK), k_smem.index(s * NK).permute((1, 0)), zs, use_acc=False,
                           is_async=True)
        qk = warpgroup_mma(q_smem.index(s * NK + 1), k_smem.index(s * NK + 1).permute((1, 0)), qk, is_async=True)
        gi = g_smem.index(s * 3).load(gl.SliceLayout(1, s_l))
        gj = g_smem.index(s * 3).load(gl.SliceLayout(0, s_l))
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
        mbarrier.arrive(empty.index(s), count=1)
        m = (ri[:, None] >= rj[None, :]) & (t0 + ri < Tn)[:, None] & (t0 + rj < Tn)[None, :]
        pm = gl.where(m, qk * gl.exp(gl.where(m, gi[:, None] - gj[None, :], 0.0)), 0.0).to(v.dtype.element_ty)
        mbarrier.wait(p_free.index(b2), ((c // 2) & 1) ^ 1)
        p_smem.index(b2).store(pm)
        fence_async_shared()  # P was written by the generic proxy; the output warpgroup's wgmma reads it
        mbarrier.arrive(p_ready.index(b2), count=1)


@gluon.jit
def _output(rt, V: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr, IS_VARLEN: gl.constexpr, BT: gl.constexpr,
            NK: gl.constexpr):
    """The output warpgroup: ``o = scale·(e^gc·q S + P·v_new)`` per chunk, NaN where the chain says."""
    (q, k, v, beta, gc, Ainv, o, h0, ht, cu, idx, scale, T, P, H, HV, k_smem, q_smem, v_smem, a_smem, g_smem,
     sd_smem, xs_smem, vn_smem, fb_smem, p_smem, ready, empty, sd_ready, vn_ready, ofree, p_ready, p_free) = rt
    i_v, i_nh, i_hv, i_h, bos, Tn = _coords(cu, T, H, HV, IS_VARLEN)
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 16])
    r = gl.arange(0, BT, layout=gl.SliceLayout(1, o_l))
    cv = i_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, o_l))
    zero = gl.zeros([BT, BV], gl.float32, layout=o_l)
    op = o + i_hv * V + cv[None, :]
    ob = gl.zeros([BT, BV], o.dtype.element_ty, layout=o_l)  # the previous chunk's o, rows tb
    tb = Tn + r
    for c in range(gl.cdiv(Tn, BT)):
        s = c % STAGES
        b2 = c % 2
        t0 = c * BT
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        fence_async_shared()
        # the previous chunk's o is stored after the fence: the fence waits for every store in flight
        gl.store(op + ((bos + tb) * (HV * V))[:, None], ob, mask=(tb < Tn)[:, None])
        mbarrier.wait(sd_ready.index(b2), (c // 2) & 1)
        qs = warpgroup_mma(q_smem.index(s * NK), sd_smem.index(b2 * NK), zero, use_acc=False, is_async=True)
        qs = warpgroup_mma(q_smem.index(s * NK + 1), sd_smem.index(b2 * NK + 1), qs, is_async=True)
        go = g_smem.index(s * 3).load(gl.SliceLayout(1, o_l))
        qs = warpgroup_mma_wait(num_outstanding=0, deps=(qs,))
        mbarrier.arrive(empty.index(s), count=1)
        oi = qs * gl.exp(go)[:, None]
        mbarrier.wait(p_ready.index(b2), (c // 2) & 1)
        mbarrier.wait(vn_ready.index(b2), (c // 2) & 1)
        pv = warpgroup_mma(p_smem.index(b2), vn_smem.index(b2), zero, use_acc=False, is_async=True)
        pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
        fb = fb_smem.index(b2).load(gl.SliceLayout(0, o_l))
        mbarrier.arrive(p_free.index(b2), count=1)
        mbarrier.arrive(ofree.index(b2), count=1)
        ob = gl.where(r[:, None] >= fb[None, :], float("nan"), (oi + pv) * scale).to(o.dtype.element_ty)
        tb = t0 + r
    gl.store(op + ((bos + tb) * (HV * V))[:, None], ob, mask=(tb < Tn)[:, None])


@gluon.jit(do_not_specialize=["T", "P", "H", "HV"])
def gdn_state_out_sm90_kernel(q, k, v, beta, gc, Ainv, o, h0, ht, cu, idx, scale, T, P, H, HV,
                              V: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr, USE_H0: gl.constexpr,
                              STORE_HT: gl.constexpr, IS_VARLEN: gl.constexpr, POOL: gl.constexpr,
                              V_FIRST: gl.constexpr, BETA_SIGMOID: gl.constexpr, NEG_EIGVAL: gl.constexpr,
                              BT: gl.constexpr = BT, K: gl.constexpr = K, SLAB: gl.constexpr = SLAB,
                              PRODUCER_WARPS: gl.constexpr = PRODUCER_WARPS,
                              PRODUCER_REGS: gl.constexpr = PRODUCER_REGS, CHAIN_REGS: gl.constexpr = CHAIN_REGS,
                              SCORES_REGS: gl.constexpr = SCORES_REGS):
    """``gdn_state_out_kernel`` (same arguments without coff / NT / the tile widths; K = 128, chunk 64, bf16 k and
    Ainv) for sm_90, grid ``(V // BV, programs x HV)``. The parameters after NEG_EIGVAL are the kernel's constants:
    leave them at their defaults."""
    NK: gl.constexpr = K // SLAB  # slabs of K
    dt: gl.constexpr = k.dtype.element_ty
    dv: gl.constexpr = v.dtype.element_ty
    sw: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    swv: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * BV if BV < 64 else 128, element_bitwidth=16,
                                             rank=2)
    # (the scores, chain and output warpgroups consume each stage)
    k_smem, q_smem, a_smem, v_smem, g_smem, ready, empty = _ring(dt, dv, swv, STAGES, BT, BV, SLAB, NK, PRODUCER_WARPS,
                                                                 3)
    sd_smem = gl.allocate_shared_memory(dt, [2 * NK, SLAB, BV], swv)  # the chunk's start state, two buffers
    vn_smem = gl.allocate_shared_memory(dv, [2, BT, BV], swv)  # v_new, two buffers
    # xs, then (when Ainv·xs is done) the decayed v_new of the state update
    xs_smem = gl.allocate_shared_memory(dt, [BT, BV], swv)
    # per buffer, the row from which each column of o is NaN (BT: none)
    fb_smem = gl.allocate_shared_memory(gl.int32, [2, BV], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    p_smem = gl.allocate_shared_memory(dv, [2, BT, BT], sw)  # the chunk's P, two buffers
    sd_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    vn_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ofree = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(sd_ready.index(i), count=1)
        mbarrier.init(vn_ready.index(i), count=1)
        mbarrier.init(ofree.index(i), count=1)
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(p_free.index(i), count=1)
    rt = (q, k, v, beta, gc, Ainv, o, h0, ht, cu, idx, scale, T, P, H, HV, k_smem, q_smem, v_smem, a_smem, g_smem,
          sd_smem, xs_smem, vn_smem, fb_smem, p_smem, ready, empty, sd_ready, vn_ready, ofree, p_ready, p_free)
    gl.warp_specialize([
        (_output, (rt, V, BV, STAGES, IS_VARLEN, BT, NK)),
        (_chain, (rt, V, BV, STAGES, USE_H0, STORE_HT, IS_VARLEN, POOL, V_FIRST, BETA_SIGMOID, NEG_EIGVAL, BT, K, SLAB,
                  NK)),
        (_scores, (rt, V, BV, STAGES, IS_VARLEN, BT, NK)),
        (_producer, ((q, k, v, beta, gc, Ainv, cu, T, H, HV, k_smem, q_smem, v_smem, a_smem, g_smem, ready, empty),
                     V, BV, STAGES, IS_VARLEN, BT, K, SLAB, NK, PRODUCER_WARPS)),
    ], [4, 4, PRODUCER_WARPS], [CHAIN_REGS, SCORES_REGS, PRODUCER_REGS])


def compile_sm90(*, bv: int = 32, stages: int = 2, dtype: str = "bf16", use_h0: bool = True, store_ht: bool = True,
                 varlen: bool = False, pool: bool = False, v_first: bool = False, beta_sigmoid: bool = False,
                 neg_eigval: bool = False, V: int = 128, kernel=None, maxnreg: int = MAXNREG,
                 constants: dict | None = None):
    """Compile the kernel (or ``kernel``, one of the same arguments) for sm_90 without a GPU (``triton.compile``;
    returns the compiled kernel: ``.asm``, ``.metadata``), ``constants`` in place of the kernel's own. Pointers are
    taken 16-byte aligned, as the launch specialises them."""
    import inspect

    from triton import compile as tcompile
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = kernel or gdn_state_out_sm90_kernel
    params = inspect.signature(fn.fn).parameters
    names = list(params)
    const = {n: p.default for n, p in params.items() if p.default is not p.empty}  # the kernel's constants
    const.update(V=V, BV=bv, STAGES=stages, USE_H0=use_h0, STORE_HT=store_ht, IS_VARLEN=varlen, POOL=pool,
                 V_FIRST=v_first, BETA_SIGMOID=beta_sigmoid, NEG_EIGVAL=neg_eigval, **(constants or {}))
    ptr = {"q": f"*{dtype}", "k": f"*{dtype}", "v": f"*{dtype}", "beta": f"*{dtype}", "gc": "*fp32",
           "Ainv": f"*{dtype}", "o": f"*{dtype}", "h0": "*fp32", "ht": "*fp32", "cu": "*i64", "idx": "*i32"}
    sig = {n: "constexpr" if n in const else ptr.get(n, "fp32" if n == "scale" else "i32") for n in names}
    src = GluonASTSource(fn, sig, constexprs={(names.index(n),): v for n, v in const.items()},
                         attrs={(names.index(n),): [["tt.divisibility", 16]] for n in names if n in ptr})
    return tcompile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=maxnreg))
