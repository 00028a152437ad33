"""Chunked Gated DeltaNet prefill: forward and forward+backward, bf16, K = V = 128 (DESIGN.md G1-G5).

Anchors: fla (pure Triton: FLA_DISABLE_BACKEND_DISPATCH=1 is set before importing it) and FlashQLA
(``flash_qla.chunk_gated_delta_rule``). fla's backward refuses on Hopper with Triton 3.4-3.7.0: its
fwd+bwd row is then recorded as None with the error. q, k are unit-norm rows (no in-kernel l2norm),
g = logsigmoid(N(0,1))/8 style decays (fp32), beta = sigmoid(N(0,1)) (bf16), no initial state,
final state requested.
"""

from __future__ import annotations

import os

import torch

from bench.common import time_ms, try_import
from gqla_triton.ops.gdn.chunk import chunk_gated_delta_rule
from gqla_triton.roofline import GDN_WORKLOADS, gdn_chunk_bwd_model, gdn_chunk_fwd_model

# the roofline's workload table; G4 is varlen over these 8 sequences
WORKLOADS = {k: dict(w) for k, w in GDN_WORKLOADS.items()}
WORKLOADS["G4"]["cu"] = [0, 1000, 5096, 6000, 14192, 15000, 23192, 24000, 32768]
K = V = 128


def _inputs(w, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    B, T, H, HV = w["B"], w["T"], w["H"], w["HV"]
    dt = torch.bfloat16
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda", generator=gen), dim=-1).to(dt)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda", generator=gen), dim=-1).to(dt)
    v = torch.randn(B, T, HV, V, device="cuda", generator=gen).to(dt)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device="cuda", generator=gen)) / 8
    beta = torch.sigmoid(torch.randn(B, T, HV, device="cuda", generator=gen)).to(dt)
    cu = torch.tensor(w["cu"], dtype=torch.int64, device="cuda") if "cu" in w else None
    return q, k, v, g, beta, cu


def _timings(fn, args, cu):
    """(forward ms, forward+backward ms or None, error string or None) of fn(q, k, v, g, beta, ...)."""
    q, k, v, g, beta = args

    def fwd():
        return fn(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)

    f_ms = time_ms(fwd)
    xs = [t.detach().clone().requires_grad_() for t in args]
    do = torch.randn_like(v)

    def fwd_bwd():
        o, _ = fn(*xs, output_final_state=True, cu_seqlens=cu)
        torch.autograd.grad(o, xs, do)

    try:
        fwd_bwd()
        torch.cuda.synchronize()
        fb_ms, err = time_ms(fwd_bwd), None
    except Exception as e:  # an anchor's backward that refuses on this stack is recorded, never fatal
        fb_ms, err = None, f"{type(e).__name__}: {str(e)[:160]}"
    return f_ms, fb_ms, err


def anchor_impls() -> dict:
    """Importable anchors' ``chunk_gated_delta_rule`` by name (fla on its own Triton kernels, FlashQLA).
    ``GQLA_BENCH_ANCHORS`` (e.g. "fla") limits them; an anchor left out is not even imported (FlashQLA loads
    TileLang / TVM, whose runtime and compile caches should not share the process with host-bound timings)."""
    os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")
    keep = os.environ.get("GQLA_BENCH_ANCHORS")
    wanted = lambda name: keep is None or name in keep.split(",")  # noqa: E731
    impls = {}
    if wanted("fla"):
        fla = try_import("fla.ops.gated_delta_rule")
        if fla is not None:
            impls["fla"] = fla.chunk_gated_delta_rule
    if wanted("flashqla"):
        fq = try_import("flash_qla")
        if fq is not None:
            impls["flashqla"] = fq.chunk_gated_delta_rule
    return impls


def run(names, ctx, anchors=True):
    impls = {"gqla_triton": chunk_gated_delta_rule}
    if anchors:
        impls.update(anchor_impls())
    for name in names:
        w = WORKLOADS[name]
        q, k, v, g, beta, cu = _inputs(w)
        fm = gdn_chunk_fwd_model(w["B"], w["T"], w["H"], w["HV"], K, V)
        bm = gdn_chunk_bwd_model(w["B"], w["T"], w["H"], w["HV"], K, V)
        for impl, fn in impls.items():
            try:
                f_ms, fb_ms, err = _timings(fn, (q, k, v, g, beta), cu)
            except Exception as e:
                f_ms, fb_ms, err = None, None, f"{type(e).__name__}: {str(e)[:160]}"
            ctx.row("gdn_fwd", name, impl, f_ms, flops=fm.flops, nbytes=fm.bytes)
            extra = {"error": err} if err else {}
            ctx.row("gdn_fwd_bwd", name, impl, fb_ms, flops=fm.flops + bm.flops, nbytes=fm.bytes + bm.bytes,
                    **extra)
        del q, k, v, g, beta
        torch.cuda.empty_cache()
