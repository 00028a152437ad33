"""What ``compute-sanitizer --tool racecheck`` reports for Triton's warp specialisation alone, without our kernels:

    compute-sanitizer --tool racecheck python -m tools.racecheck_ws --default-writes none   # 0 hazards
    compute-sanitizer --tool racecheck python -m tools.racecheck_ws --default-writes smem   # 1 hazard
    compute-sanitizer --tool racecheck python -m tools.racecheck_ws --default-writes mbarrier
    compute-sanitizer --tool racecheck python -m tools.racecheck_ws --default-writes exchange
    compute-sanitizer --tool racecheck python -m tools.racecheck_ws --hand-over pingpong   # the MLA hand-overs
    compute-sanitizer --tool racecheck python -m tools.racecheck_ws --tile vec --steps 8    # one tile hand-over
    compute-sanitizer --tool racecheck python -m tools.racecheck_ws --tile vec --sync named  # by named barriers

A Gluon kernel of three partitions (4 + 4 + 4 warps) that share nothing: each loads 128 floats and stores them
shifted to its own slice of ``out``. With ``smem`` / ``mbarrier`` the default warps first write shared memory (a
buffer the partitions read after the ``gl.warp_specialize`` entry / one mbarrier initialised there), and racecheck
reports a hazard in the entry code. In ``mla_decode_gluon_kernel``, which initialises its mbarriers and writes its
query tile there, the reported pair is the default warps' store of each worker warp's partition-state byte and the
worker's load of it, ordered by the all-thread barrier of the entry protocol (``BAR.SYNC 0x1`` between them in the
SASS): the report is the tool's, not a race. ``exchange``: the default partition stores its values to shared
memory and arrives on an mbarrier, the workers wait on it and load them (the ordering the MLA kernel's score,
rescale and row-sum hand-over between its consumers relies on, used once): on the H200 racecheck reports only the
entry hazard of ``mbarrier`` then (at the kernel's entry and ``gl.warp_specialize`` lines), not the store and
load. ``--hand-over`` runs one of the MLA kernel's hand-over patterns (``PATTERNS``) and ``--tile`` one store /
load hand-over of a tile shape and layout (``TILES``), ``--steps`` times per launch: racecheck clears the 4-byte
accesses apart from the entry report and flags the vector ones (``tools/README.md`` has the counts); ``--sync
named`` hands the ``multi`` / ``vec`` / ``mma`` tiles over by ``bar.arrive`` / ``bar.sync`` instead, with no
mbarrier in the kernel, and racecheck flags the vector ones all the same. Exits 1 on a wrong result.
"""

from __future__ import annotations

import argparse
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


@gluon.jit
def _part(x, out, buf, bar, OFF: gl.constexpr, SMEM: gl.constexpr, MBAR: gl.constexpr, EXCH: gl.constexpr,
          WORKER: gl.constexpr):
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    i = gl.arange(0, 128, layout=lay)
    y = gl.load(x + i) + OFF
    if SMEM:
        y = y + buf.load(lay)
    if EXCH:  # the default partition hands its values to the workers: store, then arrive; wait, then load
        if WORKER:
            mbarrier.wait(bar.index(0), 0)
            y = y + buf.load(lay)
        else:
            buf.store(y)
            mbarrier.arrive(bar.index(0), count=1)
    if MBAR:
        if WORKER:
            mbarrier.wait(bar.index(0), 0)
        else:
            mbarrier.arrive(bar.index(0), count=1)
    gl.store(out + OFF + i, y)


