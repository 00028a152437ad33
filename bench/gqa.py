"""GQA grouped-path decode (DESIGN.md Q1-Q4): h_q 128, g 8, d_h = d_v = 128, shared rope 64, page 64.

Anchor: torch SDPA (``enable_gqa=True``) over contiguous K/V with the rope key copied into every group's
key (what a stock GQA kernel must read), as ``../shared/anchors/NUMBERS.md`` describes.

``python -m bench.gqa --sweep Q1,Q2,Q3,SQ1`` times every kernel variant (``DENSE_VARIANTS`` /
``SPARSE_VARIANTS``, switched through ``GQLA_TRITON_CONFIG``) in one process and prints a table plus the best
h200.json config per workload (``BEST_JSON``). ``python -m bench.gqa --aot`` compiles them all for sm_90
without a GPU and prints registers / stack (spills).
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


# Kernel variants for the sweep: overrides of the committed h200.json entry (``{}`` = that baseline).
# Predictions (H200, Q1): PAGED saves the per-token block-table gather (BLOCK_N loads + int64 math per tile,
# shared by K, rope, V) -> fewer instructions / shorter load chain, +5-15%; V_EARLY puts K, rope and V of a
# tile in flight together, +0-10% when occupancy is the limit; stages 3 / BLOCK_N 32 x 4 stages deepen the
# pipeline at 2 programs/SM (40 KB per 64-token stage with rope); 8 warps halves per-thread acc/regs;
# WAVES 12 gives Q1 two splits (2048 programs) for a smaller tail, at the cost of the combine kernel.
# Offline sm_90 compile (--aot, Triton 3.9) of the committed BLOCK_N 64 config spills heavily (per-token
# gathered K/V/rope tiles keep 64-bit pointer tensors in registers); BLOCK_N 32 + PAGED compiles with no
# spills, so those variants come first (the budget cut drops the tail of this list).
DENSE_VARIANTS = {
    "base": {},
    "paged_n32_s4": {"PAGED": True, "BLOCK_N": 32, "num_stages": 4},
    "paged_n32_s3_ve": {"PAGED": True, "BLOCK_N": 32, "num_stages": 3, "V_EARLY": True},
    "paged_n32_s2": {"PAGED": True, "BLOCK_N": 32, "num_stages": 2},
    "paged_n32_s4_ve": {"PAGED": True, "BLOCK_N": 32, "num_stages": 4, "V_EARLY": True},
    "paged_n32_s4_w8": {"PAGED": True, "BLOCK_N": 32, "num_stages": 4, "num_warps": 8},
    "paged_n32_s4_wv12": {"PAGED": True, "BLOCK_N": 32, "num_stages": 4, "WAVES": 12},
    "n32_s4": {"BLOCK_N": 32, "num_stages": 4},
    "paged": {"PAGED": True},
    "paged_ve_w8": {"PAGED": True, "V_EARLY": True, "num_warps": 8},
    "paged_s3": {"PAGED": True, "num_stages": 3},
    "paged_ve": {"PAGED": True, "V_EARLY": True},
}
# Sparse (SQ1): random gathered rows; deeper pipelines / 8 warps put more rows in flight.
SPARSE_VARIANTS = {
    "base": {},
    "w8": {"num_warps": 8},
    "w8_s4": {"num_warps": 8, "num_stages": 4},
    "n16_s4": {"BLOCK_N": 16, "num_stages": 4},
    "n32_s4": {"num_stages": 4},
    # session 7: rows pre-translated by sparse_rows (all variants); ra = the next tile's rows loaded one iteration
    # ahead. sm_90 compile: every SQ1 variant keeps K/V in registers (15 KB of shared memory, no multi-stage
    # copies) at 197-255 registers: latency hiding comes from resident CTAs, hence the register-lean n16 ones
    "ra": {"ROWS_AHEAD": True},
    "ra_w8": {"ROWS_AHEAD": True, "num_warps": 8},
    "ra_s4": {"ROWS_AHEAD": True, "num_stages": 4},
    "s2": {"num_stages": 2},
    "ra_s2": {"ROWS_AHEAD": True, "num_stages": 2},
    "n16_s2": {"BLOCK_N": 16, "num_stages": 2},
}
COPY_GBS = 4270.0  # measured H200 copy ceiling


def _workload_inputs(name):
    w = GQA_WORKLOADS[name]
    if name.startswith("SQ"):
        q, k, v, bt, lens, kr, _, causal, idx = make_inputs(w)
        return w, (q, k, v, bt, lens, kr), dict(causal=causal, indices=idx)
    return w, make_inputs(w), {}


def _base_entry(sparse):
    from gqla_triton.dispatch import _match

    with open(os.path.join(os.path.dirname(__file__), "..", "gqla_triton", "configs", "h200.json")) as f:
        return _match(json.load(f), "gqa_decode", {"sparse": sparse})


def sweep(names, *, budget_s=150.0, variants=None):
    """Time every kernel variant on each workload in one process (variant-major, so a cut by ``budget_s``
    drops whole low-priority variants); prints a table and the best h200.json config per workload."""
    import time

    from gqla_triton import gqa_decode

    t0 = time.time()
    inputs = {n: _workload_inputs(n) for n in names}
    res = {n: [] for n in names}
    dense = [n for n in names if not n.startswith("SQ")]
    sparse = [n for n in names if n.startswith("SQ")]
    dplan = [(vn, cfg, dense) for vn, cfg in DENSE_VARIANTS.items()] if dense else []
    splan = [(vn, cfg, sparse) for vn, cfg in SPARSE_VARIANTS.items()] if sparse else []
    # interleaved by priority, so a budget cut drops the tails of both lists
    plan = [p for pair in itertools.zip_longest(dplan, splan) for p in pair if p is not None]
    if variants:
        plan = [p for p in plan if p[0] in variants]
    print(f"{'workload':<6}{'variant':<18}{'ms':>8}{'GB/s':>8}{'%copy':>7}", flush=True)
    for vn, cfg, wls in plan:
        if time.time() - t0 > budget_s:
            print(f"[budget {budget_s:.0f}s reached: skipping variant {vn}]", flush=True)
            continue
        os.environ["GQLA_TRITON_CONFIG"] = json.dumps({"gqa_decode": cfg})
        for name in wls:
            w, args, kw = inputs[name]
            model = gqa_decode_model(**w)
            fn = lambda: gqa_decode(*args, **kw)  # noqa: B023, E731
            try:
                fn()
                torch.cuda.synchronize()
                ms = time_graph_ms(fn, replays=10, reps=11)
            except Exception as e:
                print(f"{name:<6}{vn:<18} failed {type(e).__name__}: {str(e)[:150]}", flush=True)
                continue
            gbs = model.bytes / ms / 1e6
            res[name].append((ms, vn))
            print(f"{name:<6}{vn:<18}{ms:>8.4f}{gbs:>8.0f}{100 * gbs / COPY_GBS:>6.0f}%", flush=True)
    os.environ.pop("GQLA_TRITON_CONFIG", None)
    print(f"[sweep wall {time.time() - t0:.0f}s]")
    best = {}
    for name in names:
        if not res[name]:
            continue
        res[name].sort()
        ms, vn = res[name][0]
        sp = name.startswith("SQ")
        base_ms = dict((v, m) for m, v in res[name]).get("base")
        cfg = dict(_base_entry(sp), **(SPARSE_VARIANTS if sp else DENSE_VARIANTS)[vn])
        best[name] = {"variant": vn, "ms": round(ms, 4), "base_ms": base_ms and round(base_ms, 4), "config": cfg}
        print(f"== {name} best {vn} {ms:.4f} ms (base {base_ms}) top3 {res[name][:3]}")
    print("BEST_JSON " + json.dumps(best))


def aot_report():
    """No GPU needed: compile every variant for sm_90 (Q1 / Q2 / Q3 / SQ1 shapes) and print smem, registers
    and stack (spills) from cuobjdump."""
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gqla_triton.ops.gqa.decode import gqa_decode_fwd_kernel as kern

    names = kern.arg_names
    ptrs = {"q": "*bf16", "k_cache": "*bf16", "v_cache": "*bf16", "kr_cache": "*bf16", "block_table": "*i32",
            "seqlens": "*i32", "indices": "*i32", "topk_len": "*i32", "out": "*bf16", "lse_out": "*fp32",
            "o_part": "*fp32", "lse_part": "*fp32"}
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    h200 = {sp: _base_entry(sp) for sp in (False, True)}
    cases = [("Q1", False, 16, False), ("Q3", False, 16, True), ("Q2", False, 32, False), ("SQ1", True, 16, True)]
    for sp_list, variants in ((False, DENSE_VARIANTS), (True, SPARSE_VARIANTS)):
        for vn, over in variants.items():
            cfg = dict(h200[sp_list], **over)
            bn, st = cfg["BLOCK_N"], cfg["num_stages"]
            while bn > 16 and st * bn * (128 + 128 + 64) * 2 + 16 * 192 * 2 > cfg["SMEM"]:
                bn //= 2
            for wl, sparse, bm, split in cases:
                if sparse != sp_list:
                    continue
                const = dict(G=16, NUM_MT=1, PAGE_SIZE=PAGE, DH=128, DR=64, DV=128, BLOCK_M=bm, BLOCK_N=bn, BDH=128,
                             BDR=64, BDV=128, CAUSAL=True, SPARSE=sparse, HAS_TOPK_LEN=False, SPLIT=split,
                             FP32=False, PAGED=bool(cfg.get("PAGED")) and not sparse and PAGE % bn == 0,
                             V_EARLY=bool(cfg.get("V_EARLY")), ROWS_AHEAD=sparse and bool(cfg.get("ROWS_AHEAD")))
                sig = {n: "constexpr" if n in const else ptrs.get(n, "fp32" if n == "qk_scale" else "i32")
                       for n in names}
                attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
                         if n not in const and (n in ptrs or (n.startswith("s_") and not n.endswith(("h", "t")))
                                                )}
                try:
                    src = ASTSource(kern, sig, constexprs={(names.index(n),): v for n, v in const.items()},
                                    attrs=attrs)
                    c = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                       options=dict(num_warps=cfg["num_warps"], num_stages=st))
                    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
                        f.write(c.asm["cubin"])
                    out = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", f.name],
                                         capture_output=True, text=True).stdout
                    usage = " ".join(x for x in out.split() if x.startswith(("REG:", "STACK:")))
                    print(f"{vn:<18}{wl:<5}BLOCK_N={bn} w={cfg['num_warps']} st={st}: smem={c.metadata.shared} "
                          f"{usage}", flush=True)
                except Exception as e:
                    print(f"{vn:<18}{wl:<5}FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", default="Q1,Q2,Q3,SQ1")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds of sweep wall time before skipping")
    ap.add_argument("--variants", default="", help="comma list of variant names (default: all)")
    ap.add_argument("--aot", action="store_true", help="no GPU: compile all variants for sm_90, print regs/spills")
    a = ap.parse_args()
    if a.aot:
        aot_report()
    else:
        sweep([n for n in a.sweep.split(",") if n], budget_s=a.budget,
              variants=set(x for x in a.variants.split(",") if x) or None)
