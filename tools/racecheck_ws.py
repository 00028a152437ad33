"""What ``compute-sanitizer --tool racecheck`` reports for Triton's warp specialisation alone, without our kernels:

    compute-sanitizer --tool racecheck python -m tools.racecheck_ws --default-writes none   # 0 hazards
    compute-sanitizer --tool racecheck python -m tools.racecheck_ws --default-writes smem   # 1 hazard
    compute-sanitizer --tool racecheck python -m tools.racecheck_ws --default-writes mbarrier
    compute-sanitizer --tool racecheck python -m tools.racecheck_ws --default-writes exchange

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
load. Exits 1 on a wrong result.
"""

from __future__ import annotations

import argparse
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--default-writes", choices=("none", "smem", "mbarrier", "exchange"), default="smem")
    mode = ap.parse_args(argv).default_writes
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("tools.racecheck_ws needs a Hopper GPU (sm_90)")
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