@gluon.jit
def racecheck_ws_kernel(x, out, SMEM: gl.constexpr, MBAR: gl.constexpr, EXCH: gl.constexpr):
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    buf = gl.allocate_shared_memory(gl.float32, [128], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    if SMEM:
        buf.store(gl.arange(0, 128, layout=lay).to(gl.float32))
    if MBAR or EXCH:
        mbarrier.init(bar.index(0), count=1)
    gl.warp_specialize([(_part, (x, out, buf, bar, 0, SMEM, MBAR, EXCH, False)),
                        (_part, (x, out, buf, bar, 128, SMEM, MBAR, EXCH, True)),
                        (_part, (x, out, buf, bar, 256, SMEM, MBAR, EXCH, True))], [4, 4], [232, 40])


@gluon.jit
def _pingpong(x, out, buf, bars, n, ROLE: gl.constexpr):
    """ROLE 1 stores a tile into the one buffer every step, ROLE 0 adds it up: the MLA kernel's score hand-over
    (store after barrier 1, arrive on 0; wait on 0, load, arrive on 1)."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    i = gl.arange(0, 128, layout=lay)
    acc = gl.zeros([128], gl.float32, layout=lay)
    for j in range(n):
        if ROLE == 0:
            mbarrier.wait(bars.index(0), j & 1)
            acc = acc + buf.load(lay)
            mbarrier.arrive(bars.index(1), count=1)
        elif ROLE == 1:
            mbarrier.wait(bars.index(1), (j & 1) ^ 1)
            buf.store(gl.load(x + i) + j)
            mbarrier.arrive(bars.index(0), count=1)
    if ROLE == 0:
        gl.store(out + i, acc)


@gluon.jit
def _ring(x, xb, out, kb, a, buf, bars, n, CP: gl.constexpr, ROLE: gl.constexpr):
    """The MLA kernel's hand-overs without its tensor-core work. ROLE 2 fills stage ``s`` of the ring ``kb`` (a
    64 x 64 bf16 tile in the kernel's layout) by cp.async (``CP``: one arrival per thread on ``ready`` plus one,
    as the kernel) or by plain stores; ROLE 0 and ROLE 1 wait for it. ROLE 1 hands ROLE 0 a vector through ``buf``
    (store after ``free``, arrive ``full``: the score hand-over); ROLE 0 writes the stage's row sums to its slot of
    ``a`` and arrives ``p_ready`` (the rescale hand-over), ROLE 1 reads them; both release the stage on ``empty``.
    Barriers: ready 0-1, empty 2-3, p_ready 4-5, full 6, free 7."""
    cp: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    rows: gl.constexpr = gl.SliceLayout(1, cp)
    rk = gl.arange(0, 64, layout=rows)
    cc = gl.arange(0, 64, layout=gl.SliceLayout(0, cp))
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    i = gl.arange(0, 128, layout=lay)
    acc = gl.zeros([128], gl.float32, layout=lay)
    for j in range(n):
        s = j % 2
        ph = (j // 2) & 1
        if ROLE == 2:
            mbarrier.wait(bars.index(2 + s), ph ^ 1)
            src = xb + (j + rk)[:, None] * 64 + cc[None, :]
            if CP:
                _async_load(kb.index(s), src)
                async_copy.mbarrier_arrive(bars.index(s), increment_count=False)
            else:
                kb.index(s).store(gl.load(src))
            mbarrier.arrive(bars.index(s), count=1)
        elif ROLE == 0:
            mbarrier.wait(bars.index(s), ph)
            v = gl.sum(kb.index(s).load(cp).to(gl.float32), 1)
            mbarrier.wait(bars.index(6), j & 1)
            w = buf.load(lay)
            mbarrier.arrive(bars.index(7), count=1)
            a.index(s).store(v)
            mbarrier.arrive(bars.index(4 + s), count=1)
            acc = acc + w
            mbarrier.arrive(bars.index(2 + s), count=1)
        else:
            mbarrier.wait(bars.index(s), ph)
            mbarrier.wait(bars.index(7), (j & 1) ^ 1)
            buf.store(gl.load(x + i) + j)
            mbarrier.arrive(bars.index(6), count=1)
            mbarrier.wait(bars.index(4 + s), ph)
            acc = acc + gl.sum(a.index(s).load(rows), 0)
            mbarrier.arrive(bars.index(2 + s), count=1)
    if ROLE < 2:
        gl.store(out + ROLE * 128 + i, acc)


@gluon.jit
def _scores(xb, out, q_smem, kb, s_smem, bars, n, ROLE: gl.constexpr):
    """The MLA kernel's score hand-over with its tensor-core work: ROLE 2 fills the ring by cp.async as in
    ``_ring``; ROLE 0 and ROLE 1 each compute ``Q·Kᵀ`` of the stage by wgmma (Q in shared memory, written before
    the entry); ROLE 1 stores its fp32 accumulator to ``s_smem`` (after ``free``, arrive ``full``), ROLE 0 adds it
    to its own. Barriers: ready 0-1, empty 2-3, full 6, free 7."""
    cp: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    rk = gl.arange(0, 64, layout=gl.SliceLayout(1, cp))
    cc = gl.arange(0, 64, layout=gl.SliceLayout(0, cp))
    tot = gl.zeros([64], gl.float32, layout=gl.SliceLayout(1, s_l))
    for j in range(n):
        s = j % 2
        ph = (j // 2) & 1
        if ROLE == 2:
            mbarrier.wait(bars.index(2 + s), ph ^ 1)
            _async_load(kb.index(s), xb + (j + rk)[:, None] * 64 + cc[None, :])
            async_copy.mbarrier_arrive(bars.index(s), increment_count=False)
            mbarrier.arrive(bars.index(s), count=1)
        else:
            mbarrier.wait(bars.index(s), ph)
            fence_async_shared()
            acc = gl.zeros([64, 64], gl.float32, layout=s_l)
            acc = warpgroup_mma(q_smem, kb.index(s).permute((1, 0)), acc, use_acc=False, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            if ROLE == 0:
                mbarrier.wait(bars.index(6), j & 1)
                acc = acc + s_smem.load(s_l)
                mbarrier.arrive(bars.index(7), count=1)
                tot = tot + gl.sum(acc, 1)
            else:
                mbarrier.wait(bars.index(7), (j & 1) ^ 1)
                s_smem.store(acc)
                mbarrier.arrive(bars.index(6), count=1)
            mbarrier.arrive(bars.index(2 + s), count=1)
    if ROLE == 0:
        gl.store(out + gl.arange(0, 64, layout=gl.SliceLayout(1, s_l)), tot)


@gluon.jit
def _slice(x, out, buf, bar, ROLE: gl.constexpr):
    """ROLE 0 stores a row vector whose layout holds each value in 4 threads (the row sums of a 2-D tile, as the
    MLA kernel's rescale and row sums), then arrives; the others wait and load it."""
    two: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [gl.num_warps(), 1], [1, 0])
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    if ROLE == 0:
        r = gl.arange(0, 32, layout=gl.SliceLayout(1, two))
        c = gl.arange(0, 4, layout=gl.SliceLayout(0, two))
        buf.store(gl.sum(gl.load(x + r[:, None] * 4 + c[None, :]), 1))
        mbarrier.arrive(bar.index(0), count=1)
    else:
        mbarrier.wait(bar.index(0), 0)
        i = gl.arange(0, 32, layout=lay)
        gl.store(out + ROLE * 32 + i, buf.load(lay))


