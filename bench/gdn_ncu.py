"""Chunked GDN kernels under Nsight Compute: ours (forward, optionally backward) and the anchors' forward.

Run under ncu with profiling off at start; this script warms every impl up (compiles), then brackets one call
of each with cudaProfilerStart/Stop, so ncu sees exactly those launches::

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --csv --page details \\
        python3 -m bench.gdn_ncu --workload G1 [--bwd] [--anchors fla]
"""

from __future__ import annotations

import argparse

import torch

from bench.gdn import WORKLOADS, _inputs, anchor_impls
from gqla_triton.ops.gdn.chunk import chunk_gated_delta_rule


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="G1")
    ap.add_argument("--bwd", action="store_true", help="also our backward")
    ap.add_argument("--anchors", default="fla", help="comma list of anchors to profile (forward only)")
    a = ap.parse_args()
    q, k, v, g, beta, cu = _inputs(WORKLOADS[a.workload])
    impls = {"gqla_triton": chunk_gated_delta_rule}
    impls.update({n: f for n, f in anchor_impls().items() if n in a.anchors.split(",")})
    xs = [t.detach().clone().requires_grad_() for t in (q, k, v, g, beta)]
    do = torch.randn_like(v)

    def call(name, fn):
        if name == "gqla_triton" and a.bwd:
            o, _ = fn(*xs, output_final_state=True, cu_seqlens=cu)
            torch.autograd.grad(o, xs, do)
        else:
            fn(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)

    for name, fn in impls.items():
        for _ in range(2):
            call(name, fn)
    torch.cuda.synchronize()
    for name, fn in impls.items():
        print(f"[ncu] {name}", flush=True)
        torch.cuda.cudart().cudaProfilerStart()
        call(name, fn)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
