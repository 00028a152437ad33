"""``gq.chunk_gated_delta_rule`` forward + backward over small edge-case shapes, for ``compute-sanitizer``.

    compute-sanitizer --tool memcheck python -m tools.sanitize_gdn [--cases all|finite|nonfinite|infer]
                                                                   [--dims all|128|odd]
                                                                   (also: --tool racecheck / initcheck)

must report 0 errors and exit 0. Without a GPU, ``TRITON_INTERPRET=1 python -m tools.sanitize_gdn`` runs the same
cases in float32 in Triton's interpreter (a check of the script and of the interpreter's address checks).
bf16, K = V = 128, l2-normalised q/k, initial state + final state; T in (1, 63, 65, 200) for B in (1, 2) and
GVA (HV = 2H: a running sum of two heads; HV = 3H: one slot per head), plus varlen (with an empty sequence).
Each result (o, final state, all six gradients) is checked against the float64 recurrence with the data-derived
tolerance err <= 2·err(torch bf16 chunk ref) + 2e-2, so a wrong answer also fails (exit 1).

Then cu_seqlens values no host check has seen (the device-built plan: negative, past T, decreasing, the int32
extremes, padding before cu[0] and after cu[N]): forward + backward must equal, bitwise, the call with the clamped
bounds (``[0, T]``, running maximum), with zero outputs and gradients for the padding tokens. Under the
interpreter these cases force the device plan (a CPU cu_seqlens is otherwise read and checked on the host).

Then the non-finite cases: one NaN / +inf per input (q, k, v, g, beta, initial state; g = -inf as the valid full
decay) at a token inside a chunk, dense and varlen, K = V = 128 and the masked odd dims K = 24 / V = 20, forward
and backward (the non-finite paths of the marked chunks run here). The output and final state must be non-finite
exactly where the float64 recurrence is and within the tolerance above elsewhere; the gradients of the clean
sequence must be finite.

``--cases infer``: the forward without gradient through the Hopper Gluon kernel (sm_90 only; elsewhere the cases
are listed as not run): V 32 / 64 / 128, dense, varlen with empty and one-token sequences (lengths 1, 0, 63, 64,
65, 130), a state pool with a ``-1`` row, and a sequence split into segments, each with a NaN in v, against the
portable kernel on the same call: the same NaN positions, the rest within 1e-3.
"""

from __future__ import annotations

import math
import sys

import torch

import gqla_triton as gq
from tools._common import reference

chunk_gated_delta_rule_ref = reference("chunk_gated_delta_rule_ref")
recurrent_gated_delta_rule_ref = reference("recurrent_gated_delta_rule_ref")

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: smoke test under TRITON_INTERPRET=1 in fp32
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float32
K = V = 128
NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def rel(a, r):
    return ((a.double() - r).norm() / r.norm().clamp_min(1e-12)).item()


def run(fn, xs, cu, dev, **kw):
    xs = [x.detach().to(dev).requires_grad_() for x in xs]
    o, ht = fn(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu if cu is None else cu.to(dev),
               **kw)
    g = torch.Generator().manual_seed(7)
    do = torch.randn(o.shape, generator=g, dtype=torch.float64).to(dev, o.dtype)
    dht = torch.randn(ht.shape, generator=g, dtype=torch.float64).to(dev, ht.dtype)
    torch.autograd.backward([o, ht], [do, dht])
    return [o, ht] + [x.grad for x in xs]


