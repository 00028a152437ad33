"""MLA absorb-path decode (h_q 128, latent 512 + rope 64, page 64, bf16): dense M1-M4, sparse SM1/SM2 (topk 2048).

``python -m bench.run --op mla`` times gqla_triton, FlashMLA (dense legacy SM90 kernel; sparse bf16 kernel) and a
torch bmm reference. ``python -m bench.mla --sweep M1,M2,M4,SM1`` times the kernel variants in ``VARIANTS`` (through
``GQLA_TRITON_CONFIG``; compiled first in parallel worker processes, then timed in one process, stopping at
``--budget`` seconds) and prints a table plus ``BEST {...}``: the config per workload to paste into h200.json.
``python -m bench.mla --aot`` needs no GPU: it compiles the
kernel for sm_90 and prints shared memory, registers, spill stack and whether the key tiles are cp.async-pipelined.
"""

from __future__ import annotations

import json
import os
import re
import sys

import torch

from bench.common import time_graph_ms, time_ms, try_import
from gqla_triton.roofline import MLA_WORKLOADS, mla_decode_model

H, R, DR, PAGE = 128, 512, 64, 64
# the roofline's workload table, in this module's names (B batch, S cached tokens)
WORKLOADS = {k: dict(B=w["batch"], S=w["seqlen"], s_q=w["s_q"], **({"topk": w["topk"]} if "topk" in w else {}))
             for k, w in MLA_WORKLOADS.items()}


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


