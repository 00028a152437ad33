"""Stage ``sout`` for Hopper (sm_90) at V blocks of 64 or 128: ``state_out_sm90``'s pass with the chain split
across two warpgroups.

One program per (sequence or segment of a split one, value head, V block of ``BV``), the chunk size 64 and K = 128,
four partitions of four warps each:

* the producer (``state_out_sm90._producer``) fills a ring of ``STAGES`` stages with each chunk's k, q, v block,
  Ainv rows, gates and beta;
* the state warpgroup carries the fp32 state ``S = [S0; S1]`` (``[64, BV]`` each) in registers, publishes it at each
  chunk's start (bf16) and adds the chunk's update ``S ← e^gl·S + kᵀ(e^(gl−gc)·v_new)``;
* the v_new warpgroup forms ``k·S`` from the published state, then ``v_new = Ainv·(beta·(v − e^gc·k S))`` (the
  difference in fp32, rounded once), publishes v_new for the output and its decayed form for the state update,
  and for a chunk with non-finite inputs the row from which each column of o is NaN;
* the output warpgroup (the default partition) forms ``P = q kᵀ ⊙ e^(gc_i−gc_j) ⊙ [i≥j]`` in registers and
  ``o = scale·(e^gc·q S + P·v_new)``, and stores it.

Each warpgroup holds one of the two ``[64, BV]`` fp32 tiles that the single-warpgroup chain of
``state_out_sm90`` holds together, so a V block of 128 fits the register file and a program reads each chunk's k,
q and Ainv for twice (or four times) the value columns. The arithmetic and its roundings are ``state_out_sm90``'s
and ``gdn_state_out_kernel``'s (the portable reference), the output's two products summed in one fp32 accumulator.

Shared buffers past the ring are single: the published state is rewritten only after both its readers released it
(``sd_free``); the decayed v_new shares xs's buffer, which the v_new warpgroup rewrites only after the state
warpgroup's update of that chunk (its next ``k·S`` waits for the next published state); v_new waits for the output
warpgroup to release it (``vn_free``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .state_out_sm90 import _beta_in, _coords, _load_state, _nan_from_first_bad, _producer, _ring, _store_state

__all__ = ["MAXNREG", "compile_sm90_wide", "gdn_state_out_sm90_wide_kernel"]

BT = 64  # chunk size
K = 128  # key head dim: two 64-column slabs
SLAB = 64
PRODUCER_WARPS = 4
PRODUCER_REGS = 56  # registers per thread of each partition (setmaxnreg; 16 warps share 64K)
STATE_REGS = 160
VNEW_REGS = 152
MAXNREG = 128  # register cap of the launch (the output warpgroup, the default partition, runs at 512 - the others)


@gluon.jit
def _state(rt, V: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr, USE_H0: gl.constexpr,
           STORE_HT: gl.constexpr, IS_VARLEN: gl.constexpr, POOL: gl.constexpr, V_FIRST: gl.constexpr,
           BT: gl.constexpr, K: gl.constexpr, SLAB: gl.constexpr, NK: gl.constexpr):
    """The state warpgroup: ``S`` at each chunk's start into ``sd_smem``, then its update; the final state."""
    (q, k, v, beta, gc, Ainv, o, h0, ht, cu, idx, scale, T, P, H, HV, k_smem, q_smem, v_smem, a_smem, g_smem,
     sd_smem, xs_smem, vn_smem, fb_smem, ready, empty, sd_ready, sd_free, vn_ready, vn_free) = rt
    i_v, i_nh, i_hv, i_h, bos, Tn = _coords(cu, T, H, HV, IS_VARLEN)
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 16])
    rows: gl.constexpr = gl.SliceLayout(1, o_l)
    cols: gl.constexpr = gl.SliceLayout(0, o_l)
    r = gl.arange(0, BT, layout=rows)
    cv = i_v * BV + gl.arange(0, BV, layout=cols)
    dt = k.dtype.element_ty
    S0, S1 = _load_state(h0, idx, i_nh, r, cv, gl.zeros([BT, BV], gl.float32, layout=o_l), HV, P, USE_H0, V, POOL,
                         V_FIRST, K, SLAB)
    for c in range(gl.cdiv(Tn, BT)):
        s = c % STAGES
        ph = c & 1
        mbarrier.wait(sd_free, ph ^ 1)  # both readers are done with the previous chunk's state
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        sd_smem.index(0).store(S0.to(dt))
        sd_smem.index(1).store(S1.to(dt))
        # one fence for the stage (written through cp.async, the generic proxy) and the state: wgmma reads the
        # async proxy
        fence_async_shared()
        mbarrier.arrive(sd_ready, count=1)
        el = gl.exp(g_smem.index(s * 3 + 2).load(rows))[:, None]  # the chunk's last gate in every row
        S0 = S0 * el
        S1 = S1 * el
        mbarrier.wait(vn_ready, ph)
        S0 = warpgroup_mma(k_smem.index(s * NK).permute((1, 0)), xs_smem, S0, is_async=True)
        S1 = warpgroup_mma(k_smem.index(s * NK + 1).permute((1, 0)), xs_smem, S1, is_async=True)
        S0, S1 = warpgroup_mma_wait(num_outstanding=0, deps=(S0, S1))
        mbarrier.arrive(empty.index(s), count=1)
    if STORE_HT:
        _store_state(ht, S0, S1, idx, i_nh, r, cv, HV, P, V, POOL, V_FIRST, K, SLAB)


