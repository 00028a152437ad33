"""Split-KV combine: merge S fp32 partial results (out, lse) of h_q 128 heads, D 512 (MLA) or 128 (GQA), into
bf16 out and fp32 lse. Anchor: the same merge in torch (max-shifted exponentials). Memory-bound: the floor is its
bytes over the measured copy bandwidth. C3 / C4 are single sequences of 64 splits (the small-batch decode plans),
latency-bound: their ``graph_ms`` (CUDA graphs) is the number that matters."""

from __future__ import annotations

import torch

from bench.common import time_graph_ms, time_ms
from gqla_triton.ops._common import combine_splits

WORKLOADS = {
    "C1": dict(B=128, S=4, Q=1, H=128, D=512),
    "C2": dict(B=32, S=16, Q=2, H=128, D=128),
    "C3": dict(B=1, S=64, Q=1, H=128, D=128),
    "C4": dict(B=1, S=64, Q=1, H=128, D=512),
}


def run(names, ctx, anchors=True):
    for name in names:
        w = WORKLOADS[name]
        B, S, Q, H, D = w["B"], w["S"], w["Q"], w["H"], w["D"]
        o = torch.randn(B, S, Q, H, D, device="cuda")
        lse = torch.randn(B, S, Q, H, device="cuda")
        out = torch.empty(B, Q, H, D, device="cuda", dtype=torch.bfloat16)
        lse_out = torch.empty(B, H, Q, device="cuda")
        nbytes = o.numel() * 4 + lse.numel() * 4 + out.numel() * 2 + lse_out.numel() * 4
        fn = lambda: combine_splits(o, lse, out, lse_out)  # noqa: E731
        ctx.row("combine", name, "gqla_triton", time_ms(fn), nbytes=nbytes, graph_ms=time_graph_ms(fn))
        if ctx.want("torch", anchors):
            def torch_combine():
                m = lse.amax(1, keepdim=True)
                w_ = torch.exp(lse - m)
                return (o * w_[..., None]).sum(1) / w_.sum(1)[..., None]

            ctx.row("combine", name, "torch", time_ms(torch_combine), nbytes=nbytes)
