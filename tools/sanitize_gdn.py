"""``gq.chunk_gated_delta_rule`` forward + backward over small edge-case shapes, and the adversarial cases of
``ADVERSARIAL`` (shared with ``tests/test_adversarial_gdn.py``), for ``compute-sanitizer``.

    compute-sanitizer --tool memcheck python -m tools.sanitize_gdn      (also: --tool racecheck / initcheck)

must report 0 errors and exit 0. Without a GPU, ``TRITON_INTERPRET=1 python -m tools.sanitize_gdn`` runs the same
cases in float32 in Triton's interpreter (a check of the script and of the interpreter's address checks).
bf16, K = V = 128, l2-normalised q/k, initial state + final state; T in (1, 63, 65, 200) for B in (1, 2) and
GVA (HV = 2H), plus varlen (with an empty sequence). Each result (o, final state, all six gradients) is checked
against the float64 recurrence with the data-derived tolerance err <= 2·err(torch bf16 chunk ref) + 2e-2,
so a wrong answer also fails (exit 1).

Adversarial cases (``chunk_cases()``, ``decode_cases()``): g = -inf at chosen tokens, one NaN / Inf in q, k, v,
beta or g, varlen with empty and 1 / 63 / 64 / 65-token sequences, GVA, l2 on and off; decode with -inf gates,
NaN tokens, negative / strided / out-of-pool state indices (the kernel's own guard). Each is checked against the
float64 recurrence: exactly the elements the reference has non-finite are non-finite, the rest within
2·err(torch at the kernel's precision) + eps.
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

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


# ----------------------------------------------------------------------------------------- adversarial cases
NAN, INF = float("nan"), float("inf")


@dataclass(frozen=True)
class ChunkCase:
    """One hostile call of chunk_gated_delta_rule: sequences ``lens`` (dense B x T when not varlen: all equal),
    g = -inf at flat tokens ``ginf``, and ``poke`` = (input, flat token, value) written into one element."""

    name: str
    lens: tuple[int, ...]
    varlen: bool = False
    H: int = 1
    HV: int = 2
    l2: bool = True
    ginf: tuple[int, ...] = ()
    poke: tuple | None = None
    grads: bool = False


def chunk_cases() -> list[ChunkCase]:
    cs = []
    for pos in ((0,), (63,), (64,), (30,), (30, 31), (63, 64, 65), tuple(range(70))):
        cs.append(ChunkCase(f"ginf{list(pos[:3])}", (70,), ginf=pos, grads=pos == (30,)))
    cs.append(ChunkCase("ginf varlen", (0, 1, 63, 64, 65), varlen=True, ginf=(0, 1, 70, 128, 192), grads=True))
    cs.append(ChunkCase("ginf gva4 nol2", (66, 66), H=1, HV=4, l2=False, ginf=(5, 64 + 66)))
    for name in ("q", "k", "v", "beta", "g"):
        for p, val in ((0, NAN), (40, INF), (64, NAN)):
            cs.append(ChunkCase(f"{name}[{p}]={val}", (70,), l2=name in ("q", "k") and p == 40, poke=(name, p, val)))
    cs.append(ChunkCase("g[10]=-inf then v[5]=nan", (70,), ginf=(10,), poke=("v", 5, NAN)))
    cs.append(ChunkCase("varlen nan seq2", (63, 0, 65, 1), varlen=True, H=2, HV=4, poke=("k", 63 + 30, NAN)))
    cs.append(ChunkCase("varlen inf last token", (64, 65), varlen=True, poke=("v", 128, INF)))
    cs.append(ChunkCase("varlen 1/63/64/65", (1, 63, 64, 65, 0), varlen=True, H=2, HV=2))
    cs.append(ChunkCase("dense B=2 nan", (66, 66), poke=("beta", 66 + 3, NAN)))
    return cs


def _poke(t, flat, val):
    """Write val into one element of t at flat token index ``flat`` (rows B·T), head 0 / value head 1, channel 3."""
    T = t.shape[1]
    idx = (flat // T, flat % T) + ((1,) if t.dim() == 3 else (min(1, t.shape[2] - 1), 3))
    t[idx] = val


def chunk_inputs(case: ChunkCase, K: int, V: int, seed: int = 0):
    """fp64 CPU inputs (q, k, v, g, beta, h0) and cu_seqlens (or None) of a case."""
    gen = torch.Generator().manual_seed(seed)
    B, T = (1, sum(case.lens)) if case.varlen else (len(case.lens), case.lens[0])
    N = len(case.lens)
    q = torch.randn(B, T, case.H, K, generator=gen, dtype=torch.float64)
    k = torch.randn(B, T, case.H, K, generator=gen, dtype=torch.float64)
    if not case.l2:
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(B, T, case.HV, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(B, T, case.HV, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, case.HV, generator=gen, dtype=torch.float64) * 0.9 + 0.05
    h0 = torch.randn(N, case.HV, K, V, generator=gen, dtype=torch.float64) * 0.5
    for p in case.ginf:
        g[p // T, p % T] = -INF
    if case.poke is not None:
        name, p, val = case.poke
        _poke({"q": q, "k": k, "v": v, "g": g, "beta": beta}[name], p, val)
    cu = torch.tensor([0, *torch.tensor(case.lens).cumsum(0).tolist()], dtype=torch.int64) if case.varlen else None
    return [q, k, v, g, beta, h0], cu


def compare(name, out, ref64, lowp, eps):
    """'' when out has non-finite values exactly where ref64 has and err(out) <= 2·err(lowp) + eps on the rest;
    else what is wrong."""
    out, ref64, lowp = (t.detach().cpu().double() for t in (out, ref64, lowp))
    fin = torch.isfinite(ref64)
    if not torch.equal(torch.isfinite(out), fin):
        wrong = (torch.isfinite(out) != fin).nonzero()
        return (f"{name}: non-finite pattern differs from the reference at {wrong.shape[0]} elements, e.g. "
                f"{wrong[0].tolist()}")
    r = ref64[fin]
    n = r.norm().clamp_min(1e-30)
    e = ((out[fin] - r).norm() / n).item()
    lf = lowp[fin]
    el = ((lf - r).norm() / n).item() if bool(torch.isfinite(lf).all()) else 0.0
    if e > 2 * el + eps:
        return f"{name}: err {e:.3g} > 2·{el:.3g} + {eps:g}"
    return ""


def run_chunk_case(case: ChunkCase, *, device, dtype, K, V, wrap=None) -> list[str]:
    """Run one case (``wrap(tensors)``: a context manager given every tensor passed in, e.g. an address check);
    returns the failures."""
    ins, cu = chunk_inputs(case, K, V)
    grads = case.grads
    xs = [x.to(device, dtype if i < 5 else torch.float32) for i, x in enumerate(ins)]
    if grads:
        xs = [x.requires_grad_() for x in xs]
    cud = cu.to(device) if cu is not None else None
    ctx = wrap([*xs, cud]) if wrap is not None else contextlib.nullcontext()
    with ctx:
        o, ht = gq.chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True,
                                          use_qk_l2norm_in_kernel=case.l2, cu_seqlens=cud)
        outs = [o, ht]
        if grads:
            gg = torch.Generator().manual_seed(7)
            do = torch.randn(o.shape, generator=gg, dtype=torch.float64).to(device, o.dtype)
            dht = torch.randn(ht.shape, generator=gg, dtype=torch.float64)
            torch.autograd.backward([o, ht], [do, dht.to(device)])
            outs += [x.grad for x in xs]
    if device == "cuda":
        torch.cuda.synchronize()
    low = [x.to(dtype).double() if i < 5 else x.float().double() for i, x in enumerate(ins)]

    def ref(fn, ts, **kw):
        ts = [t.detach().clone().requires_grad_(grads) for t in ts]
        o, ht = fn(*ts[:5], initial_state=ts[5], output_final_state=True, use_qk_l2norm=case.l2, cu_seqlens=cu,
                   **kw)
        res = [o, ht]
        if grads:
            torch.autograd.backward([o, ht], [do.cpu().to(o.dtype), dht.to(ht.dtype)])
            res += [t.grad for t in ts]
        return res

    r64 = ref(recurrent_gated_delta_rule_ref, low)
    rlp = ref(chunk_gated_delta_rule_ref, [x.float() for x in low],
              compute_dtype=dtype if dtype != torch.float32 else None)
    eps = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    bad = [compare(n, a, r, lw, eps) for n, a, r, lw in zip(NAMES[:len(outs)], outs, r64, rlp, strict=True)]
    return [b for b in bad if b]


@dataclass(frozen=True)
class DecodeCase:
    """One hostile call of gated_delta_rule_decode: B sequences of s tokens, pool rows ``idx`` (None: default),
    g = -inf at (sequence, token) pairs ``ginf``, ``poke`` = (input, sequence, token, value); ``kernel_only``
    launches gated_delta_rule_decode_fwd directly (the kernel's own guard for indices the host check refuses)."""

    name: str
    B: int = 3
    s: int = 3
    H: int = 1
    HV: int = 2
    P: int = 5
    idx: tuple | None = None
    stride: int = 1
    l2: bool = True
    ginf: tuple = ()
    poke: tuple | None = None
    kernel_only: bool = False


def decode_cases() -> list[DecodeCase]:
    cs = [DecodeCase("default idx"), DecodeCase("ginf", ginf=((0, 0), (1, 1), (2, 2))),
          DecodeCase("ginf all", ginf=tuple((b, t) for b in range(3) for t in range(3)), l2=False),
          DecodeCase("negative idx", idx=(4, -1, 0)), DecodeCase("strided idx", idx=(2, 0, 4), stride=3),
          DecodeCase("gva4", H=1, HV=4, idx=(1, 3, 0)),
          DecodeCase("out of pool (kernel guard)", idx=(5, 1, 2**31 - 1), kernel_only=True),
          DecodeCase("negative + out of pool (kernel guard)", idx=(-(2**31), 7, 0), kernel_only=True)]
    for name in ("q", "k", "v", "beta", "g"):
        for val in (NAN, INF):
            cs.append(DecodeCase(f"{name}[1,1]={val}", idx=(2, 0, 1), poke=(name, 1, 1, val)))
    return cs


def run_decode_case(case: DecodeCase, *, device, dtype, K, V, wrap=None) -> list[str]:
    from gqla_triton.ops.gdn.decode import gated_delta_rule_decode_fwd

    gen = torch.Generator().manual_seed(1)
    B, s = case.B, case.s
    q = torch.randn(B, s, case.H, K, generator=gen, dtype=torch.float64)
    k = torch.randn(B, s, case.H, K, generator=gen, dtype=torch.float64)
    if not case.l2:
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(B, s, case.HV, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(B, s, case.HV, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, s, case.HV, generator=gen, dtype=torch.float64) * 0.9 + 0.05
    pool = torch.randn(case.P, case.HV, K, V, generator=gen, dtype=torch.float64) * 0.5
    for b, t in case.ginf:
        g[b, t] = -INF
    if case.poke is not None:
        name, b, t, val = case.poke
        x = {"q": q, "k": k, "v": v, "g": g, "beta": beta}[name]
        x[(b, t) + ((1,) if x.dim() == 3 else (min(1, x.shape[2] - 1), 3))] = val
    idx = list(case.idx) if case.idx is not None else list(range(B))
    base = torch.full((B * case.stride,), -7, dtype=torch.int32)
    base[::case.stride] = torch.tensor(idx, dtype=torch.int32)
    idx_d = base.to(device)[::case.stride]
    xs = [t.to(device, dtype) for t in (q, k, v, g, beta)]
    pd = pool.to(device, torch.float32)
    before = pd.clone()
    ctx = wrap([*xs, pd, idx_d]) if wrap is not None else contextlib.nullcontext()
    with ctx:
        if case.kernel_only:
            o = gated_delta_rule_decode_fwd(*[x.contiguous() for x in xs], pd, idx_d.contiguous(), K ** -0.5,
                                            case.l2)
        else:
            o = gq.gated_delta_rule_decode(*xs, pd, idx_d if case.idx is not None else None,
                                           use_qk_l2norm_in_kernel=case.l2)
    if device == "cuda":
        torch.cuda.synchronize()
    o, pd, before = o.cpu(), pd.cpu(), before.cpu()
    bad = []
    live = [b for b in range(B) if 0 <= idx[b] < case.P]
    dead = [b for b in range(B) if b not in live]
    if dead and not torch.equal(o[dead], torch.zeros_like(o[dead])):
        bad.append("skipped sequences: output not 0")
    untouched = [r for r in range(case.P) if r not in [idx[b] for b in live]]
    if not torch.equal(pd[untouched], before[untouched]):
        bad.append("pool rows not indexed were changed")
    if live:
        rows = [idx[b] for b in live]
        low = [t.to(dtype).double()[live] for t in (q, k, v, g, beta)]
        h = before[rows].double()

        def ref(ts, cdt):
            o, ht = recurrent_gated_delta_rule_ref(*[t.to(cdt) for t in ts], initial_state=h.to(cdt),
                                                   output_final_state=True, use_qk_l2norm=case.l2)
            return o, ht

        o64, s64 = ref(low, torch.float64)
        o32, s32 = ref(low, torch.float32)
        eps = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
        bad += [compare("o", o[live], o64, o32.to(dtype), eps), compare("state", pd[rows], s64, s32, 1e-5)]
    return [b for b in bad if b]


def main() -> int:
    ok = True
    for c in chunk_cases():
        bad = run_chunk_case(c, device=DEV, dtype=DTYPE, K=K, V=V)
        print(("FAIL " if bad else "ok   ") + "chunk " + c.name + ("  " + "; ".join(bad) if bad else ""), flush=True)
        ok &= not bad
    for c in decode_cases():
        bad = run_decode_case(c, device=DEV, dtype=DTYPE, K=K, V=V)
        print(("FAIL " if bad else "ok   ") + "decode " + c.name + ("  " + "; ".join(bad) if bad else ""), flush=True)
        ok &= not bad
    for T in (1, 63, 65, 200):
        for B, H, HV in ((1, 1, 1), (2, 1, 1), (2, 2, 4)):
            ok &= case(T, B, T, H, HV)
    for lens in ((0, 1, 64, 65), (63, 0, 137), (200,)):
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        ok &= case(len(lens), 1, int(cu[-1]), 1, 2, cu)
    print("ALL OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
