"""MLA absorb-path decode (h_q 128, latent 512 + rope 64, page 64, bf16): dense M1-M4, sparse SM1/SM2 (topk 2048).

Also small batches B1 S4096, B1 S32768, B8 S8192, B16 S2048, B32 S4096 (dense), where the split-KV plan has to
fill the GPU.

``python -m bench.run --op mla`` times ``gq.mla_decode`` with ``impl="auto"`` (row ``gqla_triton``: the GPU's table
picks the kernel, the Gluon one on Hopper) and with ``impl="triton"`` (row ``gqla_triton_portable``) beside FlashMLA
(dense legacy SM90 kernel; sparse bf16 kernel) and a torch bmm reference, every row eagerly (``ms``) and inside a
CUDA graph (``graph_ms``; ``graph_ratios`` compares those).
Config sweeps are a tool: ``python -m tools.sweep --op mla``.
"""

from __future__ import annotations

import sys

import torch

from bench.common import time_graph_ms, time_ms, try_import
from gqla_triton.roofline import MLA_WORKLOADS, mla_decode_model

H, R, DR, PAGE = 128, 512, 64, 64
# the roofline's workload table, in this module's names (B batch, S cached tokens)
WORKLOADS = {k: dict(B=w["batch"], S=w["seqlen"], s_q=w["s_q"], **({"topk": w["topk"]} if "topk" in w else {}))
             for k, w in MLA_WORKLOADS.items()}
# small batches, where the split-KV plan has to fill the GPU
WORKLOADS.update({f"B{b}-S{s}": dict(B=b, S=s, s_q=1) for b, s in ((1, 4096), (1, 32768), (8, 8192), (16, 2048),
                                                                    (32, 4096))})