@gluon.jit
def racecheck_hand_over_kernel(x, xb, out, n, PATTERN: gl.constexpr):
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    bars = gl.allocate_shared_memory(gl.int64, [8, 1], mbarrier.MBarrierLayout())
    if PATTERN == 0:
        buf = gl.allocate_shared_memory(gl.float32, [128], vec)
        mbarrier.init(bars.index(0), count=1)
        mbarrier.init(bars.index(1), count=1)
        gl.warp_specialize([(_pingpong, (x, out, buf, bars, n, 0)),
                            (_pingpong, (x, out, buf, bars, n, 1)),
                            (_pingpong, (x, out, buf, bars, n, 2))], [4, 4], [232, 40])
    elif PATTERN <= 2:
        CP: gl.constexpr = PATTERN == 1
        sw: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        kb = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], sw)
        a = gl.allocate_shared_memory(gl.float32, [2, 64], vec)
        buf = gl.allocate_shared_memory(gl.float32, [128], vec)
        for s in gl.static_range(2):
            mbarrier.init(bars.index(s), count=4 * 32 + 1 if CP else 1)
            mbarrier.init(bars.index(2 + s), count=2)
            mbarrier.init(bars.index(4 + s), count=1)
        mbarrier.init(bars.index(6), count=1)
        mbarrier.init(bars.index(7), count=1)
        gl.warp_specialize([(_ring, (x, xb, out, kb, a, buf, bars, n, CP, 0)),
                            (_ring, (x, xb, out, kb, a, buf, bars, n, CP, 1)),
                            (_ring, (x, xb, out, kb, a, buf, bars, n, CP, 2))], [4, 4], [232, 40])
    elif PATTERN == 3:
        sw: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [64, 64], sw)
        kb = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], sw)
        s_smem = gl.allocate_shared_memory(gl.float32, [64, 64], gl.SwizzledSharedLayout(8, 1, 8, [1, 0]))
        for s in gl.static_range(2):
            mbarrier.init(bars.index(s), count=4 * 32 + 1)
            mbarrier.init(bars.index(2 + s), count=2)
        mbarrier.init(bars.index(6), count=1)
        mbarrier.init(bars.index(7), count=1)
        r = gl.arange(0, 64, layout=gl.SliceLayout(1, ld))
        c = gl.arange(0, 64, layout=gl.SliceLayout(0, ld))
        q_smem.store(gl.load(xb + r[:, None] * 64 + c[None, :]))
        fence_async_shared()
        gl.warp_specialize([(_scores, (xb, out, q_smem, kb, s_smem, bars, n, 0)),
                            (_scores, (xb, out, q_smem, kb, s_smem, bars, n, 1)),
                            (_scores, (xb, out, q_smem, kb, s_smem, bars, n, 2))], [4, 4], [232, 40])
    else:
        buf = gl.allocate_shared_memory(gl.float32, [32], vec)
        mbarrier.init(bars.index(0), count=1)
        gl.warp_specialize([(_slice, (x, out, buf, bars, 0)),
                            (_slice, (x, out, buf, bars, 1)),
                            (_slice, (x, out, buf, bars, 2))], [4, 4], [232, 40])


