"""Where ``gq.chunk_gated_delta_rule`` loses precision: each output and gradient against the float64 recurrence,
for the table config and config variants, next to the same computation in torch at the same precision
(``chunk_gated_delta_rule_ref(compute_dtype=...)``, the tests' low-precision yardstick).

    python -m tools.precision_gdn [--T 128] [--decay strong|mild] [--seeds 4] [--dtype bfloat16]
                                  [--config 'name={"wy_prec": "ieee"}']

Runs on the GPU (the CPU interpreter computes bf16 wrongly and cannot stand in; ``--device cpu --dtype float16``
under ``TRITON_INTERPRET=1`` only checks the script). Prints one line per (seed, variant): relative
errors of o, the final state, the six gradients, and of ``sum(dg * g)`` (the layer's A_log gradient is that sum,
summed over tokens with cancellation). Inputs are bf16-rounded first, so the float64 reference sees the same values.
"""

from __future__ import annotations

import argparse

import torch

import gqla_triton as gq
from gqla_triton.dispatch import config_override
from tools._common import parse_configs, reference

chunk_gated_delta_rule_ref = reference("chunk_gated_delta_rule_ref")
recurrent_gated_delta_rule_ref = reference("recurrent_gated_delta_rule_ref")

NAMES = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta")
VARIANTS = {  # gdn_chunk config fields over the GPU's table entry
    "table": {},
    "wy_ieee": {"wy_prec": "ieee"},  # the WY block inverse in fp32 FMA instead of tf32 dots
    "no_trans": {"wy_bwd_trans": False, "grad_trans": False},
}


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _inputs(seed, T, H, HV, K, V, decay, dt, dev):
    g0 = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(1, T, H, K, device=dev, generator=g0).to(dt)
    k = torch.randn(1, T, H, K, device=dev, generator=g0).to(dt)
    v = torch.randn(1, T, HV, V, device=dev, generator=g0).to(dt)
    a = torch.randn(1, T, HV, device=dev, generator=g0)
    if decay == "strong":  # the module's initialisation: g = -exp(A_log)·softplus(a + dt_bias), A in [1, 16]
        A = torch.empty(HV, device=dev).uniform_(1, 16, generator=g0)
        g = -A * torch.nn.functional.softplus(a + 0.5)
    else:
        g = torch.nn.functional.logsigmoid(a) / 8
    beta = torch.sigmoid(torch.randn(1, T, HV, device=dev, generator=g0))
    do = torch.randn(1, T, HV, V, device=dev, generator=g0).to(dt)
    dht = torch.randn(1, HV, K, V, device=dev, generator=g0)
    return [q, k, v, g.float(), beta.float()], do, dht


def _run(fn, xs, do, dht, **kw):
    xs = [x.detach().clone().requires_grad_() for x in xs]
    o, ht = fn(*xs, output_final_state=True, **kw)
    torch.autograd.backward([o, ht], [do.to(o.dtype), dht.to(ht.dtype)])
    return [o, ht] + [x.grad for x in xs]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=128)
    ap.add_argument("--H", type=int, default=1)
    ap.add_argument("--HV", type=int, default=1)
    ap.add_argument("--decay", default="strong", choices=("strong", "mild"))
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda", help="cpu only to check the script under TRITON_INTERPRET=1")
    ap.add_argument("--config", action="append", default=[], help="extra variant: JSON fields or name=JSON")
    args = ap.parse_args()
    variants = {**VARIANTS, **parse_configs(args.config)}
    dt = getattr(torch, args.dtype)
    K = V = 128
    print("variant     " + " ".join(f"{n:>8s}" for n in NAMES) + "  sum(dg*g)")
    for seed in range(args.seeds):
        xs, do, dht = _inputs(seed, args.T, args.H, args.HV, K, V, args.decay, dt, args.device)
        kw = dict(use_qk_l2norm=True)
        ref = _run(recurrent_gated_delta_rule_ref, [x.double() for x in xs], do.double(), dht.double(), **kw)
        low = _run(chunk_gated_delta_rule_ref, [x.float() for x in xs], do.float(), dht.float(), compute_dtype=dt,
                   **kw)
        g = xs[3].double()

        def line(name, out):
            s_ref = float((ref[5] * g).sum())
            s = float((out[5].double() * g).sum())
            errs = " ".join(f"{_rel(a, b):8.2e}" for a, b in zip(out, ref, strict=False))
            print(f"{name:11s} {errs}  {abs(s - s_ref) / max(abs(s_ref), 1e-300):.2e}", flush=True)

        print(f"seed {seed} (T {args.T}, decay {args.decay})")
        line("torch_lowp", low)
        for vname, fields in variants.items():
            with config_override({"gdn_chunk": fields} if fields else {}):
                line(vname, _run(gq.chunk_gated_delta_rule, xs, do, dht, use_qk_l2norm_in_kernel=True))


if __name__ == "__main__":
    main()