def case(seed, B, T, H, HV, cu=None):
    g = torch.Generator().manual_seed(seed)
    N = B if cu is None else cu.numel() - 1
    ins = [torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g),
           torch.randn(B, T, HV, V, generator=g), -torch.rand(B, T, HV, generator=g),
           torch.rand(B, T, HV, generator=g) * 0.9 + 0.05, torch.randn(N, HV, K, V, generator=g) * 0.5]
    low = [x.to(DTYPE).double() if i < 5 else x.double() for i, x in enumerate(ins)]
    out = run(gq.chunk_gated_delta_rule, [x.to(DTYPE) if i < 5 else x for i, x in enumerate(ins)], cu, DEV,
              use_qk_l2norm_in_kernel=True)
    if DEV == "cuda":
        torch.cuda.synchronize()
    ref = run(recurrent_gated_delta_rule_ref, low, cu, "cpu", use_qk_l2norm=True)
    lp = run(chunk_gated_delta_rule_ref, [x.float() for x in low], cu, "cpu", use_qk_l2norm=True,
             compute_dtype=DTYPE if DTYPE != torch.float32 else None)
    bad = []
    for name, a, r, lw in zip(NAMES, out, ref, lp, strict=True):
        a = a.cpu()
        e, el = rel(a, r), rel(lw, r)
        if not bool(torch.isfinite(a).all()) or e > 2 * el + 2e-2:
            bad.append(f"{name}: err {e:.3g} vs torch bf16 {el:.3g}")
    tag = f"seed={seed} B={B} T={T} H={H} HV={HV} cu={None if cu is None else cu.tolist()}"
    print(("FAIL " if bad else "ok   ") + tag + ("  " + "; ".join(bad) if bad else ""), flush=True)
    return not bad


def spoil(ins, what, b, tok, val):
    """Copies of ins with ``val`` at token ``tok`` of row ``b`` of input ``what`` (one channel / one entry)."""
    bad = [t.clone() for t in ins]
    t = bad[("q", "k", "v", "g", "beta", "h0").index(what)]
    if what == "h0":
        t[b, 0, 1, 2] = val
    else:
        t[(b, tok, 0, 0)[:t.dim()]] = val
    return bad


def nonfinite_case(K_, V_, what, val, varlen):
    g = torch.Generator().manual_seed(11)
    lens = (50, 100)
    B, T, N = (1, sum(lens), 2) if varlen else (2, max(lens), 2)
    cu = torch.tensor([0, 50, 150], dtype=torch.int32) if varlen else None
    ins = [torch.nn.functional.normalize(torch.randn(B, T, 1, K_, generator=g), dim=-1),
           torch.nn.functional.normalize(torch.randn(B, T, 1, K_, generator=g), dim=-1),
           torch.randn(B, T, 2, V_, generator=g), -torch.rand(B, T, 2, generator=g),
           torch.rand(B, T, 2, generator=g) * 0.9 + 0.05, torch.randn(N, 2, K_, V_, generator=g) * 0.5]
    ins = [x.to(DTYPE).double() if i < 5 else x.double() for i, x in enumerate(ins)]
    b, tok = (0, 90) if varlen else (1, 40)  # the second sequence, token 40 of its first chunk
    bad = spoil(ins, what, b if what != "h0" else 1, tok, val)
    out = run(gq.chunk_gated_delta_rule, [x.to(DTYPE) if i < 5 else x.float() for i, x in enumerate(bad)], cu, DEV)
    if DEV == "cuda":
        torch.cuda.synchronize()
    with torch.no_grad():
        ref = recurrent_gated_delta_rule_ref(*bad[:5], initial_state=bad[5], output_final_state=True,
                                             cu_seqlens=cu)
        lp = chunk_gated_delta_rule_ref(*[x.float() for x in bad[:5]], initial_state=bad[5].float(),
                                        output_final_state=True, cu_seqlens=cu,
                                        compute_dtype=DTYPE if DTYPE != torch.float32 else None)
    bad_msgs = []
    for name, a, r, lw in zip(NAMES[:2], out[:2], ref, lp, strict=True):
        a, fin = a.detach().cpu().double(), torch.isfinite(r)
        if not torch.equal(torch.isfinite(a), fin):
            bad_msgs.append(f"{name}: non-finite pattern differs from the recurrence")
            continue
        z = torch.zeros((), dtype=torch.float64)
        lw = torch.where(fin & torch.isfinite(lw.double()), lw.double(), torch.where(fin, r, z))
        e, el = rel(torch.where(fin, a, z), torch.where(fin, r, z)), rel(lw, torch.where(fin, r, z))
        if e > 2 * el + 2e-2:
            bad_msgs.append(f"{name}: err {e:.3g} vs torch bf16 {el:.3g}")
    clean = (slice(0, 1), slice(0, 50)) if varlen else (slice(0, 1), slice(None))
    for name, gr in zip(NAMES[2:7], out[2:7], strict=True):
        if not bool(torch.isfinite(gr[clean]).all()):
            bad_msgs.append(f"{name}: the clean sequence's gradient is not finite")
    tag = f"nonfinite {what}={val} K={K_} V={V_} {'varlen' if varlen else 'dense'}"
    print(("FAIL " if bad_msgs else "ok   ") + tag + ("  " + "; ".join(bad_msgs) if bad_msgs else ""), flush=True)
    return not bad_msgs


