"""MLA absorb-path decode over the FP8 latent cache (FlashMLA's 656-byte rows), beside the bf16 cache.

Workloads: sparse SM1 / SM2 (top-2048) and dense M1 / M4 / B1 S32768 / B32 S4096 (h_q 128, latent 512 + rope 64,
page 64). Every row is a CUDA-graph time (``ms``: one call inside a graph of 20). Rows:

- ``gqla_triton_fp8``: ``mla_decode`` over ``quantize_latent_fp8(kv)``; ``gqla_triton``: the same call over the
  bf16 cache ``kv`` it was quantised from (``impl="auto"`` for both: the table's kernel).
- ``flash_mla_fp8``: FlashMLA's FP8 sparse decode (``flash_mla_with_kvcache(..., is_fp8_kvcache=True,
  use_legacy=True)``) over the same FP8 bytes; ``flash_mla``: its bf16 kernel over ``kv`` (sparse:
  ``flash_mla_sparse_fwd``; dense: the legacy SM90 kernel). FlashMLA has no dense kernel for these rows.

Dense workloads also time the cache scaled per tensor (vLLM's ``kv_cache_dtype="fp8"``): ``gqla_triton_fp8_scaled``,
``mla_decode(q8, kv8s, ..., q_descale=, k_descale=)`` over ``kv / s`` and ``q / s_q`` in e4m3 (one scale each, the
amax over 448), and ``flash_mla_fp8_scaled``, FlashMLA's dense FP8 kernel (``flash_mla_with_kvcache(...,
is_fp8_kvcache=True, use_legacy=True, descale_q=, descale_k=)``, its metadata from ``get_mla_decoding_metadata``)
over the same bytes.

Sparse workloads also time FlashMLA's layouts of d_qk = 512 over the first 512 channels of the same q and cache:
``gqla_triton_v32_no_rope`` / ``gqla_triton_model1``, ``mla_decode`` over its 528-byte rows without rope / its
MODEL1 (V4) pages, and ``flash_mla_v32_no_rope`` / ``flash_mla_model1``, FlashMLA's legacy sparse kernel over the
same bytes (``kv_format="V32_NO_ROPE"`` / ``"V4"``); our rows carry ``rel_diff_vs_flash_mla`` against them.

Each FP8 row carries ``rel_err_vs_bf16``: ``|o_fp8 - o_bf16| / |o_bf16|`` (Frobenius) against the same library's
bf16 output; ``gqla_triton_fp8`` rows also carry ``rel_diff_vs_flash_mla_fp8`` (both read the same bytes, so this
checks the layout and the dequantisation, not the quantiser).
"""

from __future__ import annotations

import sys

import torch

from bench.common import time_graph_ms, try_import
from bench.mla import _flash_mla_dense, _flash_mla_sparse, _physical, make_inputs
from gqla_triton.ops.mla.fp8 import E4M3_MAX
from gqla_triton.roofline import MLA_WORKLOADS, mla_decode_model

R, DR = 512, 64
_DENSE = {"M1": MLA_WORKLOADS["M1"], "M4": MLA_WORKLOADS["M4"], "B1-S32768": dict(batch=1, seqlen=32768, s_q=1),
          "B32-S4096": dict(batch=32, seqlen=4096, s_q=1)}
