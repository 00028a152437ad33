"""One launch of the warp-specialised MLA kernel per workload between cudaProfilerStart/Stop (for ncu)."""
import sys

import torch

from bench.mla import WORKLOADS, make_inputs
from gqla_triton.ops.mla.decode import mla_decode_fwd

for name in sys.argv[1].split(","):
    w = WORKLOADS[name]
    q, kv, bt, lens, idx = make_inputs(w["B"], w["S"], w["s_q"], w.get("topk"))
    for impl in sys.argv[2].split(","):
        f = lambda: mla_decode_fwd(q, kv, bt, lens, 512, 576 ** -0.5, True, idx, None, 0, impl=impl)  # noqa: E731
        f()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        f()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