NONFINITE_SPOTS = (("q", math.nan), ("k", math.inf), ("k", math.nan), ("v", math.nan), ("v", -math.inf),
                   ("g", math.nan), ("g", math.inf), ("g", -math.inf), ("beta", math.nan), ("beta", math.inf),
                   ("h0", math.nan))


HOSTILE_CU = ([-5, 40, 30, 10**9], [0, 2**31 - 1, 7], [7, 7, 100, 90, 150], [20, 64, 130], [0, 150, -3, 150],
              [-(2**31), 1, 2])


def hostile_cu_cases() -> bool:
    """The device plan over each of HOSTILE_CU (T = 150, GVA HV = 2H) against the clamped bounds, bitwise."""
    import gqla_triton.ops.gdn.plan as plan_mod

    on_device = plan_mod.plans_on_device
    plan_mod.plans_on_device = lambda cu: True  # a no-op on the GPU: a cuda cu_seqlens plans on the device anyway
    ok = True
    try:
        g = torch.Generator().manual_seed(5)
        T = 150
        for raw in HOSTILE_CU:
            N = len(raw) - 1
            ins = [torch.randn(1, T, 1, K, generator=g), torch.randn(1, T, 1, K, generator=g),
                   torch.randn(1, T, 2, V, generator=g), -torch.rand(1, T, 2, generator=g),
                   torch.rand(1, T, 2, generator=g) * 0.9 + 0.05, torch.randn(N, 2, K, V, generator=g) * 0.5]
            ins = [x.to(DTYPE) if i < 5 else x for i, x in enumerate(ins)]
            clamped, run_ = [], 0
            for c in raw:
                run_ = max(run_, min(max(c, 0), T))
                clamped.append(run_)
            outs = [run(gq.chunk_gated_delta_rule, ins, torch.tensor(c, dtype=torch.int64), DEV,
                        use_qk_l2norm_in_kernel=True) for c in (raw, clamped)]
            if DEV == "cuda":
                torch.cuda.synchronize()
            msgs = [name for name, a, b in zip(NAMES, *outs, strict=True) if not torch.equal(a, b)]
            pad = torch.ones(T, dtype=torch.bool)
            pad[clamped[0]:clamped[-1]] = False
            msgs += [f"{name} padding" for name, a in zip(NAMES, outs[0], strict=True)
                     if name not in ("final_state", "dh0") and bool((a[0, pad] != 0).any())]
            tag = f"cu_seqlens {raw} (clamped {clamped})"
            print(("FAIL " if msgs else "ok   ") + tag + ("  differs: " + ", ".join(msgs) if msgs else ""), flush=True)
            ok &= not msgs
    finally:
        plan_mod.plans_on_device = on_device
    return ok


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", choices=("all", "finite", "nonfinite", "infer"), default="all")
    ap.add_argument("--dims", choices=("all", "128", "odd"), default="all",
                    help="head dims of the non-finite cases: K = V = 128, K 24 / V 20 (masked tiles), or both")
    args = ap.parse_args(argv)
    which = args.cases
    dims = {"all": ((128, 128), (24, 20)), "128": ((128, 128),), "odd": ((24, 20),)}[args.dims]
    ok = True
    if which == "infer":
        ok &= infer_cases()
    if which in ("all", "finite"):
        ok &= finite_cases()
        ok &= hostile_cu_cases()
    if which in ("all", "nonfinite"):
        for K_, V_ in dims:
            for i, (what, val) in enumerate(NONFINITE_SPOTS):
                ok &= nonfinite_case(K_, V_, what, val, varlen=bool(i % 2))
    print("ALL OK" if ok else "MISMATCH")
    return 0 if ok else 1