@gluon.jit
def _tile_offsets(lay: gl.constexpr, TWO_D: gl.constexpr, N: gl.constexpr):
    """Offsets of a tile of ``N`` fp32 values (``TWO_D``: 64 x 64) in the register layout ``lay``, and zeros."""
    if TWO_D:
        r = gl.arange(0, 64, layout=gl.SliceLayout(1, lay))
        c = gl.arange(0, 64, layout=gl.SliceLayout(0, lay))
        off = r[:, None] * 64 + c[None, :]
        acc = gl.zeros([64, 64], gl.float32, layout=lay)
    else:
        off = gl.arange(0, N, layout=lay)
        acc = gl.zeros([N], gl.float32, layout=lay)
    return off, acc


@gluon.jit
def _tile_pp(x, out, buf, bars, n, lay: gl.constexpr, TWO_D: gl.constexpr, N: gl.constexpr, ROLE: gl.constexpr):
    """``_pingpong`` with a tile of ``N`` fp32 values (``TWO_D``: a 64 x 64 tile) in the register layout ``lay``:
    which shapes and layouts of an mbarrier-ordered store / load racecheck follows."""
    off, acc = _tile_offsets(lay, TWO_D, N)
    for j in range(n):
        if ROLE == 0:
            mbarrier.wait(bars.index(0), j & 1)
            acc = acc + buf.load(lay)
            mbarrier.arrive(bars.index(1), count=1)
        elif ROLE == 1:
            mbarrier.wait(bars.index(1), (j & 1) ^ 1)
            buf.store(gl.load(x + off) + j)
            mbarrier.arrive(bars.index(0), count=1)
    if ROLE == 0:
        gl.store(out + off, acc)


