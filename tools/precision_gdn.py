"""Where ``gq.chunk_gated_delta_rule`` loses precision: each output and gradient against the float64 recurrence,
for the table config and config variants, next to the same computation in torch at the same precision
(``chunk_gated_delta_rule_ref(compute_dtype=...)``, the tests' low-precision yardstick).

    python -m tools.precision_gdn [--T 128] [--decay strong|mild|weak|none] [--seeds 4] [--dtype bfloat16]
                                  [--inputs randn|correlated] [--h0] [--fla] [--config 'name={"wy_prec": "ieee"}']

``--inputs correlated`` draws fla's own test inputs: non-negative q, k (unit rows after the l2norm, so a chunk's
keys point nearly the same way and its WY system is ill-conditioned), v in [0, 1); ``--decay weak`` is
g = logsigmoid(U[0, 1))/10, ``none`` g = 0 (the state keeps growing); ``--h0`` adds a unit-scale initial state;
``--fla`` adds fla's forward (o and the final state; its backward refuses on Hopper with Triton < 3.7.1).
``infer`` / ``infer_sep``: o and the final state of the forward without gradient, through the fused inference pass
where the table picks it (``sout``) and through the separate kernels.

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


def _inputs(seed, T, H, HV, K, V, decay, dt, dev, inputs="randn"):
    g0 = torch.Generator(device=dev).manual_seed(seed)
    draw = torch.randn if inputs == "randn" else torch.rand
    q = draw(1, T, H, K, device=dev, generator=g0).to(dt)
    k = draw(1, T, H, K, device=dev, generator=g0).to(dt)
    v = draw(1, T, HV, V, device=dev, generator=g0).to(dt)
    a = draw(1, T, HV, device=dev, generator=g0)
    if decay == "strong":  # the module's initialisation: g = -exp(A_log)·softplus(a + dt_bias), A in [1, 16]
        A = torch.empty(HV, device=dev).uniform_(1, 16, generator=g0)
        g = -A * torch.nn.functional.softplus(a + 0.5)
    elif decay == "none":
        g = torch.zeros_like(a)
    else:
        g = torch.nn.functional.logsigmoid(a) / (8 if decay == "mild" else 10)
    beta = torch.sigmoid(draw(1, T, HV, device=dev, generator=g0))
    do = torch.randn(1, T, HV, V, device=dev, generator=g0).to(dt)
    dht = torch.randn(1, HV, K, V, device=dev, generator=g0)
    return [q, k, v, g.float(), beta.float()], do, dht


def _run(fn, xs, do, dht, h0=None, fwd_only=False, **kw):
    xs = [x.detach().clone().requires_grad_(not fwd_only) for x in xs]
    o, ht = fn(*xs, output_final_state=True, initial_state=h0, **kw)
    if fwd_only:
        return [o, ht]
    torch.autograd.backward([o, ht], [do.to(o.dtype), dht.to(ht.dtype)])
    return [o, ht] + [x.grad for x in xs]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=128)
    ap.add_argument("--H", type=int, default=1)
    ap.add_argument("--HV", type=int, default=1)
    ap.add_argument("--decay", default="strong", choices=("strong", "mild", "weak", "none"))
    ap.add_argument("--inputs", default="randn", choices=("randn", "correlated"))
    ap.add_argument("--h0", action="store_true", help="a unit-scale fp32 initial state")
    ap.add_argument("--fla", action="store_true", help="fla's forward too (FLA_DISABLE_BACKEND_DISPATCH=1)")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda", help="cpu only to check the script under TRITON_INTERPRET=1")
    ap.add_argument("--config", action="append", default=[], help="extra variant: JSON fields or name=JSON")
    args = ap.parse_args()
    variants = {**VARIANTS, **parse_configs(args.config)}
    dt = getattr(torch, args.dtype)
    K = V = 128
    print("variant     " + " ".join(f"{n:>8s}" for n in NAMES) + "  sum(dg*g)")
    fla = None
    if args.fla:
        import os

        os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla
    for seed in range(args.seeds):
        xs, do, dht = _inputs(seed, args.T, args.H, args.HV, K, V, args.decay, dt, args.device, args.inputs)
        gen = torch.Generator(args.device).manual_seed(seed)
        h0 = torch.randn(1, args.HV, K, V, device=args.device, generator=gen) if args.h0 else None
        kw = dict(use_qk_l2norm=True)
        ref = _run(recurrent_gated_delta_rule_ref, [x.double() for x in xs], do.double(), dht.double(),
                   h0=h0.double() if h0 is not None else None, **kw)
        low = _run(chunk_gated_delta_rule_ref, [x.float() for x in xs], do.float(), dht.float(), h0=h0,
                   compute_dtype=dt, **kw)
        g = xs[3].double()

        def line(name, out):
            s_ref = float((ref[5] * g).sum())
            s = float((out[5].double() * g).sum())
            errs = " ".join(f"{_rel(a, b):8.2e}" for a, b in zip(out, ref, strict=False))
            print(f"{name:11s} {errs}  {abs(s - s_ref) / max(abs(s_ref), 1e-300):.2e}", flush=True)

        print(f"seed {seed} (T {args.T}, decay {args.decay}, inputs {args.inputs})")
        line("torch_lowp", low)
        for vname, fields in variants.items():
            with config_override({"gdn_chunk": fields} if fields else {}):
                line(vname, _run(gq.chunk_gated_delta_rule, xs, do, dht, h0=h0, use_qk_l2norm_in_kernel=True))
        def fwd_line(name, out):
            print(f"{name:11s} " + " ".join(f"{_rel(a, b):8.2e}" for a, b in zip(out, ref, strict=False)), flush=True)

        # the forward without gradient: the fused pass (sout) where the table picks it, and the separate kernels
        for vname, fields in (("infer", {}), ("infer_sep", {"sout_chunks": 0})):
            with torch.no_grad(), config_override({"gdn_chunk": fields} if fields else {}):
                fwd_line(vname, _run(gq.chunk_gated_delta_rule, xs, do, dht, h0=h0, fwd_only=True,
                                     use_qk_l2norm_in_kernel=True))
        if fla is not None:
            fwd_line("fla", _run(fla, xs, do, dht, h0=h0, fwd_only=True, use_qk_l2norm_in_kernel=True))


if __name__ == "__main__":
    main()