def infer_cases() -> bool:
    """``--cases infer`` (module docstring): the Gluon kernel against the portable one, no autograd."""
    from gqla_triton.dispatch import config_override

    if DEV != "cuda" or torch.cuda.get_device_capability() != (9, 0):
        print("not run: the Gluon GDN kernel needs an sm_90 GPU", flush=True)
        return True
    ok = True
    split = {"seg_units": 64, "seg_below": 16, "seg_min": 2}
    for V_ in (32, 64, 128):
        for kind in ("dense", "varlen", "pool", "split"):
            g = torch.Generator().manual_seed(V_)
            lens = (1, 0, 63, 64, 65, 130) if kind != "split" else (700,)
            B, T, N = (2, 130, 2) if kind == "dense" else (1, sum(lens), len(lens))
            cu = None if kind == "dense" else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()],
                                                          dtype=torch.int32, device=DEV)
            q, k = (torch.nn.functional.normalize(torch.randn(B, T, 1, K, generator=g), dim=-1) for _ in range(2))
            v = torch.randn(B, T, 2, V_, generator=g)
            v[0, min(T - 1, 100), 1, 3] = math.nan
            gg, beta = -torch.rand(B, T, 2, generator=g), torch.rand(B, T, 2, generator=g) * 0.9 + 0.05
            rows = N + 2 if kind == "pool" else N
            h0 = torch.randn(rows, 2, K, V_, generator=g) * 0.5
            xs = [x.to(DEV, DTYPE) for x in (q, k, v, gg, beta)]
            kw = {}
            if kind == "pool":
                idx = torch.randperm(rows, generator=g)[:N].to(torch.int32)
                idx[1] = -1
                kw["state_indices"] = idx.to(DEV)
            outs = []
            for impl in ("gluon", "triton"):
                pool = h0.to(DEV).clone()
                over = {"sout_chunks": 1 << 20, "sout_waves": 1 << 20, "sout_gluon_units": 0, "sout_impl": impl,
                        **(split if kind == "split" else {})}
                with torch.no_grad(), config_override({"gdn_chunk": over}):
                    o, ht = gq.chunk_gated_delta_rule(*xs, initial_state=pool, cu_seqlens=cu,
                                                      output_final_state="state_indices" not in kw, **kw)
                outs.append((o, pool if ht is None else ht))
            torch.cuda.synchronize()
            msgs = []
            for name, a, b in zip(("o", "final_state"), *outs, strict=True):
                if not torch.equal(a.isnan(), b.isnan()):
                    msgs.append(f"{name}: NaN positions differ")
                    continue
                fin = ~a.isnan()
                if fin.any() and rel(a[fin], b[fin].double()) > 1e-3:
                    msgs.append(f"{name}: err {rel(a[fin], b[fin].double()):.3g}")
            tag = f"infer gluon V={V_} {kind}"
            print(("FAIL " if msgs else "ok   ") + tag + ("  " + "; ".join(msgs) if msgs else ""), flush=True)
            ok &= not msgs
    return ok


def finite_cases() -> bool:
    ok = True
    for T in (1, 63, 65, 200):
        for B, H, HV in ((1, 1, 1), (2, 1, 1), (2, 2, 4), (1, 1, 3)):
            ok &= case(T, B, T, H, HV)
    for lens in ((0, 1, 64, 65), (63, 0, 137), (200,)):
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        ok &= case(len(lens), 1, int(cu[-1]), 1, 2, cu)
    return ok


if __name__ == "__main__":
    sys.exit(main())
