"""GQA grouped-path decode (DESIGN.md Q1-Q4): h_q 128, g 8, d_h = d_v = 128, shared rope 64, page 64.

Anchor: torch SDPA (``enable_gqa=True``) over contiguous K/V with the rope key copied into every group's
key (what a stock GQA kernel must read), as ``../shared/anchors/NUMBERS.md`` describes.

``python -m bench.gqa --sweep Q1,Q3,SQ1`` times launch-config variants (through ``GQLA_TRITON_CONFIG``) and
prints the best one per workload, for tuning ``configs/h200.json``.
"""

from __future__ import annotations

import itertools
import json
import os
import sys

import torch

from bench.common import time_graph_ms, time_ms
from gqla_triton.roofline import GQA_WORKLOADS, gqa_decode_model

PAGE = 64
WORKLOADS = {k: GQA_WORKLOADS[k] for k in ("Q1", "Q2", "Q3", "Q4")}


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
    from gqla_triton import gqa_decode

    for name in names:
        w = WORKLOADS[name]
        model = gqa_decode_model(**w)
        args = make_inputs(w)
        fn = lambda: gqa_decode(*args)  # noqa: E731
        ms = time_ms(fn)
        try:
            gms = time_graph_ms(fn)
        except Exception as e:  # graph timing is a diagnostic only
            print(f"[bench.gqa] {name}: CUDA-graph timing failed: {e}", file=sys.stderr)
            gms = None
        r = ctx.row("gqa_decode", name, "gqla_triton", ms, flops=model.flops, nbytes=model.bytes, graph_ms=gms)
        r["pct_copy_bw"] = r.get("pct_roofline")
        if anchors:
            try:
                sd = _sdpa_anchor(w, *args)
                ctx.row("gqa_decode", name, "torch_sdpa", time_ms(sd), flops=model.flops, nbytes=model.bytes)
                del sd
            except Exception as e:  # an anchor failing is reported, never fatal
                print(f"[bench.gqa] {name}: torch SDPA anchor failed: {type(e).__name__}: {e}", file=sys.stderr)
            torch.cuda.empty_cache()
        args = None
        torch.cuda.empty_cache()


def sweep(names):
    """Time config variants for each workload; prints ms per variant and the best."""
    from gqla_triton import gqa_decode

    grid = dict(BLOCK_N=[32, 64, 128], num_stages=[2, 3], num_warps=[4, 8], WAVES=[4, 8])
    for name in names:
        w = GQA_WORKLOADS[name]
        args = make_inputs(w)
        model = gqa_decode_model(**w)
        results = []
        for vals in itertools.product(*grid.values()):
            cfg = dict(zip(grid, vals, strict=True))
            os.environ["GQLA_TRITON_CONFIG"] = json.dumps({"gqa_decode": cfg})
            try:
                ms = time_ms(lambda: gqa_decode(*args), warmup=10, rep=40)
            except Exception as e:
                print(f"{name} {cfg}: failed {type(e).__name__}: {str(e)[:120]}")
                continue
            results.append((ms, cfg))
            print(f"{name} {cfg}: {ms:.4f} ms  {model.bytes / ms / 1e6:.0f} GB/s", flush=True)
        os.environ.pop("GQLA_TRITON_CONFIG", None)
        results.sort(key=lambda x: x[0])
        print(f"== {name} best: {results[:3]}")
        args = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", default="Q1,Q3")
    a = ap.parse_args()
    sweep([n for n in a.sweep.split(",") if n])
