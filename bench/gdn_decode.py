"""GDN recurrent decode step: B sequences, HV 32 value heads, H 16 q/k heads, K = V = 128, bf16 io.

The fp32 state (B·HV·K·V·4 bytes = 537 MB at B 256) is read and written once per call, so the floor is
``2 x state bytes + io`` over the measured copy bandwidth. Timed inside CUDA graphs on a random non-zero state
pool updated in place (state_indices = a permutation of the pool rows).
"""

from __future__ import annotations

import torch

from bench.common import time_graph_ms, try_import
from gqla_triton.ops.gdn.decode import gated_delta_rule_decode
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
    fla = try_import("fla.ops.gated_delta_rule") if anchors else None
    for name in names:
        _one(name, ctx, anchors, fla)
        torch.cuda.empty_cache()


def _one(name, ctx, anchors, fla):
    w = WORKLOADS[name]
    m = gdn_decode_model(B=w["B"], HV=w["HV"], H=w["H"], K=w["K"], V=w["V"], s=w["s"])
    q, k, v, g, beta, state, idx = _inputs(w)
    ms = time_graph_ms(lambda: gated_delta_rule_decode(q, k, v, g, beta, state, idx, use_qk_l2norm_in_kernel=True))
    ctx.row("gdn_decode", name, "gqla_triton", ms, flops=m.flops, nbytes=m.bytes)
    if not anchors:
        return
    # the same traffic done by a plain copy of the state (read + write): the practical ceiling
    dst = torch.empty_like(state)
    ctx.row("gdn_decode", name, "torch_state_copy", time_graph_ms(lambda: dst.copy_(state)),
            flops=m.flops, nbytes=m.bytes)
    # fla's fused_recurrent with s = 2 tokens per sequence (D2) hit an illegal memory access on the H200 (session
    # 2), which ends the CUDA context of the whole run: timed for single-token decode only
    if w["s"] > 1:
        print(f"[bench] fla fused_recurrent not timed on {name} (s = {w['s']} faulted on the H200)")
    elif fla is not None and hasattr(fla, "fused_recurrent_gated_delta_rule"):
        f = fla.fused_recurrent_gated_delta_rule
        try:
            # fla writes a new final state (same bytes as our in-place update) and has no pool indices
            ms_f = time_graph_ms(lambda: f(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True))
            ctx.row("gdn_decode", name, "fla_fused_recurrent", ms_f, flops=m.flops, nbytes=m.bytes)
        except Exception as e:  # anchors never break the run
            print(f"[bench] fla fused_recurrent_gated_delta_rule failed on {name}: {type(e).__name__}: {e}")


# Config variants for ``python -m bench.gdn_decode --sweep D1,D2``: overrides of the h200.json entry.
VARIANTS = {f"bv{bv}_w{w}": dict(BV=bv, num_warps=w, num_stages=1)
            for bv in (16, 32, 64) for w in (2, 4, 8) if bv * 128 // (32 * w) >= 8}


def sweep(names, *, budget_s=120.0, variants=None):
    """Time each config variant on each workload (CUDA graphs); prints ms, % of state copy and the best."""
    import json
    import os
    import time

    t0 = time.time()
    best = {}
    for name in names:
        w = WORKLOADS[name]
        m = gdn_decode_model(B=w["B"], HV=w["HV"], H=w["H"], K=w["K"], V=w["V"], s=w["s"])
        q, k, v, g, beta, state, idx = _inputs(w)
        dst = torch.empty_like(state)
        copy_ms = time_graph_ms(lambda: dst.copy_(state))  # noqa: B023
        print(f"{name} state copy {copy_ms:.4f} ms", flush=True)
        for vn, cfg in VARIANTS.items():
            if (variants and vn not in variants) or time.time() - t0 > budget_s:
                continue
            os.environ["GQLA_TRITON_CONFIG"] = json.dumps({"gdn_decode": cfg})
            fn = lambda: gated_delta_rule_decode(q, k, v, g, beta, state, idx,  # noqa: E731, B023
                                                 use_qk_l2norm_in_kernel=True)
            try:
                ms = time_graph_ms(fn)
            except Exception as e:
                print(f"{name} {vn} failed {type(e).__name__}: {str(e)[:150]}", flush=True)
                continue
            print(f"{name} {vn:<10} {ms:.4f} ms {m.bytes / ms / 1e6:7.0f} GB/s {100 * copy_ms / ms:5.1f}% of copy",
                  flush=True)
            if name not in best or ms < best[name][0]:
                best[name] = (ms, vn)
        os.environ.pop("GQLA_TRITON_CONFIG", None)
    for name, (ms, vn) in best.items():
        print(f"BEST {name} {vn} {ms:.4f} ms {VARIANTS[vn]}")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="GDN decode config sweep")
    ap.add_argument("--sweep", default="D1,D2")
    ap.add_argument("--budget", type=float, default=120.0)
    a = ap.parse_args()
    sweep([n for n in a.sweep.split(",") if n], budget_s=a.budget)