def run(names, ctx, anchors=True):
    from gqla_triton import mla_decode

    fm = try_import("flash_mla") if anchors else None
    scale = (R + DR) ** -0.5
    for name in names:
        w = WORKLOADS[name]
        q, kv, bt, lens, idx = make_inputs(w["B"], w["S"], w["s_q"], w.get("topk"))
        flops, nbytes = _counts(w)
        ours = lambda: mla_decode(q, kv, bt, lens, head_dim_v=R, softmax_scale=scale, causal=True,  # noqa: E731
                                  indices=idx)
        ours()
        graph_ms = None
        try:
            graph_ms = time_graph_ms(ours)
        except Exception as e:
            print(f"[bench.mla] {name}: CUDA graph timing failed: {type(e).__name__}: {e}", file=sys.stderr)
        ctx.row("mla", name, "gqla_triton", time_ms(ours), flops=flops, nbytes=nbytes, graph_ms=graph_ms)
        if not anchors:
            continue
        sparse = idx is not None
        for impl, build in (
            ("flash_mla", (lambda: _flash_mla_sparse(fm, q, kv, bt, idx, scale)) if sparse
             else (lambda: _flash_mla_dense(fm, q, kv, bt, lens, scale, w["s_q"] > 1))),
            ("torch_bmm", (lambda: _torch_sparse(q, kv, bt, idx, scale)) if sparse
             else (lambda: _torch_dense(q, kv, bt, lens, scale))),
        ):
            ms = None
            try:
                if impl == "flash_mla" and fm is None:
                    raise RuntimeError("flash_mla not importable")
                ms = time_ms(build())
            except Exception as e:  # a failing anchor records None, never kills the run
                print(f"[bench.mla] anchor {impl} on {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
            ctx.row("mla", name, impl, ms, flops=flops, nbytes=nbytes)
            torch.cuda.empty_cache()
        q = kv = bt = lens = idx = None  # free the inputs before the next workload
        torch.cuda.empty_cache()


# Kernel variants (config fields of the "mla_decode" entry; GQLA_TRITON_CONFIG switches them without code edits):
#   paged_tiles: dense tiles inside one page: one scalar block-table load per tile, contiguous rows (no per-token
#                gather). Predicted: fewer address registers/instructions, same bytes; helps most at BLOCK_N 64.
#   dv_split 2:  two programs per row tile, each owning 256 of the 512 value columns (acc 64x256 fp32 instead of
#                64x512: no spills) but both computing S in full (QK^T flops twice: 1.5x total flops). Doubles
#                the grid, so fewer KV splits are needed for small batches.
#   transposed:  S^T = K.Q^T and O^T += V^T.P^T: Q becomes the wgmma B operand (shared memory) instead of an A
#                operand held in registers (64x576 bf16 = 144 regs/thread per warpgroup: the spill source of
#                "base"). Predicted: the largest win (no spills at BLOCK_N 64), if Triton keeps V^T in smem.
VARIANTS = {  # timing order: most promising first (a budget stop drops the tail)
    "h128dv2": dict(BLOCK_H=128, BLOCK_N=32, num_warps=8, num_stages=2, paged_tiles=True, dv_split=2),  # sessions 2-6
    # 64 keys per tile (QKᵀ at 32 keys per warpgroup's N -> 64), one stage: Q 147 KB + K 74 KB of shared memory
    "h128dv2n64": dict(BLOCK_H=128, BLOCK_N=64, num_warps=8, num_stages=1, paged_tiles=True, dv_split=2),
    # carry_p: P·V one iteration late, so S is split over both warpgroups (no duplicated QKᵀ, no dv split)
    # p_scratch (session 6; committed since session 7): P and alpha through a double-buffered global scratch tile,
    # ordered by an inline-asm bar.sync (tl.debug_barrier in the loop stops the pipeliner). sm_90 compile: S at
    # warpsPerCTA [4, 2] (keys split over the warpgroups: no duplicated QKᵀ, no dv split), K tiles async. ps64s2:
    # 32 keys per warpgroup, 224 KB of shared memory, 255 registers, no spill (split) / 112 B of stack (unsplit);
    # ps32s2: 16 keys, 148 KB, 251 registers
    "ps64s2": dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=2, paged_tiles=True, p_scratch=True, dv_split=1),
    "ps32s2": dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=2, paged_tiles=True, p_scratch=True, dv_split=1),
    # sparse: rows pre-translated by sparse_rows (every variant since session 7); rows_ahead loads the next tile's
    # row indices one iteration ahead
    "ps64s2ra": dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=2, paged_tiles=True, p_scratch=True,
                     dv_split=1, rows_ahead=True),
    # session 8: the sm_90 SASS of ps64s2 / ps64s2 (sparse) issues the next K tile's cp.async after the P·V wgmma
    # and waits for it at the top of the next iteration (DEPBAR.LE 0): no load overlaps any compute. With the
    # block-table entry (dense) or row indices (sparse) carried one tile ahead, 32-key tiles get a real prefetch:
    # 3 stages wait with one tile in flight (DEPBAR.LE 2, 188 KB), 4 stages with two (DEPBAR.LE 4, 225 KB); no
    # spills. 64-key tiles fit two stages only (no prefetch); loading two tiles ahead stops the pipeliner. Measured
    # (sweep at c3291c2): M1 0.631 / 0.654 ms against ps64s2's 0.562: the per-tile fixed cost dominates (NOTES.md)
    "ra32s3": dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=3, paged_tiles=True, p_scratch=True,
                   dv_split=1, rows_ahead=True),
    "ra32s4": dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=4, paged_tiles=True, p_scratch=True,
                   dv_split=1, rows_ahead=True),
    # session 7: ps64s2 measured 0.588 ms at M1 (h128dv2 0.713) and became the committed config. Four warpgroups:
    # 128 registers (acc 64 of them), 16 keys of S each; sm_90 compile spills 72-216 B. (128-key tiles, one stage,
    # spilled 470-620 B at 8 or 16 warps: not kept.)
    "ps64s2w16": dict(BLOCK_H=64, BLOCK_N=64, num_warps=16, num_stages=2, paged_tiles=True, p_scratch=True,
                      dv_split=1),
    "cp32s2": dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=2, paged_tiles=True, carry_p=True, dv_split=1),
    "cp32s3": dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=3, paged_tiles=True, carry_p=True, dv_split=1),
    "cp16s4": dict(BLOCK_H=64, BLOCK_N=16, num_warps=8, num_stages=4, paged_tiles=True, carry_p=True, dv_split=1),
    # Sᵀ [128 keys, 32 heads] fills 8 warps along M: QKᵀ is not duplicated (see NOTES.md); 4 programs per batch
    # entry share each K tile through L2. One stage only: two would need 340 KB of shared memory
    "t128h32": dict(BLOCK_H=32, BLOCK_N=128, num_warps=8, num_stages=1, transposed=True),
    "base": dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=2),  # session-1 h200 config
    "t32dv2": dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=2, paged_tiles=True, transposed=True,
                   dv_split=2),
    "t32s2": dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=2, paged_tiles=True, transposed=True),
    "dv2pg32": dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=2, paged_tiles=True, dv_split=2),
    # 114 KB smem: two CTAs fit one SM if registers are capped at 128
    "t32dv2r128": dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=2, paged_tiles=True, transposed=True,
                       dv_split=2, maxnreg=128, ctas_per_sm=2),
    "pg32": dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=2, paged_tiles=True),
    "dv2": dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=2, dv_split=2),
    "t32s3": dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=3, paged_tiles=True, transposed=True),
    "pg64s1": dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=1, paged_tiles=True),
    "pg64s2": dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=2, paged_tiles=True),
    "dv2pg64": dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=2, paged_tiles=True, dv_split=2),
    "dv2w4": dict(BLOCK_H=64, BLOCK_N=32, num_warps=4, num_stages=2, paged_tiles=True, dv_split=2),
    "t64s1": dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=1, paged_tiles=True, transposed=True),
    "t64s2": dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=2, paged_tiles=True, transposed=True),
    "t32dv2w4": dict(BLOCK_H=64, BLOCK_N=32, num_warps=4, num_stages=2, paged_tiles=True, transposed=True,
                     dv_split=2),
    "t32h128dv2": dict(BLOCK_H=128, BLOCK_N=32, num_warps=8, num_stages=2, paged_tiles=True, transposed=True,
                       dv_split=2),
    "t64dv2": dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=2, paged_tiles=True, transposed=True,
                   dv_split=2),
    "t64dv2s1": dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=1, paged_tiles=True, transposed=True,
                     dv_split=2),
    "t64h32": dict(BLOCK_H=32, BLOCK_N=64, num_warps=4, num_stages=2, transposed=True, paged_tiles=True),
}


