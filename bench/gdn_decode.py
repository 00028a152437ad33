"""GDN recurrent decode step: B sequences, HV 32 value heads, H 16 q/k heads, K = V = 128, bf16 io.

The fp32 state (B·HV·K·V·4 bytes = 537 MB at B 256) is read and written once per call, so the floor is
``2 x state bytes + io`` over the measured copy bandwidth. Timed inside CUDA graphs on a random non-zero state
pool updated in place (state_indices = a permutation of the pool rows). Anchors: a plain copy of the state
(the same bytes, the practical ceiling) and fla's ``fused_recurrent_gated_delta_rule`` (single-token steps only:
with two tokens per step it faults with an illegal memory access on the H200, which would end the run's CUDA
context). Config sweeps are a tool: ``python -m tools.sweep --op gdn_decode``.
"""

from __future__ import annotations

import torch

import gqla_triton as gq
from bench.common import time_graph_ms, try_import
from gqla_triton.roofline import gdn_decode_model

WORKLOADS = {
    "D1": dict(B=256, HV=32, H=16, K=128, V=128, s=1),
    "D2": dict(B=256, HV=32, H=16, K=128, V=128, s=2),
    "D3": dict(B=64, HV=32, H=16, K=128, V=128, s=1),
}


def _inputs(w, dtype=torch.bfloat16):
    B, HV, H, K, V, s = (w[x] for x in ("B", "HV", "H", "K", "V", "s"))
    dev = "cuda"
    q = torch.randn(B, s, H, K, device=dev, dtype=dtype)
    k = torch.randn(B, s, H, K, device=dev, dtype=dtype)
    v = torch.randn(B, s, HV, V, device=dev, dtype=dtype)
    g = -torch.rand(B, s, HV, device=dev) * 0.1  # decays close to 1 keep the state bounded over replays
    beta = torch.rand(B, s, HV, device=dev) * 0.5
    state = torch.randn(B, HV, K, V, device=dev) * 0.02
    idx = torch.randperm(B, device=dev).to(torch.int32)
    return q, k, v, g, beta, state, idx


def run(names, ctx, anchors=True):
    fla = try_import("fla.ops.gated_delta_rule") if ctx.want("fla_fused_recurrent", anchors) else None
    for name in names:
        _one(name, ctx, anchors, fla)
        torch.cuda.empty_cache()


def _one(name, ctx, anchors, fla):
    w = WORKLOADS[name]
    m = gdn_decode_model(B=w["B"], HV=w["HV"], H=w["H"], K=w["K"], V=w["V"], s=w["s"])
    q, k, v, g, beta, state, idx = _inputs(w)
    ms = time_graph_ms(lambda: gq.gated_delta_rule_decode(q, k, v, g, beta, state, idx, use_qk_l2norm_in_kernel=True))
    ctx.row("gdn_decode", name, "gqla_triton", ms, flops=m.flops, nbytes=m.bytes)
    if not anchors:
        return
    # the same traffic done by a plain copy of the state (read + write): the practical ceiling
    if ctx.want("torch_state_copy", anchors):
        dst = torch.empty_like(state)
        ctx.row("gdn_decode", name, "torch_state_copy", time_graph_ms(lambda: dst.copy_(state)),
                flops=m.flops, nbytes=m.bytes)
    if w["s"] > 1:  # fla's multi-token step faults on the H200 (see the module docstring)
        print(f"[bench] fla fused_recurrent not timed on {name} (s = {w['s']})")
    elif fla is not None and hasattr(fla, "fused_recurrent_gated_delta_rule"):
        f = fla.fused_recurrent_gated_delta_rule
        try:
            # fla writes a new final state (same bytes as our in-place update) and has no pool indices
            ms_f = time_graph_ms(lambda: f(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True))
            ctx.row("gdn_decode", name, "fla_fused_recurrent", ms_f, flops=m.flops, nbytes=m.bytes)
        except Exception as e:  # anchors never break the run
            print(f"[bench] fla fused_recurrent_gated_delta_rule failed on {name}: {type(e).__name__}: {e}")