@gluon.jit
def racecheck_tile_kernel(x, out, n, VARIANT: gl.constexpr):
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(0), count=1)
    mbarrier.init(bars.index(1), count=1)
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    swz: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    if VARIANT == 0:  # 8 values per thread, one 4-byte store each
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        buf = gl.allocate_shared_memory(gl.float32, [1024], vec)
        gl.warp_specialize([(_tile_pp, (x, out, buf, bars, n, lay, False, 1024, 0)),
                            (_tile_pp, (x, out, buf, bars, n, lay, False, 1024, 1)),
                            (_tile_pp, (x, out, buf, bars, n, lay, False, 1024, 2))], [4, 4], [232, 40])
    elif VARIANT == 1:  # 4 adjacent values per thread, one 16-byte store
        lay: gl.constexpr = gl.BlockedLayout([4], [32], [gl.num_warps()], [0])
        buf = gl.allocate_shared_memory(gl.float32, [512], vec)
        gl.warp_specialize([(_tile_pp, (x, out, buf, bars, n, lay, False, 512, 0)),
                            (_tile_pp, (x, out, buf, bars, n, lay, False, 512, 1)),
                            (_tile_pp, (x, out, buf, bars, n, lay, False, 512, 2))], [4, 4], [232, 40])
    elif VARIANT == 2:  # 2-D, one value per thread per row, unswizzled
        lay: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [gl.num_warps(), 1], [1, 0])
        buf = gl.allocate_shared_memory(gl.float32, [64, 64], flat)
        gl.warp_specialize([(_tile_pp, (x, out, buf, bars, n, lay, True, 4096, 0)),
                            (_tile_pp, (x, out, buf, bars, n, lay, True, 4096, 1)),
                            (_tile_pp, (x, out, buf, bars, n, lay, True, 4096, 2))], [4, 4], [232, 40])
    elif VARIANT == 3:  # the same registers into the score buffer's swizzled layout
        lay: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [gl.num_warps(), 1], [1, 0])
        buf = gl.allocate_shared_memory(gl.float32, [64, 64], swz)
        gl.warp_specialize([(_tile_pp, (x, out, buf, bars, n, lay, True, 4096, 0)),
                            (_tile_pp, (x, out, buf, bars, n, lay, True, 4096, 1)),
                            (_tile_pp, (x, out, buf, bars, n, lay, True, 4096, 2))], [4, 4], [232, 40])
    elif VARIANT == 4:  # the wgmma accumulator layout into the swizzled buffer: the MLA score hand-over alone
        buf = gl.allocate_shared_memory(gl.float32, [64, 64], swz)
        gl.warp_specialize([(_tile_pp, (x, out, buf, bars, n, mma, True, 4096, 0)),
                            (_tile_pp, (x, out, buf, bars, n, mma, True, 4096, 1)),
                            (_tile_pp, (x, out, buf, bars, n, mma, True, 4096, 2))], [4, 4], [232, 40])
    else:  # the accumulator layout, unswizzled
        buf = gl.allocate_shared_memory(gl.float32, [64, 64], flat)
        gl.warp_specialize([(_tile_pp, (x, out, buf, bars, n, mma, True, 4096, 0)),
                            (_tile_pp, (x, out, buf, bars, n, mma, True, 4096, 1)),
                            (_tile_pp, (x, out, buf, bars, n, mma, True, 4096, 2))], [4, 4], [232, 40])


