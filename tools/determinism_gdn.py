"""Run-to-run determinism of ``gq.chunk_gated_delta_rule`` forward + backward on the GPU, per launch config.

    python -m tools.determinism_gdn [--reps 100] [--dtypes bfloat16,float16] [--variants table,split]
                                    [--config 'name={"grad_num_stages": 2}'] [--choose FILE] [--infer]

For each config variant (``gdn_chunk`` fields applied with ``config_override``; ``table`` is the GPU's table
entry) and each shape (the kernels promise bitwise-identical results for every HV / H), repeats one forward +
backward on fixed inputs and counts the repetitions whose output, final state or any gradient (q, k, v, g, beta,
initial state) differs bitwise from the first. A miscompiled or racy kernel shows as a nonzero count. Prints one
line per (variant, dtype, shape); exits 1 if any count is nonzero. With ``--choose FILE`` the variants are tried
in order and the first without differences is written to FILE as a ``GQLA_TRITON_CONFIG`` object. ``--infer``:
the forward without autograd instead (the inference kernels: ``sout``, the Hopper Gluon kernel, the segment maps
formed from Ainv), its output and final state compared.
"""

from __future__ import annotations

import argparse
import json
import sys

VARIANTS = {
    "table": {},
    "grad_1st": {"grad_num_stages": 1},
    "split": {"seg_units": 1 << 20, "seg_below": 1 << 20, "seg_min": 1},  # every sequence split into segments
    "no_trans": {"wy_bwd_trans": False, "grad_trans": False},
    "no_early": {"grad_early": False, "out_early": False, "dvl_early": False},
    "no_late": {"grad_late": False, "wy_bwd_late": False},
}
# (B, T, H, HV); the last two put hundreds of programs on the GPU at once, where a race in a pipelined loop shows
SHAPES = [(1, 18, 1, 1), (1, 200, 1, 2), (2, 333, 2, 4), (1, 1024, 2, 2), (1, 700, 2, 6), (2, 500, 1, 4),
          (4, 2048, 8, 8), (2, 1024, 4, 8)]
NAMES = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def _once(xs, do, dht, infer=False):
    import torch

    import gqla_triton as gq

    if infer:
        with torch.no_grad():
            return list(gq.chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True))
    xs = [x.detach().clone().requires_grad_() for x in xs]
    o, ht = gq.chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True)
    torch.autograd.backward([o, ht], [do, dht])
    return [o, ht] + [x.grad for x in xs]


def _inputs(B, T, H, HV, dt):
    import torch

    g = torch.Generator(device="cuda").manual_seed(T)
    K = V = 128
    nrm = torch.nn.functional.normalize
    q = nrm(torch.randn(B, T, H, K, device="cuda", generator=g), dim=-1).to(dt)
    k = nrm(torch.randn(B, T, H, K, device="cuda", generator=g), dim=-1).to(dt)
    v = torch.randn(B, T, HV, V, device="cuda", generator=g).to(dt)
    gg = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device="cuda", generator=g)) / 4
    beta = torch.rand(B, T, HV, device="cuda", generator=g).to(dt)
    h0 = torch.randn(B, HV, K, V, device="cuda", generator=g) * 0.3
    do = torch.randn(B, T, HV, V, device="cuda", generator=g).to(dt)
    dht = torch.randn(B, HV, K, V, device="cuda", generator=g)
    return [q, k, v, gg, beta, h0], do, dht


def main(argv=None) -> int:
    import torch

    from gqla_triton.dispatch import config_override
    from tools._common import parse_configs

    ap = argparse.ArgumentParser(prog="python -m tools.determinism_gdn", description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--variants", default="", help="comma list of built-in variants (default: all)")
    ap.add_argument("--config", action="append", default=[], help="extra variant: JSON fields or name=JSON")
    ap.add_argument("--choose", default=None, help="write the first variant without differences here and stop")
    ap.add_argument("--infer", action="store_true", help="the forward without autograd (o and the final state)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("tools.determinism_gdn needs a CUDA GPU")
    plan = {v: VARIANTS[v] for v in ([x for x in a.variants.split(",") if x] or VARIANTS)}
    plan.update(parse_configs(a.config))
    bad = 0
    for vname, fields in plan.items():
        vbad = 0
        with config_override({"gdn_chunk": fields} if fields else {}):
            for dname in a.dtypes.split(","):
                dt = getattr(torch, dname)
                for B, T, H, HV in SHAPES:
                    xs, do, dht = _inputs(B, T, H, HV, dt)
                    ref = _once(xs, do, dht, a.infer)
                    names = NAMES[:2] if a.infer else NAMES
                    diff = dict.fromkeys(names, 0)
                    for _ in range(a.reps):
                        for n, x, y in zip(names, _once(xs, do, dht, a.infer), ref, strict=True):
                            diff[n] += not torch.equal(x, y)
                    nz = {n: c for n, c in diff.items() if c}
                    vbad += bool(nz)
                    print(f"{vname:12s} {dname:9s} B{B} T{T} H{H} HV{HV}: "
                          + (f"DIFFERS in {nz} of {a.reps} reps" if nz else f"identical over {a.reps} reps"),
                          flush=True)
        bad += vbad
        if a.choose and not vbad:
            with open(a.choose, "w") as f:
                json.dump({"gdn_chunk": fields}, f)
            print(f"chose {vname}: {fields}", flush=True)
            return 0
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
