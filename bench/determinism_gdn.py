"""Run-to-run determinism of chunk_gated_delta_rule forward + backward on the GPU, per launch config.

``python -m bench.determinism_gdn [--reps 100] [--choose FILE]``: for each config variant and shape, repeats
one forward + backward on fixed inputs and counts the repetitions whose outputs or gradients differ bitwise from
the first (HV <= 2H, so no atomic-order effects are allowed). A miscompiled or racy kernel shows as a nonzero
count. Prints one line per (variant, shape) and exits 1 if any count is nonzero. With ``--choose`` the variants
are candidates in order: the first one without differences is written to FILE as a ``GQLA_TRITON_CONFIG`` JSON
object (and the rest are skipped).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import gqla_triton.ops.gdn.chunk as chunk_mod

VARIANTS = {
    "committed": {},
    "wy_bwd_2st": {"wy_bwd_stages": 2},
    "wy_bwd_3st": {"wy_bwd_stages": 3},
    "wy_bwd_1st": {"wy_bwd_stages": 1},
    "bwd_1st": {"wy_bwd_stages": 1, "grad_stages": 1},
    "split": {"seg_units": 1 << 20, "seg_below": 1 << 20, "seg_min": 1},
    "bwd_trans": {"wy_bwd_trans": 1, "grad_trans": 1},  # transposed dot results (fla #984's pattern family)
    "grad_early": {"grad_early": 1},  # q / k tiles loaded before grad_chunk's V loop, waiting in shared memory
    "late": {"grad_late": 1, "wy_bwd_late": 1},  # GVA sums: later value heads wait after their other work
}
CANDIDATES = ("committed", "wy_bwd_2st", "wy_bwd_1st", "bwd_1st")  # --choose: fixes in order of expected speed
SHAPES = [(1, 18, 1, 1), (1, 200, 1, 2), (2, 333, 2, 4), (1, 1024, 2, 2)]
NAMES = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def _once(xs, do, dht):
    xs = [x.detach().clone().requires_grad_() for x in xs]
    o, ht = chunk_mod.chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True)
    torch.autograd.backward([o, ht], [do, dht])
    return [o, ht] + [x.grad for x in xs]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--choose", default=None)
    args = ap.parse_args()
    base = chunk_mod._cfg
    bad = 0
    for vname, over in VARIANTS.items():
        if args.choose and vname not in CANDIDATES:
            continue
        vbad = 0
        chunk_mod._cfg = lambda K, V, device, over=over: dict(base(K, V, device), **over)
        for dname in args.dtypes.split(","):
            dt = getattr(torch, dname)
            for B, T, H, HV in SHAPES:
                g = torch.Generator(device="cuda").manual_seed(T)
                K = V = 128
                q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda", generator=g), dim=-1).to(dt)
                k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda", generator=g), dim=-1).to(dt)
                v = torch.randn(B, T, HV, V, device="cuda", generator=g).to(dt)
                gg = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device="cuda", generator=g)) / 4
                beta = torch.rand(B, T, HV, device="cuda", generator=g).to(dt)
                h0 = torch.randn(B, HV, K, V, device="cuda", generator=g) * 0.3
                do = torch.randn(B, T, HV, V, device="cuda", generator=g).to(dt)
                dht = torch.randn(B, HV, K, V, device="cuda", generator=g)
                xs = [q, k, v, gg, beta, h0]
                ref = _once(xs, do, dht)
                diff = {n: 0 for n in NAMES}
                for _ in range(args.reps):
                    for n, a, b in zip(NAMES, _once(xs, do, dht), ref, strict=True):
                        diff[n] += not torch.equal(a, b)
                nz = {n: c for n, c in diff.items() if c}
                vbad += bool(nz)
                print(f"{vname:14s} {dname:9s} B{B} T{T} H{H} HV{HV}: "
                      + (f"DIFFERS in {nz} of {args.reps} reps" if nz else f"identical over {args.reps} reps"),
                      flush=True)
        bad += vbad
        if args.choose and not vbad:
            with open(args.choose, "w") as f:
                json.dump({"gdn_chunk": over}, f)
            print(f"chose {vname}: {over}", flush=True)
            break
    chunk_mod._cfg = base
    sys.exit(1 if bad and not args.choose else 0)


if __name__ == "__main__":
    main()
