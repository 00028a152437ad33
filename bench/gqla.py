"""GQLA layer-level decode attention, both paths on one weight set (h_q 128, g 8, d_h = d_v 128, d_R 64, r 512,
page 64, bf16), the M / Q shapes and the small batches of the path-choice table, timed in CUDA graphs.

- absorb:  ``q_lat = W_UK[γ(i)]ᵀ q_nope`` (bmm per group) ++ q_rope -> ``mla_decode`` -> ``W_UV[γ(i)] õ``
- grouped: q_nope ++ q_rope -> ``gqa_decode`` over the per-group K/V cache with one shared rope key

Each workload adds one row per path (op ``gqla_absorb`` / ``gqla_grouped``, impl ``gqla_triton``; ``ms`` is the
whole decode attention in a CUDA graph: absorb projections + kernel) with extra fields: ``attn_ms`` (the decode
kernel alone, in a graph), ``eager_ms`` (the whole attention called eagerly), ``model_ms`` (roofline time of the
kernel on this GPU), ``auto_pick`` (``gq.choose_decode_path``: roofline x the kernels' measured efficiency in the config
table), ``roofline_pick`` (hardware bounds alone, ``kernel_efficiency=False``), ``winner`` (measured, whole decode
attention) and ``pick_ok``. ``python -m bench.run --op gqla`` (add ``--no-anchors``: there are no anchors here).
"""

from __future__ import annotations

import torch

import gqla_triton as gq
from bench.common import time_graph_ms, time_ms
from gqla_triton.roofline import gpu_spec, gqa_decode_model, mla_decode_model

H, G, DH, DR, R, PAGE = 128, 8, 128, 64, 512, 64
SHAPE = dict(num_heads=H, num_groups=G, head_dim=DH, v_head_dim=DH, rope_dim=DR, kv_rank=R)
WORKLOADS = {
    "M1": dict(B=128, S=4096, s_q=1),  # = Q1 shape
    "M2": dict(B=128, S=4096, s_q=2),  # = Q2 (MTP)
    "M3": dict(B=64, S=8192, s_q=1),
    "M4": dict(B=32, S=16384, s_q=1),  # = Q3
    "P1": dict(B=1, S=4096, s_q=1),  # small batches: the split-KV regime
    "P2": dict(B=1, S=32768, s_q=1),
    "P3": dict(B=8, S=8192, s_q=1),
    "P4": dict(B=16, S=2048, s_q=1),
    "P5": dict(B=32, S=4096, s_q=1),
}


def make_inputs(B, S, s_q, seed=0):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    pages = -(-S // PAGE)
    P = B * pages
    x = dict(
        q_nope=torch.randn(B, s_q, H, DH, generator=g, **bf),
        q_rope=torch.randn(B, s_q, H, DR, generator=g, **bf),
        w_uk=torch.randn(G, DH, R, generator=g, **bf) * R**-0.5,
        w_uv=torch.randn(G, DH, R, generator=g, **bf) * R**-0.5,
        kv=torch.randn(P, PAGE, 1, R + DR, generator=g, **bf),
        k=torch.randn(P, PAGE, G, DH, generator=g, **bf),
        v=torch.randn(P, PAGE, G, DH, generator=g, **bf),
        kr=torch.randn(P, PAGE, DR, generator=g, **bf),
        bt=torch.randperm(P, device="cuda", generator=g).reshape(B, pages).int(),
        lens=torch.full((B,), S, dtype=torch.int32, device="cuda"),
    )
    return x


def absorb_fns(x, scale):
    B, s_q = x["q_nope"].shape[:2]
    q_rope = x["q_rope"]

    def absorb_q():
        qn = x["q_nope"].view(B * s_q, G, H // G, DH).permute(1, 0, 2, 3).reshape(G, -1, DH)
        q_lat = torch.bmm(qn, x["w_uk"]).view(G, B * s_q, H // G, R).permute(1, 0, 2, 3).reshape(B, s_q, H, R)
        return torch.cat([q_lat, q_rope], -1)

    q_full = absorb_q()

    def attn():
        return gq.mla_decode(q_full, x["kv"], x["bt"], x["lens"], head_dim_v=R, softmax_scale=scale)[0]

    def full():
        o = gq.mla_decode(absorb_q(), x["kv"], x["bt"], x["lens"], head_dim_v=R, softmax_scale=scale)[0]
        o = o.view(B * s_q, G, H // G, R).permute(1, 0, 2, 3).reshape(G, -1, R)
        return torch.bmm(o, x["w_uv"].transpose(1, 2))  # [G, B·s_q·H/G, d_v]

    return attn, full


def grouped_fns(x, scale):
    q = torch.cat([x["q_nope"], x["q_rope"]], -1)

    def attn():
        return gq.gqa_decode(q, x["k"], x["v"], x["bt"], x["lens"], k_rope_cache=x["kr"], softmax_scale=scale)[0]

    def full():
        qq = torch.cat([x["q_nope"], x["q_rope"]], -1)
        return gq.gqa_decode(qq, x["k"], x["v"], x["bt"], x["lens"], k_rope_cache=x["kr"], softmax_scale=scale)[0]

    return attn, full


def run(names, ctx, anchors=True):
    info = gq.device_info()
    spec = gpu_spec(info.key if info.key in ("h100", "h200", "h20", "a100", "l40s") else "default")
    scale = (DH + DR) ** -0.5
    for name in names:
        w = WORKLOADS[name]
        B, S, s_q = w["B"], w["S"], w["s_q"]
        x = make_inputs(B, S, s_q)
        pick = gq.choose_decode_path(SHAPE, s_q, info, batch=B, seqlen=S)
        hw = gq.choose_decode_path(SHAPE, s_q, info, batch=B, seqlen=S, kernel_efficiency=False)
        m_abs = mla_decode_model(B, S, s_q, num_heads=H, kv_rank=R, rope_dim=DR)
        m_grp = gqa_decode_model(B, S, s_q, num_heads=H, num_groups=G, head_dim=DH, v_head_dim=DH, rope_dim=DR)
        proj = 2 * 2 * B * s_q * H * DH * R  # the two absorb projections (W_UK, W_UV)
        res = {}
        for path, fns, model, extra_flops in (("absorb", absorb_fns(x, scale), m_abs, proj),
                                              ("grouped", grouped_fns(x, scale), m_grp, 0)):
            attn, full = fns
            res[path] = (time_graph_ms(full), time_graph_ms(attn), time_ms(full), model, extra_flops)
        winner = min(res, key=lambda p: res[p][0])
        for path, (ms, attn_ms, eager_ms, model, extra_flops) in res.items():
            ctx.row(f"gqla_{path}", name, "gqla_triton", ms, flops=model.flops + extra_flops, nbytes=model.bytes,
                    path=path, attn_ms=attn_ms, eager_ms=eager_ms, model_ms=model.time(spec) * 1e3, auto_pick=pick.path,
                    model_absorb_ms=pick.absorb_s * 1e3, model_grouped_ms=pick.grouped_s * 1e3,
                    roofline_pick=hw.path, winner=winner, pick_ok=pick.path == winner, B=B, S=S, s_q=s_q)
        del x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    from bench.run import main

    main(["--op", "gqla", "--no-anchors"])