@gluon.jit
def _vnew(rt, V: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr, IS_VARLEN: gl.constexpr,
          BETA_SIGMOID: gl.constexpr, NEG_EIGVAL: gl.constexpr, BT: gl.constexpr, NK: gl.constexpr):
    """The v_new warpgroup: ``v_new = Ainv·(beta·(v − e^gc·k S))`` per chunk (``gdn_state_out_kernel``'s
    arithmetic), into ``vn_smem`` (with the NaN rows into ``fb_smem``) and, decayed, into ``xs_smem``."""
    (q, k, v, beta, gc, Ainv, o, h0, ht, cu, idx, scale, T, P, H, HV, k_smem, q_smem, v_smem, a_smem, g_smem,
     sd_smem, xs_smem, vn_smem, fb_smem, ready, empty, sd_ready, sd_free, vn_ready, vn_free) = rt
    i_v, i_nh, i_hv, i_h, bos, Tn = _coords(cu, T, H, HV, IS_VARLEN)
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 16])
    rows: gl.constexpr = gl.SliceLayout(1, o_l)
    cols: gl.constexpr = gl.SliceLayout(0, o_l)
    r = gl.arange(0, BT, layout=rows)
    dt = k.dtype.element_ty
    dv = v.dtype.element_ty
    zero = gl.zeros([BT, BV], gl.float32, layout=o_l)
    for c in range(gl.cdiv(Tn, BT)):
        s = c % STAGES
        ph = c & 1
        valid = c * BT + r < Tn
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        mbarrier.wait(sd_ready, ph)
        fence_async_shared()  # the stage arrived through cp.async (generic proxy); wgmma reads the async proxy
        ks = warpgroup_mma(k_smem.index(s * NK), sd_smem.index(0), zero, use_acc=False, is_async=True)
        ks = warpgroup_mma(k_smem.index(s * NK + 1), sd_smem.index(1), ks, is_async=True)
        # while k S runs: v, its finiteness and the gate factors (none of them depends on the state)
        gg = g_smem.index(s * 3).load(rows)
        b = _beta_in(g_smem.index(s * 3 + 1).load(rows), valid, BETA_SIGMOID, NEG_EIGVAL)
        glast = g_smem.index(s * 3 + 2).load(rows)
        vv = v_smem.index(s).load(o_l).to(gl.float32)
        eg = gl.exp(gg)
        live = gg == gg
        rdec = gl.exp(gl.where(valid, glast - gg, 0.0))
        ks = warpgroup_mma_wait(num_outstanding=0, deps=(ks,))
        mbarrier.arrive(sd_free, count=1)
        keep = (gl.abs(vv) < float("inf")) & live[:, None]
        xs = b[:, None] * (vv - eg[:, None] * ks)
        xs_smem.store(gl.where(keep, xs, 0.0).to(dt))
        fence_async_shared()
        vn = warpgroup_mma(a_smem.index(s), xs_smem, zero, use_acc=False, is_async=True)
        clean = gl.sum(gl.sum(gl.where(keep, 0, 1), 1), 0) == 0  # (a cross-warp reduction, in Ainv·xs's shadow)
        vn = warpgroup_mma_wait(num_outstanding=0, deps=(vn,))
        if clean:
            vo = vn.to(dv)
            fb = gl.full([BV], BT, gl.int32, layout=cols)
        else:
            okv = gl.abs(v_smem.index(s).load(o_l).to(gl.float32)) < float("inf")
            vn = _nan_from_first_bad(vn, okv, r, BT)
            vnd = vn.to(dv)
            okn = gl.abs(vnd.to(gl.float32)) < float("inf")
            vo = gl.where(okn, vnd, gl.zeros_like(vnd))
            fb = gl.min(gl.where(okn, BT, r[:, None]), 0)
        mbarrier.arrive(empty.index(s), count=1)
        mbarrier.wait(vn_free, ph ^ 1)  # the output warpgroup is done with the previous chunk's v_new
        vn_smem.store(vo)
        fb_smem.store(fb)
        xs_smem.store((vn * rdec[:, None]).to(dt))  # Ainv·xs is complete: xs's buffer is free
        fence_async_shared()
        mbarrier.arrive(vn_ready, count=1)


