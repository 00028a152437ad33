"""Sparse top-k attention (topk 2048, h_q 128, bf16): SM1/SM2 decode on the absorb path (``mla_decode``, page 64),
SQ1 on the grouped path (``gqa_decode``, indices shared by the 8 groups), SP1 sparse prefill (``mla_sparse_prefill``:
4096 query tokens of an 8192-token prompt, each with its own rows).

Anchor for SM1/SM2/SP1: FlashMLA's bf16 sparse kernel (``flash_mla.flash_mla_sparse_fwd``, sgl-flash-mla; each
decode query is one row of its ``s_q`` axis and indices are physical cache rows). At SM1/SM2 the same call is also
timed through ours (``gqla_triton_prefill``: ``gqla_triton.flash_mla_sparse_fwd`` on the anchor's inputs). No public
kernel has SQ1. ``gqla_triton`` decode rows carry ``graph_ms``: the same call inside a CUDA graph (how a serving loop
runs decode).
"""

from __future__ import annotations

import sys

import torch

from bench.common import time_graph_ms, time_ms, try_import
from gqla_triton.roofline import (
    GQA_WORKLOADS,
    MLA_WORKLOADS,
    gqa_decode_model,
    mla_decode_model,
    mla_sparse_prefill_model,
)

PAGE = 64
WORKLOADS = {"SM1": MLA_WORKLOADS["SM1"], "SM2": MLA_WORKLOADS["SM2"], "SQ1": GQA_WORKLOADS["SQ1"],
             "SP1": dict(s_q=4096, s_kv=8192, topk=2048)}


def _paging(B, S, dev):
    pages_per = -(-S // PAGE)
    bt = torch.randperm(B * pages_per, device=dev).to(torch.int32).reshape(B, pages_per)
    lens = torch.full((B,), S, device=dev, dtype=torch.int32)
    return bt, lens


def _topk_indices(B, s_q, S, topk, dev):
    """Distinct random positions in [0, S) per (sequence, query token), int32 [B, s_q, topk]."""
    idx = torch.stack([torch.randperm(S, device=dev)[:topk] for _ in range(B * s_q)])
    return idx.reshape(B, s_q, topk).to(torch.int32)


def _physical(idx, bt):
    b = torch.arange(idx.shape[0], device=idx.device)[:, None, None]
    pos = idx.long()
    return (bt.long()[b, pos // PAGE] * PAGE + pos % PAGE).to(torch.int32)


def _graph_ms(name, fn):
    """Per-call time inside a CUDA graph (how a serving loop runs decode: no host launch cost), or None."""
    try:
        fn()
        return time_graph_ms(fn)
    except Exception as e:
        print(f"[bench.sparse] {name}: CUDA graph timing failed: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def _run_mla(name, w, ctx, anchors):
    import gqla_triton as gq

    B, S, s_q, topk = w["batch"], w["seqlen"], w.get("s_q", 1), w["topk"]
    dev = "cuda"
    torch.manual_seed(0)
    bt, lens = _paging(B, S, dev)
    q = torch.randn(B, s_q, 128, 576, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(bt.numel(), PAGE, 1, 576, device=dev, dtype=torch.bfloat16)
    idx = _topk_indices(B, s_q, S, topk, dev)
    model = mla_decode_model(**w)
    scale = 576**-0.5
    ours = lambda: gq.mla_decode(q, kv, bt, lens, 512, scale, causal=True, indices=idx)  # noqa: E731
    ctx.row("sparse_decode", name, "gqla_triton", time_ms(ours), flops=model.flops, nbytes=model.bytes,
            graph_ms=_graph_ms(name, ours))
    q2 = q.reshape(B * s_q, 128, 576)
    kv2 = kv.reshape(-1, 1, 576)
    phys = _physical(idx, bt).reshape(B * s_q, 1, topk)
    prefill = lambda: gq.flash_mla_sparse_fwd(q2, kv2, phys, scale, 512)  # noqa: E731
    ctx.row("sparse_decode", name, "gqla_triton_prefill", time_ms(prefill), flops=model.flops, nbytes=model.bytes)
    _flash_mla_sparse("sparse_decode", name, ctx, anchors, model, q2, kv2, phys, scale)


def _flash_mla_sparse(kind, name, ctx, anchors, model, q, kv, rows, scale):
    """FlashMLA's ``flash_mla_sparse_fwd`` on these inputs, its legacy (SM90) and current kernels (rows of ``kind``)."""
    if not ctx.want("flash_mla", anchors):
        return
    fm = try_import("flash_mla")
    if fm is None or not hasattr(fm, "flash_mla_sparse_fwd"):
        return
    for legacy in (True, False):
        try:
            fn = lambda: fm.flash_mla_sparse_fwd(q, kv, rows, scale, 512, use_legacy=legacy)  # noqa: E731
            fn()
            ctx.row(kind, name, "flash_mla_sparse" + ("_legacy" if legacy else ""), time_ms(fn),
                    flops=model.flops, nbytes=model.bytes)
        except Exception as e:  # an anchor failing is reported, never fatal
            print(f"[bench.sparse] {name}: flash_mla_sparse_fwd(use_legacy={legacy}) failed: "
                  f"{type(e).__name__}: {str(e)[:200]}", file=sys.stderr)


def _run_prefill(name, w, ctx, anchors):
    import gqla_triton as gq

    s_q, s_kv, topk = w["s_q"], w["s_kv"], w["topk"]
    dev = "cuda"
    torch.manual_seed(0)
    q = torch.randn(s_q, 128, 576, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(s_kv, 1, 576, device=dev, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(s_kv, device=dev)[:topk] for _ in range(s_q)]).to(torch.int32)[:, None]
    model = mla_sparse_prefill_model(s_q, s_kv, topk)
    scale = 576**-0.5
    ours = lambda: gq.mla_sparse_prefill(q, kv, idx, 512, scale)  # noqa: E731
    ctx.row("sparse_prefill", name, "gqla_triton", time_ms(ours), flops=model.flops, nbytes=model.bytes)
    _flash_mla_sparse("sparse_prefill", name, ctx, anchors, model, q, kv, idx, scale)


def _run_gqa(name, w, ctx, anchors):
    import gqla_triton as gq

    B, S, s_q, topk = w["batch"], w["seqlen"], w.get("s_q", 1), w["topk"]
    dev = "cuda"
    torch.manual_seed(0)
    bt, lens = _paging(B, S, dev)
    g, d, dr = 8, 128, 64
    q = torch.randn(B, s_q, 128, d + dr, device=dev, dtype=torch.bfloat16)
    k = torch.randn(bt.numel(), PAGE, g, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(bt.numel(), PAGE, g, d, device=dev, dtype=torch.bfloat16)
    kr = torch.randn(bt.numel(), PAGE, dr, device=dev, dtype=torch.bfloat16)
    idx = _topk_indices(B, s_q, S, topk, dev)
    model = gqa_decode_model(**w)
    ours = lambda: gq.gqa_decode(q, k, v, bt, lens, kr, indices=idx)  # noqa: E731
    ctx.row("sparse_decode", name, "gqla_triton", time_ms(ours), flops=model.flops, nbytes=model.bytes,
            graph_ms=_graph_ms(name, ours))


def run(names, ctx, anchors=True):
    for name in names:
        w = WORKLOADS[name]
        run_one = _run_gqa if name.startswith("SQ") else _run_prefill if name.startswith("SP") else _run_mla
        run_one(name, w, ctx, anchors)
        torch.cuda.empty_cache()