# compile with register spills on sm_90 (bench.mla --aot): timed only when named in --variants
SPILLING = ("t64h32", "pg64s1", "pg64s2", "dv2pg64", "t64s1", "t64s2", "t64w4", "t64dv2", "t64dv2s1", "t32dv2w4",
            "t32h128dv2", "dv2w4", "ps64s2w16")


def _warm(vn, names):
    """Compile one variant's kernels (dense/sparse x split/unsplit) on small inputs of the same specialisation,
    filling Triton's on-disk cache (run in parallel worker processes before the timed loop)."""
    os.environ["GQLA_TRITON_CONFIG"] = json.dumps({"mla_decode": VARIANTS[vn]})
    from gqla_triton import mla_decode

    for name in names:
        w = WORKLOADS[name]
        q, kv, bt, lens, idx = make_inputs(2, w["S"], w["s_q"], w.get("topk"))
        for ns in (1, 2):
            mla_decode(q, kv, bt, lens, head_dim_v=R, softmax_scale=(R + DR) ** -0.5, indices=idx, num_splits=ns)
    torch.cuda.synchronize()
    return vn


def precompile(names, variants, workers=8, timeout_s=100.0):
    import multiprocessing as mp
    import time
    from concurrent.futures import ProcessPoolExecutor

    from bench.mla import _warm as warm  # by module name (picklable also when this file runs as __main__)

    t0 = time.time()
    ex = ProcessPoolExecutor(max_workers=max(1, min(workers, len(variants))), mp_context=mp.get_context("spawn"))
    futs = {v: ex.submit(warm, v, names) for v in variants}
    for v, f in futs.items():
        try:
            f.result(timeout=max(1.0, timeout_s - (time.time() - t0)))
        except Exception as e:  # a failed/slow warm-up only means that variant compiles in the timed loop
            print(f"precompile {v}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    ex.shutdown(wait=False, cancel_futures=True)
    print(f"precompiled {len(variants)} variants in {time.time() - t0:.0f}s", flush=True)


def sweep(names, variants=None, splits=(0,), budget_s=150.0, workers=8):
    """Time every variant on every workload in one process (CUDA graph of 10 calls, median of 5); prints one
    line per run, a table (ms) and the best variant per workload as JSON for h200.json. Stops timing (prints
    SKIPPED) once ``budget_s`` of wall time is spent."""
    import time

    from gqla_triton import mla_decode

    variants = variants or [v for v in VARIANTS if v not in SPILLING]
    scale = (R + DR) ** -0.5
    t0 = time.time()
    if workers > 0:
        precompile(names, variants, workers)
    table = {}
    inputs, refs = {}, {}
    for name in names:  # all workloads resident (~3 GB): variants run in the outer loop, so a budget stop
        w = WORKLOADS[name]  # drops whole variants (the least promising come last), never whole workloads
        inputs[name] = make_inputs(w["B"], w["S"], w["s_q"], w.get("topk"))
        q, kv, bt, lens, idx = inputs[name]
        refs[name] = mla_decode(q, kv, bt, lens, head_dim_v=R, softmax_scale=scale, indices=idx)[0].float()
    for vn in variants:
        cfg = VARIANTS[vn]
        os.environ["GQLA_TRITON_CONFIG"] = json.dumps({"mla_decode": cfg})
        for name in names:
            q, kv, bt, lens, idx = inputs[name]
            ref = refs[name]
            flops, _ = _counts(WORKLOADS[name])
            for ns in splits:
                key = vn if ns == 0 else f"{vn}/s{ns}"
                if time.time() - t0 > budget_s:
                    print(f"{name} {key}: SKIPPED (budget)", flush=True)
                    continue
                try:
                    fn = lambda: mla_decode(q, kv, bt, lens, head_dim_v=R, softmax_scale=scale,  # noqa: E731
                                            indices=idx, num_splits=ns)
                    err = float((fn()[0].float() - ref).norm() / ref.norm())  # vs the committed config's output
                    ms = time_graph_ms(fn, replays=10, reps=5)
                    if err <= 1e-2:  # bf16 rounding differs between variants: ~3e-3; a wrong kernel is O(1)
                        table.setdefault(name, {})[key] = ms
                    print(f"{name} {key} {json.dumps(cfg)}: {ms:.4f} ms {flops / ms / 1e9:.0f} TFLOP/s "
                          f"rel_err_vs_base={err:.1e}{'' if err <= 1e-2 else ' WRONG (excluded)'} "
                          f"[{time.time() - t0:.0f}s]", flush=True)
                except Exception as e:
                    print(f"{name} {key}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            torch.cuda.empty_cache()
    os.environ.pop("GQLA_TRITON_CONFIG", None)
    inputs = refs = None
    torch.cuda.empty_cache()
    keys = list(dict.fromkeys(k for row in table.values() for k in row))
    print("\nms".ljust(6) + "".join(f"{k:>12}" for k in keys))
    for name in names:
        row = table.get(name, {})
        print(name.ljust(5) + "".join(f"{row[k]:12.4f}" if k in row else f"{'-':>12}" for k in keys))
    best = {}
    for name, row in table.items():
        k = min(row, key=row.get)  # noqa: B023
        best[name] = dict(variant=k, ms=round(row[k], 4), config=VARIANTS[k.split("/")[0]])
    print("BEST " + json.dumps(best))


def aot_report(variants=None):
    """Compile for sm_90 without a GPU (ptxas/cuobjdump from Triton's wheel); one line per config and mode."""
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gqla_triton.ops.mla.decode import mla_decode_fwd_kernel as kern

    names = kern.arg_names
    ptrs = {"q": "*bf16", "kv": "*bf16", "block_table": "*i32", "seqlens": "*i32", "indices": "*i32",
            "topk_length": "*i32", "out": "*bf16", "lse": "*fp32", "o_part": "*fp32", "lse_part": "*fp32",
            "pbuf": "*bf16", "abuf": "*fp32"}
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for vn in variants or VARIANTS:
        v = VARIANTS[vn]
        bh, bn, warps, stages = v["BLOCK_H"], v["BLOCK_N"], v["num_warps"], v["num_stages"]
        for sparse, split in ((False, True), (False, False), (True, True)):
            const = dict(DV=R, DR=DR, BDV=R, BDR=DR, PAGE_SIZE=PAGE, BLOCK_H=bh, BLOCK_N=bn,
                         SPARSE=sparse, HAS_TOPK_LEN=sparse, SPLIT=split, DOT_PREC="tf32",
                         PAGED_TILES=bool(v.get("paged_tiles")) and not sparse and PAGE % bn == 0,
                         DV_SPLIT=v.get("dv_split", 1), TRANS=bool(v.get("transposed")),
                         CARRY_P=bool(v.get("carry_p")), P_SCRATCH=bool(v.get("p_scratch")),
                         ASM_SYNC=True, ROWS_AHEAD=sparse and bool(v.get("rows_ahead")))
            opts = dict(num_warps=warps, num_stages=stages)
            if v.get("maxnreg"):
                opts["maxnreg"] = v["maxnreg"]
            sig = {n: "constexpr" if n in const else ptrs.get(n, "fp32" if n == "qk_scale" else "i32")
                   for n in names}
            # strides and pointers are multiples of 16 in practice: the launcher's specialisation sees that too
            attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
                     if n not in const and (n in ptrs or n.startswith("s_"))}
            try:
                src = ASTSource(kern, sig, constexprs={(names.index(n),): v for n, v in const.items()}, attrs=attrs)
                c = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                   options=opts)
                with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
                    f.write(c.asm["cubin"])
                res = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                                     text=True).stdout
                usage = " ".join(x for x in res.split() if x.startswith(("REG:", "STACK:")))
                piped = any("async_copy_global_to_local" in ln and "k_lat" in ln for ln in c.asm["ttgir"].splitlines())
                mma = r"nvidia_mma<{[^}]*warpsPerCTA = \[(\d+, \d+)\], instrShape = \[(\d+, \d+)"
                layouts = sorted(set(re.findall(mma, c.asm["ttgir"])))
                print(f"{vn} BLOCK_H={bh} BLOCK_N={bn} warps={warps} stages={stages} sparse={sparse} split={split}: "
                      f"smem={c.metadata.shared} {usage} k_tiles_async={piped} mma_warps={layouts}", flush=True)
            except Exception as e:
                print(f"{vn} sparse={sparse}: FAILED "
                      f"{type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", default="M1,M2,SM1", help="comma list of workloads to sweep configs on")
    ap.add_argument("--variants", default="", help="comma list of VARIANTS names (default: all)")
    ap.add_argument("--splits", default="0", help="comma list of num_splits to time (0 = automatic)")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds of wall time before timing stops")
    ap.add_argument("--workers", type=int, default=8, help="parallel compile processes before timing (0: none)")
    ap.add_argument("--aot", action="store_true", help="no GPU: compile for sm_90 and print resource usage")
    args = ap.parse_args()
    vs = [v for v in args.variants.split(",") if v] or None
    if args.aot:
        aot_report(vs)
    else:
        sweep([n for n in args.sweep.split(",") if n], vs, tuple(int(x) for x in args.splits.split(",")), args.budget,
              args.workers)