@gluon.jit
def _output(rt, V: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr, IS_VARLEN: gl.constexpr, BT: gl.constexpr,
            NK: gl.constexpr):
    """The output warpgroup: ``P = q kᵀ ⊙ e^(gc_i−gc_j) ⊙ [i≥j]`` and ``o = scale·(e^gc·q S + P·v_new)`` per chunk,
    NaN where the v_new warpgroup says."""
    (q, k, v, beta, gc, Ainv, o, h0, ht, cu, idx, scale, T, P, H, HV, k_smem, q_smem, v_smem, a_smem, g_smem,
     sd_smem, xs_smem, vn_smem, fb_smem, ready, empty, sd_ready, sd_free, vn_ready, vn_free) = rt
    i_v, i_nh, i_hv, i_h, bos, Tn = _coords(cu, T, H, HV, IS_VARLEN)
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 16])
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    # o is stored from a layout of 16-byte row pieces (few column addresses per thread)
    st_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BV // 8), BV // 8], [4, 1], [1, 0])
    r = gl.arange(0, BT, layout=gl.SliceLayout(1, o_l))
    rs = gl.arange(0, BT, layout=gl.SliceLayout(1, st_l))
    cv = i_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, st_l))
    ri = gl.arange(0, BT, layout=gl.SliceLayout(1, s_l))
    rj = gl.arange(0, BT, layout=gl.SliceLayout(0, s_l))
    zero = gl.zeros([BT, BV], gl.float32, layout=o_l)
    zs = gl.zeros([BT, BT], gl.float32, layout=s_l)
    dv = v.dtype.element_ty
    op = o + i_hv * V + cv[None, :]
    ob = gl.zeros([BT, BV], o.dtype.element_ty, layout=st_l)  # the previous chunk's o, rows tb
    tb = Tn + rs
    for c in range(gl.cdiv(Tn, BT)):
        s = c % STAGES
        ph = c & 1
        t0 = c * BT
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        fence_async_shared()
        # the previous chunk's o is stored after the fence: the fence waits for every store in flight
        gl.store(op + ((bos + tb) * (HV * V))[:, None], ob, mask=(tb < Tn)[:, None])
        qk = warpgroup_mma(q_smem.index(s * NK), k_smem.index(s * NK).permute((1, 0)), zs, use_acc=False,
                           is_async=True)
        qk = warpgroup_mma(q_smem.index(s * NK + 1), k_smem.index(s * NK + 1).permute((1, 0)), qk, is_async=True)
        gi = g_smem.index(s * 3).load(gl.SliceLayout(1, s_l))
        gj = g_smem.index(s * 3).load(gl.SliceLayout(0, s_l))
        go = g_smem.index(s * 3).load(gl.SliceLayout(1, o_l))
        mbarrier.wait(sd_ready, ph)
        qs = warpgroup_mma(q_smem.index(s * NK), sd_smem.index(0), zero, use_acc=False, is_async=True)
        qs = warpgroup_mma(q_smem.index(s * NK + 1), sd_smem.index(1), qs, is_async=True)
        qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk,))
        m = (ri[:, None] >= rj[None, :]) & (t0 + ri < Tn)[:, None] & (t0 + rj < Tn)[None, :]
        # (a masked-off entry's factor may overflow: the select drops it)
        pm = gl.where(m, qk * gl.exp(gi[:, None] - gj[None, :]), 0.0).to(dv)
        p_op = gl.convert_layout(pm, p_l)
        qs = warpgroup_mma_wait(num_outstanding=0, deps=(qs,))
        mbarrier.arrive(sd_free, count=1)
        mbarrier.arrive(empty.index(s), count=1)
        oi = qs * gl.exp(go)[:, None]
        mbarrier.wait(vn_ready, ph)
        acc = warpgroup_mma(p_op, vn_smem, oi, is_async=True)
        fb = fb_smem.load(gl.SliceLayout(0, o_l))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(vn_free, count=1)
        ob = gl.where(r[:, None] >= fb[None, :], float("nan"), acc * scale).to(o.dtype.element_ty)
        ob = gl.convert_layout(ob, st_l)
        tb = t0 + rs
    gl.store(op + ((bos + tb) * (HV * V))[:, None], ob, mask=(tb < Tn)[:, None])


