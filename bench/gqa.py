"""GQA grouped-path decode (Q1-Q4 and five small batches B1-S4096 ... B32-S4096): h_q 128, g 8, d_h = d_v = 128,
shared rope 64, page 64.

Anchor: torch SDPA (``enable_gqa=True``) over contiguous K/V with the rope key copied into every group's
key (what a stock GQA kernel must read). ``gqla_triton`` rows carry ``graph_ms`` (the same call inside a CUDA
graph) and ``pct_copy_bw`` (bytes moved against the measured copy ceiling). Config sweeps are a tool:
``python -m tools.sweep --op gqa``.
"""

from __future__ import annotations

import sys

import torch

from bench.common import time_graph_ms, time_ms
from gqla_triton.roofline import GQA_WORKLOADS, gqa_decode_model

PAGE = 64
WORKLOADS = {k: GQA_WORKLOADS[k] for k in ("Q1", "Q2", "Q3", "Q4")}
# small batches, where the split-KV plan has to fill the GPU (the MLA bench's rows of the same names)
WORKLOADS.update({f"B{b}-S{s}": dict(batch=b, seqlen=s, s_q=1) for b, s in ((1, 4096), (1, 32768), (8, 8192),
                                                                             (16, 2048), (32, 4096))})


def make_inputs(w: dict, *, page: int = PAGE, dtype=torch.bfloat16, seed: int = 0):
    """Random bf16 paged caches with a permuted block table; every sequence holds ``seqlen`` tokens."""
    B, S, s_q = w["batch"], w["seqlen"], w.get("s_q", 1)
    h, g = w.get("num_heads", 128), w.get("num_groups", 8)
    d_h = w.get("head_dim", 128)
    d_v = w.get("v_head_dim") or d_h
    d_r = w.get("rope_dim", 64)
    torch.manual_seed(seed)
    pages_per = -(-S // page)
    num_pages = B * pages_per
    dev = "cuda"
    q = torch.randn(B, s_q, h, d_h + d_r, device=dev, dtype=dtype)
    k = torch.randn(num_pages, page, g, d_h, device=dev, dtype=dtype)
    v = torch.randn(num_pages, page, g, d_v, device=dev, dtype=dtype)
    kr = torch.randn(num_pages, page, d_r, device=dev, dtype=dtype) if d_r else None
    bt = torch.randperm(num_pages, device=dev).to(torch.int32).reshape(B, pages_per)
    lens = torch.full((B,), S, device=dev, dtype=torch.int32)
    if w.get("topk"):  # sparse: distinct random positions per (sequence, query token), shared by the groups
        idx = torch.stack([torch.randperm(S, device=dev)[: w["topk"]] for _ in range(B * s_q)])
        return q, k, v, bt, lens, kr, None, True, idx.reshape(B, s_q, -1).to(torch.int32)
    return q, k, v, bt, lens, kr


def _sdpa_anchor(w, q, k, v, bt, lens, kr):
    """Contiguous [B, g, S, d_h + d_R] keys (rope copied per group) and [B, g, S, d_v] values."""
    import torch.nn.functional as F

    B, S = w["batch"], w["seqlen"]
    g = k.shape[2]
    rows = (bt.long()[:, :, None] * PAGE + torch.arange(PAGE, device=bt.device)).reshape(B, -1)[:, :S]
    kc = k.reshape(-1, g, k.shape[-1])[rows]  # [B, S, g, d_h]
    if kr is not None:
        rc = kr.reshape(-1, kr.shape[-1])[rows]
        kc = torch.cat([kc, rc[:, :, None, :].expand(B, S, g, rc.shape[-1])], -1)
    kc = kc.permute(0, 2, 1, 3).contiguous()
    vc = v.reshape(-1, g, v.shape[-1])[rows].permute(0, 2, 1, 3).contiguous()
    qh = q.permute(0, 2, 1, 3).contiguous()  # [B, h, s_q, D]
    s_q = q.shape[1]
    mask = None
    if s_q > 1:  # bottom-right causal: query j sees positions <= S - s_q + j
        mask = torch.arange(S, device=q.device)[None, :] <= (S - s_q + torch.arange(s_q, device=q.device))[:, None]
    return lambda: F.scaled_dot_product_attention(qh, kc, vc, attn_mask=mask, enable_gqa=True)


def run(names, ctx, anchors=True):
    import gqla_triton as gq

    for name in names:
        w = WORKLOADS[name]
        model = gqa_decode_model(**w)
        args = make_inputs(w)
        fn = lambda: gq.gqa_decode(*args)  # noqa: E731
        ms = time_ms(fn)
        try:
            gms = time_graph_ms(fn)
        except Exception as e:  # graph timing is a diagnostic only
            print(f"[bench.gqa] {name}: CUDA-graph timing failed: {e}", file=sys.stderr)
            gms = None
        r = ctx.row("gqa_decode", name, "gqla_triton", ms, flops=model.flops, nbytes=model.bytes, graph_ms=gms)
        r["pct_copy_bw"] = r.get("pct_roofline")
        if ctx.want("torch_sdpa", anchors):
            try:
                sd = _sdpa_anchor(w, *args)
                ctx.row("gqa_decode", name, "torch_sdpa", time_ms(sd), flops=model.flops, nbytes=model.bytes)
                del sd
            except Exception as e:  # an anchor failing is reported, never fatal
                print(f"[bench.gqa] {name}: torch SDPA anchor failed: {type(e).__name__}: {e}", file=sys.stderr)
            torch.cuda.empty_cache()
        args = None
        torch.cuda.empty_cache()
