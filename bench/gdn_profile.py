"""Per-kernel time of the chunked GDN forward + backward, over a few launch-config variants (H200 tuning aid).

``python -m bench.gdn_profile [--workload G1] [--variants 6]``. Variant i gives each kernel its i-th option
(``OPTIONS``); as every kernel's time is read separately from the profiler, one run per variant tunes all
kernels at once. The variants are compiled in parallel processes first (Triton's disk cache), then timed one
after another with ``torch.profiler`` (the mean over ``--iters`` fwd+bwd calls), each in its own process (a
variant that faults is re-run with CUDA_LAUNCH_BLOCKING=1 to name the kernel). Outputs are compared with the
committed config (max relative error), so a fast but wrong variant shows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor

import torch

# option lists per config field (index i = variant i; shorter lists wrap around); variant 0 = the committed
# H200 entry for K = V = 128. Fields are "<kernel>_<field>" (gqla_triton.ops.gdn.chunk.KERNELS).
# (session 4) variant 0 = the committed entry; the others move each kernel around it and try sequence splitting
# (seg_units 64 / 128 / 256 -> 8 / 16 / 32 segments per sequence at G5, whose 8 units are below seg_below 16;
# session 4 at G5: 64 best, 2 segments at G1 were slower than none). State passes at one
# stage with BV <= 32 and 4 warps faulted (illegal address) on Triton 3.6 in session 3's profile: not listed.
OPTIONS = {
    # session 6: ncu at G1 showed the wy kernel L1/shared-memory bound (88 % of L1 throughput: the fp32 FMA dots'
    # operand layouts go through shared memory); fla's fused kkt + solve (0.355 vs our 0.532 ms) does its block
    # merges in tf32. Measured at G1: ieee 2 warps 0.531, tf32 2 warps 0.297, tf32 1 warp 0.176, tf32x3 0.604 ms
    # (sm_90 compile: 1 warp ieee spills 556 B)
    "wy_BK": [64], "wy_warps": [1], "wy_stages": [3],
    "wy_prec": ["tf32"],
    # wy_fuse 1: no gdn_wu_fwd_kernel in the forward (the wy row then holds both): compare wy + wu sums by hand.
    # Session 5 at G1: 0.843 vs 0.534 + 0.337 ms
    "wy_fuse": [0],
    "wu_BK": [64], "wu_BV": [64], "wu_warps": [4], "wu_stages": [3],
    # session 6 at G1 (BV narrowed to 32 by _state_bv, 128 programs): 2 stages and 8 warps were slower than 3 stages;
    # fla's h kernel (the same tiles at 4 stages: 156 KB of shared memory, as our sm_90 compile) took 0.631 vs our
    # 0.736 under ncu; our 4 stages: 0.709 vs 0.722 at G1, 0.580 vs 0.553 at G4 (profile s6)
    # session 10: BV 16 (256 programs at G1, two per SM; sm_90: 109 KB / 96 registers at 3 stages, 74 KB at 2) was
    # slower than BV 32 (what _state_bv narrows 64 to at G1: 128 programs, one per SM): 0.851 / 0.870 vs 0.724 ms
    "state_BV": [64], "state_warps": [4], "state_stages": [3],
    "seg_units": [64], "seg_min": [16], "seg_BV": [64], "seg_warps": [4], "seg_stages": [2],
    # out_fuse 1: the forward's output is computed in its state pass (no gdn_output_fwd_kernel; the fused pass takes
    # the out_BV / out_warps / out_stages fields and counts under gdn_state_fwd_kernel). sm_90 compile at BV 32
    # (what _state_bv narrows G1 to): 4 warps / 3 stages 212 B spills, 8 warps / 2 stages 80 B, BV 16 none
    # (session 5 at G1: 9.81-10.19 vs 8.46 ms per fwd + bwd, see NOTES.md)
    "out_fuse": [0],
    # session 10 at G1: out_BV 64 0.552 vs 0.477 ms
    # session 11: *_early 1 loads v_new / dO and gc before the K loop (sm_90: output 115 KB of shared memory, 231
    # registers; dv_local 66 KB, 154; no spills). Run 4 at G1: output 0.497 -> 0.433, dv_local 0.371 -> 0.290 ms
    # (0.478 / 0.329 in runs 1-3, with the late loads' original order): the H200 entry since
    "out_BK": [64], "out_BV": [128], "out_warps": [4], "out_stages": [3], "out_early": [1],
    "dvl_BK": [64], "dvl_BV": [128], "dvl_warps": [4], "dvl_stages": [3], "dvl_early": [1],
    # session 6 at G1: 4 warps / 2 stages 1.12, 8 / 2 1.32, 8 / 3 0.97 vs 4 / 3 0.86 ms
    # session 9: dv_local computed inside the reverse pass (its q kᵀ off the dS chain) spilled 48 B at 4 warps / 3
    # stages, 28 B at 8 warps (sm_90) and took 2.45 / 2.93 ms at G1 against 1.42 + 0.33 (dv_local): removed.
    # BV 16 (256 programs at G1; 4 warps / 2 stages: 109 KB of shared memory, 166 registers) lets two share an SM:
    # 1.363 ms against 1.417 at BV 32 / 3 stages and 1.696 at BV 16 / 3 stages (one per SM; session 9, G1)
    # session 11: BV 32 / 4 warps / 3 stages was 0.86 ms in sessions 5-7 (f378e89, the same sm_90 footprint as now:
    # 196 registers, 177 KB); the 1.42 of session 9 at that config had 7516da7's Σ h⊙dh inside, since removed
    # (run 1 at G1: BV 32 / 4 warps / 3 stages 0.841 ms, against 1.219 at BV 16 / 4 / 2, 0.996 at 32 / 8 / 3, 1.160 at
    # 32 / 4 / 2, 1.333 at 32 / 8 / 2: the first is the H200 entry since; h200-gdn-profile-s11.json)
    "state_bwd_BV": [32], "state_bwd_warps": [4], "state_bwd_stages": [3],
    # session 10: dg's Σ h⊙dh back in grad_chunk (from the stored bf16 dh, own h / dh loads): state_bwd 1.218 vs
    # 1.328 ms (run 6). The module-test example 7516da7 moved it into state_bwd for (A_log, B1 T128 varlen seed
    # 4932) fails either way (bench/alog_example.py: rel err 1.469e-2 both), precision_gdn did not move (run 5)
    # session 6 tried grad_chunk in K slices (one program per 64 / 32 columns of K, the [BT, BT] products recomputed
    # per slice): at G1 BK 64 / 8 warps 2.59 (3 stages) / 2.94 (2), BK 32 / 4 warps 2.93 ms, and the full-K kernel of
    # that version (an extra q kᵀ loop) 2.00 vs 1.80 ms; reverted (h200-gdn-profile-s6-bwd.json)
    # session 11: grad_early 1 loads q and k before the V loop (sm_90: 254 registers, no spills, 205 KB of shared
    # memory at 3 stages; with gc also early it spilled 112 B)
    # (run 2 at G1: early 1.636 vs 1.758 ms at 3 stages, 1.756 at 2 stages: the H200 entry since)
    # session 11: grad_late / wy_bwd_late 1: in the GVA running sums the first value head passes its sum on before
    # its other work and the later ones wait after theirs (wy_bwd: the dv loop), instead of rank 1 waiting for rank
    # 0's whole dk loop (wy_bwd) or its end (grad)
    # (run 3 at G1: grad 1.645 -> 1.583, wy_bwd 1.580 -> 1.523 ms, kernel sum 6.103 -> 5.977; bitwise identical over
    # determinism_gdn's 8 reps: the H200 entry since. At K = 256 grad_late spills 2.3 KB (736 B without): not there)
    "grad_BV": [64], "grad_warps": [8], "grad_stages": [3], "grad_early": [1], "grad_late": [1],
    # wy_bwd at BK 16 (4 and 8 warps) and at BK 64 / BV 32 / 4 warps faulted (illegal address) at G1 on Triton 3.6
    # (session 5); BK 32 / BV 64 / 4 warps was the fastest (2.04 vs 2.25 ms at BV 32).
    # It stays at one stage: pipelined, its dbeta/dg differed run to run on Triton 3.6 (bench.determinism_gdn)
    # session 6 at G1: 8 warps 3.69 (BV 64) / 4.10 ms (BV 32) vs 4 warps 2.04 (h200-gdn-profile-s6-bwd.json)
    # session 9: with the transposed dk term and k kᵀ from its own load, bench.determinism_gdn's wy_bwd_2st and
    # wy_bwd_3st variants were bitwise identical over 5 repetitions at every shape (sm_90: 2 stages 41 KB / 255
    # registers, 3 stages 57 KB / 254). G1: 1 stage 1.79, 2 stages 1.79, 3 stages 1.67 ms: 3 in the H200 table
    # session 10: the GVA dk sum's wait and barrier moved out of the dk loop, which Triton 3.6 then pipelines
    # (sm_90: k, kᵀ, dw through cp.async; before, every load of that loop was a plain load it waited for)
    # (G1: 1.669 -> 1.599 ms; 2 stages 1.817, BV 32 1.753). With that loop pipelined, BK 64 at 8 warps (sm_90: 252
    # registers, no spills, 98 KB: one program per SM) halves both K loops' trip counts
    # (session 10: 2.61 vs 1.62 ms)
    # session 11 (sm_90 compile): BV 128 255 registers / 53 KB, no spills; BK 64 / BV 32 spills 140 B; 8 warps 251
    # registers; BV 32 / 4 stages 239 registers
    # (run 1 at G1: 1.614 ms at BK 32 / BV 64 / 4 warps / 3 stages; BV 128 1.643, BK 64 / BV 32 1.701, BV 32 / 4 stages
    # 1.712, 8 warps 3.171)
    "wy_bwd_BK": [32], "wy_bwd_BV": [64], "wy_bwd_warps": [4], "wy_bwd_stages": [3], "wy_bwd_late": [1],
    # next (session 7): dk's Mᵀ·k term as a transposed dot result: no dTT / dAT, 246 registers without spills
    # (sm_90 compile, vs 255 + 20 B), PTX 2613 vs 3235 instructions. Check it with the GPU tests first
    # (test_stage_variants; bench.determinism_gdn's bwd_trans). grad_trans likewise drops dPT: 4 of 36 wgmma fewer
    "wy_bwd_trans": [1], "grad_trans": [1],
}
NVARIANTS = max(len(v) for v in OPTIONS.values())


def variant(i: int) -> dict:
    return {k: v[i % len(v)] for k, v in OPTIONS.items()}


def _inputs(name, T=None, requires_grad=True):
    from bench.gdn import WORKLOADS, _inputs

    w = dict(WORKLOADS[name])
    if T is not None:
        w["T"] = T
        w.pop("cu", None)
    q, k, v, g, beta, cu = _inputs(w)
    xs = [t.detach().clone().requires_grad_(requires_grad) for t in (q, k, v, g, beta)]
    return xs, cu


def _fwd_bwd(xs, cu, do):
    from gqla_triton import chunk_gated_delta_rule

    o, ht = chunk_gated_delta_rule(*xs, output_final_state=True, cu_seqlens=cu)
    grads = torch.autograd.grad(o, xs, do)
    return o, ht, grads


def _compile(args):
    """Child process: run variant i once at a short length (same constexprs) to fill the disk cache."""
    i, name = args
    os.environ["GQLA_TRITON_CONFIG"] = json.dumps({"gdn_chunk": variant(i)})
    t0 = time.time()
    try:
        xs, cu = _inputs(name, T=256)
        _fwd_bwd(xs, cu, torch.randn_like(xs[2]))
        torch.cuda.synchronize()
        return i, f"compiled in {time.time() - t0:.0f}s"
    except Exception as e:
        return i, f"FAILED {type(e).__name__}: {str(e)[:200]}"


def _kernel_times(fn, iters):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = defaultdict(float)
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = e.cuda_time_total
        if t > 0:
            out[e.key] += t / iters / 1e3  # ms per call
    return dict(out)


def _one(i: int, name: str, iters: int) -> dict:
    """Time variant i (committed config when i < 0) in this process; outputs compared with the committed one."""
    xs, cu = _inputs(name)
    do = torch.randn_like(xs[2])
    ref = [t.detach() for t in _flat(_fwd_bwd(xs, cu, do))] if i >= 0 else None
    if i >= 0:
        os.environ["GQLA_TRITON_CONFIG"] = json.dumps({"gdn_chunk": variant(i)})
    flat = [t.detach() for t in _flat(_fwd_bwd(xs, cu, do))]
    torch.cuda.synchronize()
    err = 0.0 if ref is None else max(float((x - y).float().norm() / y.float().norm().clamp_min(1e-30))
                                      for x, y in zip(flat, ref, strict=True))
    return {"variant": i, "err": err, "kernels_ms": _kernel_times(lambda: _fwd_bwd(xs, cu, do), iters)}


def _flat(res):
    return [res[0], res[1], *res[2]]


def _save(a, table, errs, failed):
    """Results so far as JSON (a cut run keeps the variants it finished)."""
    if not a.out:
        return
    from bench.common import environment

    cfg = lambda i: variant(i) if i >= 0 else "committed"  # noqa: E731
    doc = {"env": environment(), "command": f"python -m bench.gdn_profile --workload {a.workload} --variants "
           f"{a.variants} --iters {a.iters}", "what": "mean ms per forward+backward call of each kernel under "
           "torch.profiler (gdn_state_fwd_kernel and gdn_wu_fwd_kernel run twice per call)",
           "variants": {i: {"config": cfg(i), "max_rel_err_vs_committed": errs[i], "total_ms": sum(t.values()),
                            "kernels_ms": t} for i, t in table.items()},
           "failed": {i: {"config": cfg(i), "error": e} for i, e in failed.items()}}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="G1")
    ap.add_argument("--variants", type=int, default=NVARIANTS)
    ap.add_argument("--out", default=None, help="results JSON, rewritten after every variant")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--one", type=int, default=None, help="(internal) time one variant, print a JSON line")
    a = ap.parse_args()
    if a.one is not None:
        print("RESULT " + json.dumps(_one(a.one, a.workload, a.iters)), flush=True)
        return
    t0 = time.time()
    ctx = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(a.procs, mp_context=ctx) as ex:
        for i, msg in ex.map(_compile, [(i, a.workload) for i in range(a.variants)]):
            print(f"variant {i}: {msg}", flush=True)
    print(f"[compile wall {time.time() - t0:.0f}s]", flush=True)
    table, errs, failed = {}, {}, {}
    for i in range(a.variants):  # variant 0 is the committed config
        # each variant in its own process: a crash (illegal address) must not end the others' CUDA context
        cmd = [sys.executable, "-m", "bench.gdn_profile", "--one", str(i), "--workload", a.workload,
               "--iters", str(a.iters)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        res = [json.loads(x[7:]) for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if not res:
            # name the failing kernel: launches made synchronous, the error surfaces at the faulting launch
            p2 = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, CUDA_LAUNCH_BLOCKING="1"))
            where = [x.strip() for x in p2.stderr.splitlines() if "kernel[" in x or "_kernel" in x or "Error" in x]
            failed[i] = where[-8:] or p.stderr.splitlines()[-5:]
            _save(a, table, errs, failed)
            print(f"variant {i} {json.dumps(variant(i)) if i >= 0 else 'committed'} FAILED:\n    "
                  + "\n    ".join(where[-8:] or p.stderr.splitlines()[-5:]), flush=True)
            continue
        r = res[0]
        table[i] = r["kernels_ms"]
        errs[i] = r["err"]
        _save(a, table, errs, failed)
        print(f"== variant {i} {json.dumps(variant(i)) if i >= 0 else 'committed'}  total "
              f"{sum(table[i].values()):.3f} ms  max rel err vs committed {r['err']:.2e}", flush=True)
        for k_, v_ in sorted(table[i].items(), key=lambda kv: -kv[1]):
            print(f"   {v_:8.3f} ms  {k_[:90]}", flush=True)
    # best variant per Triton kernel, and the config that takes each kernel's fields from its best variant
    from gqla_triton.ops.gdn.chunk import _DEFAULT_CFG, KERNELS

    best_cfg = {}
    for prefix, kname in KERNELS.items():
        # a kernel's variants (gdn_state_fwd_kernel_t for the state pass) count under its name
        cands = [(sum(v for k, v in t.items() if k.startswith(kname)), i) for i, t in table.items()
                 if any(k.startswith(kname) for k in t)]
        if not cands:
            continue
        ms, i = min(cands)
        print(f"BEST {kname:<24} {ms:.3f} ms variant {i}", flush=True)
        src = variant(i) if i >= 0 else {}
        best_cfg.update({f: src.get(f, _DEFAULT_CFG[f]) for f in _DEFAULT_CFG if f.startswith(prefix + "_")
                         and f[len(prefix) + 1:] in ("BK", "BV", "warps", "stages", "prec", "fuse")})
    print("SUGGESTED gdn_chunk config (K = V = 128): " + json.dumps(best_cfg), flush=True)
    print(f"[wall {time.time() - t0:.0f}s]")


if __name__ == "__main__":
    main()