@gluon.jit(do_not_specialize=["T", "P", "H", "HV"])
def gdn_state_out_sm90_wide_kernel(q, k, v, beta, gc, Ainv, o, h0, ht, cu, idx, scale, T, P, H, HV,
                                   V: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr, USE_H0: gl.constexpr,
                                   STORE_HT: gl.constexpr, IS_VARLEN: gl.constexpr, POOL: gl.constexpr,
                                   V_FIRST: gl.constexpr, BETA_SIGMOID: gl.constexpr, NEG_EIGVAL: gl.constexpr,
                                   BT: gl.constexpr = BT, K: gl.constexpr = K, SLAB: gl.constexpr = SLAB,
                                   PRODUCER_WARPS: gl.constexpr = PRODUCER_WARPS,
                                   PRODUCER_REGS: gl.constexpr = PRODUCER_REGS,
                                   STATE_REGS: gl.constexpr = STATE_REGS, VNEW_REGS: gl.constexpr = VNEW_REGS):
    """``gdn_state_out_sm90_kernel``'s arguments and grid ``(V // BV, programs x HV)``, BV 64 or 128. The
    parameters after NEG_EIGVAL are the kernel's constants: leave them at their defaults."""
    NK: gl.constexpr = K // SLAB  # slabs of K
    dt: gl.constexpr = k.dtype.element_ty
    dv: gl.constexpr = v.dtype.element_ty
    sw: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    # (the state, v_new and output warpgroups consume each stage)
    k_smem, q_smem, a_smem, v_smem, g_smem, ready, empty = _ring(dt, dv, sw, STAGES, BT, BV, SLAB, NK, PRODUCER_WARPS, 3)
    sd_smem = gl.allocate_shared_memory(dt, [NK, SLAB, BV], sw)  # the chunk's start state
    vn_smem = gl.allocate_shared_memory(dv, [BT, BV], sw)  # v_new
    # xs, then (when Ainv·xs is done) the decayed v_new of the state update
    xs_smem = gl.allocate_shared_memory(dt, [BT, BV], sw)
    # the row from which each column of o is NaN (BT: none)
    fb_smem = gl.allocate_shared_memory(gl.int32, [BV], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    sd_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    sd_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    vn_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    vn_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(sd_ready, count=1)
    mbarrier.init(sd_free, count=2)  # the v_new and output warpgroups
    mbarrier.init(vn_ready, count=1)
    mbarrier.init(vn_free, count=1)
    rt = (q, k, v, beta, gc, Ainv, o, h0, ht, cu, idx, scale, T, P, H, HV, k_smem, q_smem, v_smem, a_smem, g_smem,
          sd_smem, xs_smem, vn_smem, fb_smem, ready, empty, sd_ready, sd_free, vn_ready, vn_free)
    gl.warp_specialize([
        (_output, (rt, V, BV, STAGES, IS_VARLEN, BT, NK)),
        (_state, (rt, V, BV, STAGES, USE_H0, STORE_HT, IS_VARLEN, POOL, V_FIRST, BT, K, SLAB, NK)),
        (_vnew, (rt, V, BV, STAGES, IS_VARLEN, BETA_SIGMOID, NEG_EIGVAL, BT, NK)),
        (_producer, ((q, k, v, beta, gc, Ainv, cu, T, H, HV, k_smem, q_smem, v_smem, a_smem, g_smem, ready, empty),
                     V, BV, STAGES, IS_VARLEN, BT, K, SLAB, NK, PRODUCER_WARPS)),
    ], [4, 4, PRODUCER_WARPS], [STATE_REGS, VNEW_REGS, PRODUCER_REGS])


def compile_sm90_wide(*, bv: int = 128, stages: int = 2, **flags):
    """Compile the kernel for sm_90 without a GPU (``state_out_sm90.compile_sm90``'s keywords)."""
    from .state_out_sm90 import compile_sm90

    return compile_sm90(bv=bv, stages=stages, kernel=gdn_state_out_sm90_wide_kernel, maxnreg=MAXNREG, **flags)