def make_inputs(B, S, s_q, topk=None, seed=0):
    """Random bf16 q / paged cache with randomly permuted pages; sparse: random distinct logical indices."""
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    D = R + DR
    pages = (S + PAGE - 1) // PAGE
    q = torch.randn(B, s_q, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(B * pages, PAGE, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
    bt = torch.randperm(B * pages, device="cuda", generator=g).reshape(B, pages).int()
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    idx = None
    if topk:
        # distinct positions per (b, token), causal-valid: all below S - s_q + j
        keys = torch.rand(B * s_q, S - s_q + 1, device="cuda", generator=g)
        idx = keys.topk(topk, dim=-1).indices.reshape(B, s_q, topk).int()
    return q, kv, bt, lens, idx


def _physical(bt, idx):
    """Logical sparse indices -> physical cache rows (FlashMLA's convention)."""
    page = idx.long() // PAGE
    blk = torch.gather(bt.long(), 1, page.reshape(page.shape[0], -1)).reshape(page.shape)
    return (blk * PAGE + idx.long() % PAGE).int()


def _flash_mla_dense(fm, q, kv, bt, lens, scale, causal):
    meta = fm.get_mla_metadata()[0]

    def f():
        return fm.flash_mla_with_kvcache(q, kv, bt, lens, R, meta, softmax_scale=scale, causal=causal,
                                         use_legacy=True)
    f()
    return f


def _flash_mla_sparse(fm, q, kv, bt, idx, scale):
    B, s_q, h, D = q.shape
    qf = q.reshape(B * s_q, h, D)
    kvf = kv.reshape(-1, 1, D)
    phys = _physical(bt, idx).reshape(B * s_q, 1, -1)
    last = None
    for legacy in (True, False):
        try:
            def f(legacy=legacy):
                return fm.flash_mla_sparse_fwd(qf, kvf, phys, scale, d_v=R, use_legacy=legacy)
            f()
            return f
        except Exception as e:  # try the other kernel family
            last = e
    raise last


def _torch_dense(q, kv, bt, lens, scale):
    """bmm over a contiguous copy of the cache (the gather is done once, outside the timing)."""
    B, s_q, h, D = q.shape
    S = int(lens[0])
    keys = kv.reshape(-1, D)[(bt.long()[:, :, None] * PAGE + torch.arange(PAGE, device="cuda")).reshape(B, -1)[:, :S]]
    qf = q.reshape(B, s_q * h, D)
    causal = (torch.arange(S, device="cuda")[None, :] > (S - s_q + torch.arange(s_q, device="cuda"))[:, None])
    bias = torch.zeros(s_q, S, device="cuda").masked_fill(causal, float("-inf")).repeat_interleave(h, 0)

    def f():
        s = torch.bmm(qf, keys.transpose(1, 2)).float() * scale + bias
        p = torch.softmax(s, -1).to(q.dtype)
        return torch.bmm(p, keys[..., :R])
    return f


def _torch_sparse(q, kv, bt, idx, scale):
    B, s_q, h, D = q.shape
    rows = _physical(bt, idx).long().reshape(B * s_q, -1)
    qf = q.reshape(B * s_q, h, D)
    kvf = kv.reshape(-1, D)

    def f():
        keys = kvf[rows]  # gather inside the timing: it is part of sparse attention
        s = torch.bmm(qf, keys.transpose(1, 2)).float() * scale
        p = torch.softmax(s, -1).to(q.dtype)
        return torch.bmm(p, keys[..., :R])
    return f


def _counts(w):
    m = mla_decode_model(w["B"], w["S"], w["s_q"], num_heads=H, kv_rank=R, rope_dim=DR, topk=w.get("topk"))
    return m.flops, m.bytes


OURS = (("gqla_triton", "auto"), ("gqla_triton_portable", "triton"))


def run(names, ctx, anchors=True):
    import gqla_triton as gq

    fm = try_import("flash_mla") if ctx.want("flash_mla", anchors) else None
    scale = (R + DR) ** -0.5
    for name in names:
        w = WORKLOADS[name]
        q, kv, bt, lens, idx = make_inputs(w["B"], w["S"], w["s_q"], w.get("topk"))
        flops, nbytes = _counts(w)
        for impl_name, impl in OURS:
            ours = lambda impl=impl: gq.mla_decode(q, kv, bt, lens, head_dim_v=R, softmax_scale=scale,  # noqa: E731
                                                   causal=True, indices=idx, impl=impl)
            try:
                ours()
            except Exception as e:  # e.g. impl="triton" where the table has no entry: recorded, never fatal
                ctx.row("mla", name, impl_name, None, error=f"{type(e).__name__}: {str(e)[:160]}")
                continue
            graph_ms = None
            try:
                graph_ms = time_graph_ms(ours)
            except Exception as e:
                print(f"[bench.mla] {name}: CUDA graph timing failed: {type(e).__name__}: {e}", file=sys.stderr)
            ctx.row("mla", name, impl_name, time_ms(ours), flops=flops, nbytes=nbytes, graph_ms=graph_ms)
        if not anchors:
            continue
        sparse = idx is not None
        for impl, build in (
            ("flash_mla", (lambda: _flash_mla_sparse(fm, q, kv, bt, idx, scale)) if sparse
             else (lambda: _flash_mla_dense(fm, q, kv, bt, lens, scale, w["s_q"] > 1))),
            ("torch_bmm", (lambda: _torch_sparse(q, kv, bt, idx, scale)) if sparse
             else (lambda: _torch_dense(q, kv, bt, lens, scale))),
        ):
            if not ctx.want(impl, anchors):
                continue
            ms = graph_ms = None
            try:
                if impl == "flash_mla" and fm is None:
                    raise RuntimeError("flash_mla not importable")
                fn = build()
                ms = time_ms(fn)
                graph_ms = time_graph_ms(fn)
            except Exception as e:  # a failing anchor records None, never kills the run
                print(f"[bench.mla] anchor {impl} on {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
            ctx.row("mla", name, impl, ms, flops=flops, nbytes=nbytes, graph_ms=graph_ms)
            torch.cuda.empty_cache()
        q = kv = bt = lens = idx = None  # free the inputs before the next workload
        torch.cuda.empty_cache()
