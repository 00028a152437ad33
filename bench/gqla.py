"""GQLA layer-level decode attention, both paths on one weight set (h_q 128, g 8, d_h = d_v 128, d_R 64, r 512,
page 64, bf16), the M / Q shapes and the small batches of the path-choice table, timed in CUDA graphs.

- absorb:  ``q_lat = W_UK[γ(i)]ᵀ q_nope`` (bmm per group) ++ q_rope -> ``mla_decode`` -> ``W_UV[γ(i)] õ``
- grouped: q_nope ++ q_rope -> ``gqa_decode`` over the per-group K/V cache with one shared rope key

Each workload adds one row per path (op ``gqla_absorb`` / ``gqla_grouped``, impl ``gqla_triton``; ``ms`` is the
whole decode attention in a CUDA graph: absorb projections + kernel) with extra fields: ``attn_ms`` (the decode
kernel alone, in a graph), ``eager_ms`` (the whole attention called eagerly), ``model_ms`` (roofline time of the
kernel on this GPU), ``auto_pick`` (``gq.choose_decode_path``: the roofline scaled by the steps measured at the
nearest point of the config table), ``roofline_pick`` (hardware bounds alone, ``kernel_efficiency=False``),
``winner`` (measured here, whole decode attention), ``pick_ok`` and ``pick_loss`` (the picked path's time over the
winner's, minus 1). ``python -m bench.run --op gqla`` (add ``--no-anchors``: there are no anchors here).
"""

from __future__ import annotations

import torch

import gqla_triton as gq
from bench.common import time_graph_ms, time_ms
from gqla_triton.decode_path import POINTS, REF_SHAPE, absorb_step, grouped_step, step_inputs
from gqla_triton.roofline import gpu_spec, gqa_decode_model, mla_decode_model

H, G, DH, DR, R = (REF_SHAPE[k] for k in ("num_heads", "num_groups", "head_dim", "rope_dim", "kv_rank"))
SHAPE = REF_SHAPE
# the points the tuner measures for the path choice (gqla_triton.decode_path.POINTS): M1 = the Q1 shape, M2 = Q2
# (MTP), M4 = Q3; P1-P5 the small batches of the split-KV regime
WORKLOADS = {n: dict(B=b, S=s, s_q=q) for n, (b, s, q) in POINTS.items()}


def run(names, ctx, anchors=True):
    info = gq.device_info()
    spec = gpu_spec(info.key if info.key in ("h100", "h200", "h20", "a100", "l40s") else "default")
    for name in names:
        w = WORKLOADS[name]
        B, S, s_q = w["B"], w["S"], w["s_q"]
        x = step_inputs(B, S, s_q)
        pick = gq.choose_decode_path(SHAPE, s_q, info, batch=B, seqlen=S)
        hw = gq.choose_decode_path(SHAPE, s_q, info, batch=B, seqlen=S, kernel_efficiency=False)
        m_abs = mla_decode_model(B, S, s_q, num_heads=H, kv_rank=R, rope_dim=DR)
        m_grp = gqa_decode_model(B, S, s_q, num_heads=H, num_groups=G, head_dim=DH, v_head_dim=DH, rope_dim=DR)
        proj = 2 * 2 * B * s_q * H * DH * R  # the two absorb projections (W_UK, W_UV)
        res = {}
        for path, fns, model, extra_flops in (("absorb", absorb_step(x), m_abs, proj),
                                              ("grouped", grouped_step(x), m_grp, 0)):
            attn, full = fns
            res[path] = (time_graph_ms(full), time_graph_ms(attn), time_ms(full), model, extra_flops)
        winner = min(res, key=lambda p: res[p][0])
        for path, (ms, attn_ms, eager_ms, model, extra_flops) in res.items():
            ctx.row(f"gqla_{path}", name, "gqla_triton", ms, flops=model.flops + extra_flops, nbytes=model.bytes,
                    path=path, attn_ms=attn_ms, eager_ms=eager_ms, model_ms=model.time(spec) * 1e3, auto_pick=pick.path,
                    model_absorb_ms=pick.absorb_s * 1e3, model_grouped_ms=pick.grouped_s * 1e3,
                    roofline_pick=hw.path, winner=winner, pick_ok=pick.path == winner,
                    pick_loss=round(res[pick.path][0] / res[winner][0] - 1, 4), B=B, S=S, s_q=s_q)
        del x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    from bench.run import main

    main(["--op", "gqla", "--no-anchors"])