@gluon.jit
def _bar(ID: gl.constexpr, SYNC: gl.constexpr):
    """A named barrier (``bar.sync`` / ``bar.arrive``) over the 256 threads of two 4-warp partitions, issued once per
    thread (inline PTX on a tensor of one value per thread). IDs 14 and 15: Triton's own barriers take the low ones."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    t = gl.full([32 * gl.num_warps()], 0, gl.int32, layout=lay)
    if SYNC:
        if ID == 14:
            gl.inline_asm_elementwise("bar.sync 14, 256;\n\tmov.b32 $0, $1;", "=r,r", [t], gl.int32, False, 1)
        else:
            gl.inline_asm_elementwise("bar.sync 15, 256;\n\tmov.b32 $0, $1;", "=r,r", [t], gl.int32, False, 1)
    else:
        if ID == 14:
            gl.inline_asm_elementwise("bar.arrive 14, 256;\n\tmov.b32 $0, $1;", "=r,r", [t], gl.int32, False, 1)
        else:
            gl.inline_asm_elementwise("bar.arrive 15, 256;\n\tmov.b32 $0, $1;", "=r,r", [t], gl.int32, False, 1)


@gluon.jit
def _tile_named(x, out, buf, n, lay: gl.constexpr, TWO_D: gl.constexpr, N: gl.constexpr, ROLE: gl.constexpr):
    """``_tile_pp`` handed over by named barriers instead of mbarriers: ROLE 1 stores, then arrives on barrier 14;
    ROLE 0 syncs on it, loads, and arrives on 15, on which ROLE 1 syncs before its next store."""
    off, acc = _tile_offsets(lay, TWO_D, N)
    for j in range(n):
        if ROLE == 0:
            _bar(14, True)
            acc = acc + buf.load(lay)
            if j < n - 1:
                _bar(15, False)
        elif ROLE == 1:
            if j > 0:
                _bar(15, True)
            buf.store(gl.load(x + off) + j)
            _bar(14, False)
    if ROLE == 0:
        gl.store(out + off, acc)


@gluon.jit
def racecheck_named_kernel(x, out, n, VARIANT: gl.constexpr):
    """``racecheck_tile_kernel``'s vector and accumulator-layout hand-overs by named barriers, and no mbarrier (so no
    shared memory is written before the entry)."""
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    swz: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    if VARIANT == 0:  # 8 values per thread, one 4-byte store each
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        buf = gl.allocate_shared_memory(gl.float32, [1024], vec)
        gl.warp_specialize([(_tile_named, (x, out, buf, n, lay, False, 1024, 0)),
                            (_tile_named, (x, out, buf, n, lay, False, 1024, 1)),
                            (_tile_named, (x, out, buf, n, lay, False, 1024, 2))], [4, 4], [232, 40])
    elif VARIANT == 1:  # 4 adjacent values per thread, one 16-byte store
        lay: gl.constexpr = gl.BlockedLayout([4], [32], [gl.num_warps()], [0])
        buf = gl.allocate_shared_memory(gl.float32, [512], vec)
        gl.warp_specialize([(_tile_named, (x, out, buf, n, lay, False, 512, 0)),
                            (_tile_named, (x, out, buf, n, lay, False, 512, 1)),
                            (_tile_named, (x, out, buf, n, lay, False, 512, 2))], [4, 4], [232, 40])
    else:  # the wgmma accumulator layout into the score buffer's swizzled layout
        buf = gl.allocate_shared_memory(gl.float32, [64, 64], swz)
        gl.warp_specialize([(_tile_named, (x, out, buf, n, mma, True, 4096, 0)),
                            (_tile_named, (x, out, buf, n, mma, True, 4096, 1)),
                            (_tile_named, (x, out, buf, n, mma, True, 4096, 2))], [4, 4], [232, 40])


NAMED_TILES = ("multi", "vec", "mma")


TILES = ("multi", "vec", "2d", "2d-swizzled", "mma", "mma-flat")


def _tile(variant: str, n: int, sync: str = "mbarrier") -> bool:
    x = torch.arange(4096, device="cuda", dtype=torch.float32)
    out = torch.zeros(4096, device="cuda")
    if sync == "named":
        if variant not in NAMED_TILES:
            raise SystemExit(f"--sync named takes --tile {', '.join(NAMED_TILES)}")
        racecheck_named_kernel[(2,)](x, out, n, VARIANT=NAMED_TILES.index(variant), num_warps=4, maxnreg=168)
    else:
        racecheck_tile_kernel[(2,)](x, out, n, VARIANT=TILES.index(variant), num_warps=4, maxnreg=168)
    m = {"multi": 1024, "vec": 512}.get(variant, 4096)
    return bool(torch.equal(out[:m], n * x[:m] + n * (n - 1) / 2))


PATTERNS = ("pingpong", "ring-cp", "ring-st", "scores", "slice")


def _hand_over(pattern: str, n: int = 8) -> bool:
    x = torch.arange(256, device="cuda", dtype=torch.float32)
    xb = (torch.arange(64 * (64 + n), device="cuda") % 7).to(torch.bfloat16)
    out = torch.zeros(384, device="cuda")
    racecheck_hand_over_kernel[(2,)](x, xb, out, n, PATTERN=PATTERNS.index(pattern), num_warps=4, maxnreg=168)
    i = x[:128]
    if pattern == "pingpong":
        return bool(torch.equal(out[:128], n * i + n * (n - 1) / 2))
    if pattern.startswith("ring"):
        tiles = sum(float(xb[64 * j:64 * j + 4096].float().sum()) for j in range(n))
        return bool(torch.equal(out[:128], n * i + n * (n - 1) / 2)
                    and torch.equal(out[128:256], torch.full_like(i, tiles)))
    if pattern == "scores":
        q = xb[:4096].float().view(64, 64)
        tot = sum(2 * (q @ xb[64 * j:64 * j + 4096].float().view(64, 64).T).sum(1) for j in range(n))
        return bool(torch.equal(out[:64], tot))
    rows = x[:128].view(32, 4).sum(1)
    return bool(torch.equal(out[32:64], rows) and torch.equal(out[64:96], rows))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0].rstrip(":") + ".")
    ap.add_argument("--default-writes", choices=("none", "smem", "mbarrier", "exchange"), default="smem")
    ap.add_argument("--hand-over", choices=PATTERNS, help="run this hand-over pattern instead")
    ap.add_argument("--tile", choices=TILES, help="run the store / load hand-over of this tile shape and layout")
    ap.add_argument("--steps", type=int, default=8, help="hand-overs per launch (--tile)")
    ap.add_argument("--sync", choices=("mbarrier", "named"), default="mbarrier",
                    help="--tile: hand over through mbarriers or through named barriers (bar.arrive / bar.sync)")
    args = ap.parse_args(argv)
    mode = args.default_writes
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("tools.racecheck_ws needs a Hopper GPU (sm_90)")
    if args.tile:
        ok = _tile(args.tile, args.steps, args.sync)
        print(f"tile {args.tile} x {args.steps} ({args.sync}): {'correct' if ok else 'WRONG'}")
        return 0 if ok else 1
    if args.hand_over:
        ok = _hand_over(args.hand_over)
        print(f"hand-over {args.hand_over}: {'correct' if ok else 'WRONG'}")
        return 0 if ok else 1
    x = torch.arange(128, device="cuda", dtype=torch.float32)
    out = torch.zeros(384, device="cuda")
    racecheck_ws_kernel[(2,)](x, out, SMEM=mode == "smem", MBAR=mode == "mbarrier", EXCH=mode == "exchange",
                              num_warps=4, maxnreg=168)
    ref = torch.cat([x, x + 128, x + 256])
    if mode == "smem":
        ref = ref + torch.arange(128, device="cuda", dtype=torch.float32).repeat(3)
    if mode == "exchange":
        ref = ref + torch.cat([torch.zeros_like(x), x, x])
    ok = bool(torch.equal(out, ref))
    print(f"default writes {mode}: {'correct' if ok else 'WRONG'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