WORKLOADS = {"SM1": MLA_WORKLOADS["SM1"], "SM2": MLA_WORKLOADS["SM2"], **_DENSE}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _graph(name: str, fn):
    try:
        return time_graph_ms(fn)
    except Exception as e:  # recorded as None, never fatal
        print(f"[bench.fp8] {name}: CUDA graph timing failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        return None


def _flash_mla_fp8(fm, q, kv8, bt, idx, scale):
    B, s_q = q.shape[:2]
    phys = _physical(bt, idx).reshape(B, s_q, -1)
    meta = fm.get_mla_metadata()[0]

    def f():
        return fm.flash_mla_with_kvcache(q, kv8, None, None, R, meta, softmax_scale=scale, is_fp8_kvcache=True,
                                         indices=phys, use_legacy=True)
    f()
    return f


def _per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in float8_e4m3fn scaled per tensor (amax / 448) and its float32 ``[1]`` descale."""
    d = (x.float().abs().amax() / E4M3_MAX).clamp(min=1e-12).reshape(1)
    return (x.float() / d).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), d


def _flash_mla_fp8_scaled(fm, q8, kv8s, bt, lens, qd, kd, scale):
    B, s_q, h_q = q8.shape[:3]
    meta = fm.get_mla_metadata()[0]
    meta.tile_scheduler_metadata, meta.num_splits = fm.get_mla_decoding_metadata(
        lens, s_q * h_q, 1, is_fp8_kvcache=True, use_legacy=True)

    def f():
        return fm.flash_mla_with_kvcache(q8, kv8s, bt, lens, R, meta, softmax_scale=scale, causal=True,
                                         is_fp8_kvcache=True, use_legacy=True, descale_q=qd, descale_k=kd)
    f()
    return f


def _flash_mla_512(fm, q, cache, bt, idx, scale, kv_format):
    B, s_q = q.shape[:2]
    phys = _physical(bt, idx).reshape(B, s_q, -1)
    meta = fm.get_mla_metadata()[0]

    def f():
        return fm.flash_mla_with_kvcache(q, cache, None, None, R, meta, softmax_scale=scale, is_fp8_kvcache=True,
                                         indices=phys, use_legacy=True, kv_format=kv_format)
    f()
    return f


def _layouts_512(gq, fm, ctx, name, q, kv, bt, lens, idx, m16, tokens):
    """The d_qk 512 rows (module docstring): ours and FlashMLA's over each layout's bytes."""
    q5, kv5 = q[..., :R].contiguous(), kv[..., :R].contiguous()
    scale = R ** -0.5
    for layout, fmt in (("v32_no_rope", "V32_NO_ROPE"), ("model1", "V4")):
        cache = gq.quantize_latent_fp8(kv5, layout=layout)
        nb = m16.bytes - tokens * (R + DR) * 2 + tokens * cache.shape[-1]
        runs = [(f"gqla_triton_{layout}", lambda c=cache, f=layout: lambda: gq.mla_decode(
            q5, c, bt, lens, R, scale, causal=True, indices=idx, kv_format=f))]
        if fm is not None:
            runs.append((f"flash_mla_{layout}", lambda c=cache, f=fmt: _flash_mla_512(fm, q5, c, bt, idx, scale, f)))
        outs, rows = {}, {}
        for impl, build in runs:
            try:
                fn = build()
                outs[impl] = fn()[0].reshape(q5.shape[:3] + (R,))
                ms = _graph(f"{name} {impl}", fn)
            except Exception as e:  # recorded, never fatal
                print(f"[bench.fp8] {name}: {impl} failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                continue
            rows[impl] = ctx.row("fp8", name, impl, ms, flops=m16.flops, nbytes=nb)
        ours, theirs = f"gqla_triton_{layout}", f"flash_mla_{layout}"
        if ours in rows and theirs in outs:
            rows[ours]["rel_diff_vs_flash_mla"] = _rel(outs[ours], outs[theirs])
            print(f"[fp8] {name} {ours} rel_diff_vs_flash_mla {rows[ours]['rel_diff_vs_flash_mla']:.5f}", flush=True)


def run(names, ctx, anchors=True):
    import gqla_triton as gq

    fm = try_import("flash_mla") if ctx.want("flash_mla", anchors) else None
    scale = (R + DR) ** -0.5
    for name in names:
        w = WORKLOADS[name]
        B, S, s_q, topk = w["batch"], w["seqlen"], w["s_q"], w.get("topk")
        q, kv, bt, lens, idx = make_inputs(B, S, s_q, topk)
        kv8 = gq.quantize_latent_fp8(kv)
        m16 = mla_decode_model(B, S, s_q, topk=topk)
        tokens = B * (S if topk is None else min(topk, S) * s_q)  # cache rows read
        b8 = m16.bytes - tokens * (R + DR) * 2 + tokens * kv8.shape[-1]
        outs = {}

        def ours(cache):
            return lambda: gq.mla_decode(q, cache, bt, lens, R, scale, causal=True, indices=idx)

        for impl, cache, nb in (("gqla_triton", kv, m16.bytes), ("gqla_triton_fp8", kv8, b8)):
            try:
                outs[impl] = ours(cache)()[0]
                ms = _graph(f"{name} {impl}", ours(cache))
            except Exception as e:  # recorded, never fatal
                ctx.row("fp8", name, impl, None, error=f"{type(e).__name__}: {str(e)[:160]}")
                continue
            ctx.row("fp8", name, impl, ms, flops=m16.flops, nbytes=nb)
        if fm is not None and topk:
            for impl, build, nb in (("flash_mla", lambda: _flash_mla_sparse(fm, q, kv, bt, idx, scale), m16.bytes),
                                       ("flash_mla_fp8", lambda: _flash_mla_fp8(fm, q, kv8, bt, idx, scale), b8)):
                try:
                    fn = build()
                    outs[impl] = fn()[0].reshape(B, s_q, -1, R)
                    ms = _graph(f"{name} {impl}", fn)
                except Exception as e:  # an anchor failing is reported, never fatal
                    print(f"[bench.fp8] {name}: {impl} failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                    continue
                ctx.row("fp8", name, impl, ms, flops=m16.flops, nbytes=nb)
        elif fm is not None:
            try:
                fn = _flash_mla_dense(fm, q, kv, bt, lens, scale, False)
                ctx.row("fp8", name, "flash_mla", _graph(f"{name} flash_mla", fn), flops=m16.flops, nbytes=m16.bytes)
            except Exception as e:
                print(f"[bench.fp8] {name}: flash_mla failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        if topk:
            _layouts_512(gq, fm, ctx, name, q, kv, bt, lens, idx, m16, tokens)
        else:  # the cache scaled per tensor: ours and FlashMLA's dense FP8 kernel over the same bytes
            (q8, qd), (kv8s, kd) = _per_tensor(q), _per_tensor(kv)
            bs = m16.bytes - tokens * (R + DR) * 2 + tokens * (R + DR)
            runs = [("gqla_triton_fp8_scaled", lambda: lambda: gq.mla_decode(
                q8, kv8s, bt, lens, R, scale, causal=True, q_descale=qd, k_descale=kd))]
            if fm is not None:
                runs.append(("flash_mla_fp8_scaled", lambda: _flash_mla_fp8_scaled(fm, q8, kv8s, bt, lens, qd, kd,
                                                                                   scale)))
            for impl, build in runs:
                try:
                    fn = build()
                    outs[impl] = fn()[0]
                    ms = _graph(f"{name} {impl}", fn)
                except Exception as e:  # recorded, never fatal
                    print(f"[bench.fp8] {name}: {impl} failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                    continue
                ctx.row("fp8", name, impl, ms, flops=m16.flops, nbytes=bs)
        for r in ctx.rows:
            if r["workload"] != name or r["op"] != "fp8":
                continue
            base = {"gqla_triton_fp8": "gqla_triton", "flash_mla_fp8": "flash_mla",
                    "gqla_triton_fp8_scaled": "gqla_triton"}.get(r["impl"])
            if base in outs and r["impl"] in outs:
                r["rel_err_vs_bf16"] = _rel(outs[r["impl"]], outs[base])
            twin = {"gqla_triton_fp8": "flash_mla_fp8", "gqla_triton_fp8_scaled": "flash_mla_fp8_scaled"}.get(r["impl"])
            if twin in outs and r["impl"] in outs:
                r["rel_diff_vs_flash_mla_fp8"] = _rel(outs[r["impl"]], outs[twin])
            errs = {k: round(r[k], 5) for k in ("rel_err_vs_bf16", "rel_diff_vs_flash_mla_fp8") if k in r}
            if errs:
                print(f"[fp8] {name} {r['impl']} {errs}", flush=True)
        q = kv = kv8 = bt = lens = idx = q8 = kv8s = None
        outs.clear()
        torch.cuda.empty_cache()
