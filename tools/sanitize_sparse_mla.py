"""Adversarial sparse indices and block tables through ``gq.mla_decode`` and ``gq.mla_sparse_prefill`` on the GPU,
for ``compute-sanitizer``.

    compute-sanitizer --tool memcheck python -m tools.sanitize_sparse_mla [SEEDS] [--impl auto|triton|gluon]

must report 0 errors and exit 0 (SEEDS: seeds of every case, an integer, default 3).
Indices hold huge, negative, INT32 extremes, >= cache_seqlens, beyond the block table, repeated values; block
tables hold junk page ids (each case with pages of a multiple of 16 also runs dense over them; pages of 2 and 61
tokens run sparse only); topk_length is negative, 0, or past topk. The same decode cases run over each of FlashMLA's
quantised layouts (``fp8.py``: V3.2 rows with and without rope dense and sparse, MODEL1 / V4.1 / V4.1 fp4 pages
sparse). The prefill takes the same kinds of rows over a latent tensor of a few rows. Every result is also checked
against the float64 reference, so the run fails loudly (exit 1) on a wrong answer too.
"""

from __future__ import annotations

import argparse
import sys

import torch

import gqla_triton as gq
from gqla_triton.ops.mla.fp8 import PAGED
from tools._common import reference

mla_decode_ref = reference("mla_decode_ref")
mla_sparse_prefill_ref = reference("mla_sparse_prefill_ref")

I32_MIN, I32_MAX = -(2**31), 2**31 - 1
DTYPE = torch.bfloat16


def case(seed, B, s_q, h_q, r, dr, page, topk, causal, num_splits, impl="auto", layout=None):
    g = torch.Generator().manual_seed(seed)
    D = r + dr
    max_pages = 5
    num_pages = B * max_pages + 2
    lens = torch.randint(0, max_pages * page + 1, (B,), generator=g).int()
    bt = torch.randperm(num_pages, generator=g)[: B * max_pages].reshape(B, max_pages).int()
    junk_bt = torch.tensor([-1, num_pages, I32_MAX, I32_MIN], dtype=torch.int32)
    bt = torch.where(torch.rand(B, max_pages, generator=g) < 0.2, junk_bt[torch.randint(0, 4, (B, max_pages),
                                                                                        generator=g)], bt)
    idx = torch.randint(0, max_pages * page * 2, (B, s_q, topk), generator=g)
    junk = torch.tensor([-1, -2, I32_MAX, I32_MIN, I32_MAX - 63, max_pages * page, 10**9], dtype=torch.int64)
    kind = torch.randint(0, 4, (B, s_q, topk), generator=g)
    idx = torch.where(kind == 0, junk[torch.randint(0, len(junk), (B, s_q, topk), generator=g)], idx)
    idx = torch.where(kind == 1, idx[..., :1].expand_as(idx), idx)  # repeats
    idx = idx.int()
    topk_length = torch.tensor([[-3, 0, topk, topk + 100, 1][i % 5] for i in range(B)], dtype=torch.int32)
    q = torch.randn(B, s_q, h_q, D, generator=g).to(DTYPE)
    kv = torch.randn(num_pages, page, 1, D, generator=g).to(DTYPE)
    if layout is not None:  # the same values in one of FlashMLA's quantised layouts
        kv = gq.quantize_latent_fp8(kv.float(), layout=layout)
    cu = lambda t: t.cuda()  # noqa: E731
    calls = ((idx, None), (idx, topk_length), (None, None))  # the last: dense over the junk block table
    for ix, tkl in calls[:2] if page % 16 or layout in PAGED else calls:
        out, lse = gq.mla_decode(cu(q), cu(kv), cu(bt), cu(lens), head_dim_v=r, causal=causal,
                              indices=None if ix is None else cu(ix), topk_length=None if tkl is None else cu(tkl),
                              num_splits=num_splits, impl=impl, kv_format=layout)
        torch.cuda.synchronize()
        ro, rl = mla_decode_ref(q, kv, bt, lens, head_dim_v=r, causal=causal, indices=ix, topk_length=tkl,
                                kv_format=layout)
        err = (out.double().cpu() - ro).norm() / ro.norm().clamp(min=1e-30)
        fin = torch.isfinite(rl)
        bad = (not torch.equal(torch.isfinite(lse.cpu()), fin)) or err > 3e-2 or not torch.isfinite(out).all()
        if bad:
            print(f"FAIL seed={seed} B={B} s_q={s_q} h_q={h_q} topk={topk} causal={causal} splits={num_splits} "
                  f"layout={layout} err={float(err):.3e}")
            return False
    return True


def prefill_case(seed, s_q, h_q, r, dr, s_kv, topk, impl="auto"):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 2 * s_kv, (s_q, 1, topk), generator=g)
    junk = torch.tensor([-1, -2, I32_MAX, I32_MIN, s_kv, 10**9], dtype=torch.int64)
    idx = torch.where(torch.rand(s_q, 1, topk, generator=g) < 0.3, junk[torch.randint(0, len(junk), idx.shape,
                                                                                      generator=g)], idx).int()
    tkl = torch.tensor([[-3, 0, topk, topk + 100, 1][i % 5] for i in range(s_q)], dtype=torch.int32)
    q = torch.randn(s_q, h_q, r + dr, generator=g).to(DTYPE)
    kv = torch.randn(s_kv, 1, r + dr, generator=g).to(DTYPE)
    got = gq.mla_sparse_prefill(q.cuda(), kv.cuda(), idx.cuda(), r, None, tkl.cuda(), impl=impl)
    torch.cuda.synchronize()
    ro, rm, rl = mla_sparse_prefill_ref(q, kv, idx, r, None, tkl)
    err = (got.out.double().cpu() - ro).norm() / ro.norm().clamp(min=1e-30)
    bad = (err > 3e-2 or not torch.equal(torch.isfinite(got.lse.cpu()), torch.isfinite(rl))
           or not torch.equal(torch.isfinite(got.max_logits.cpu()), torch.isfinite(rm)))
    if bad:
        print(f"FAIL prefill seed={seed} s_q={s_q} h_q={h_q} s_kv={s_kv} topk={topk} err={float(err):.3e}")
    return not bad


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tools.sanitize_sparse_mla", description=(
        "Adversarial sparse indices and block tables through gq.mla_decode and gq.mla_sparse_prefill on the GPU, "
        "for compute-sanitizer."))
    ap.add_argument("seeds", nargs="?", type=int, default=3, help="seeds of every case (3)")
    ap.add_argument("--impl", choices=("auto", "triton", "gluon"), default="auto")
    a = ap.parse_args(argv)
    impl, seeds = a.impl, a.seeds
    ok = True
    n = 0
    for seed in range(seeds):
        for (r, dr, h_q, page) in ((512, 64, 128, 64), (512, 64, 16, 16), (256, 64, 64, 32), (512, 64, 64, 2),
                                   (512, 64, 128, 61)):
            for topk, s_q, causal, ns in ((64, 1, True, 0), (200, 2, True, 3), (2048, 1, False, 0), (33, 3, True, 1)):
                ok &= case(seed, 3, s_q, h_q, r, dr, page, topk, causal, ns, impl)
                n += 1
        for layout, dr in (("v32", 64), ("v32_no_rope", 0), ("model1", 0), ("v41", 0), ("v41_fp4", 0)):
            if impl == "gluon" and layout != "v32":  # the Gluon kernel reads the V3.2 rows only
                continue
            for (h_q, page) in ((128, 64), (16, 61)):
                if impl == "gluon" and page % 16:
                    continue
                for topk, s_q, causal, ns in ((200, 2, True, 3), (2048, 1, False, 0)):
                    ok &= case(seed, 3, s_q, h_q, 512, dr, page, topk, causal, ns, impl, layout)
                    n += 1
        if impl != "gluon":  # the prefill runs the portable kernel
            for (s_q, h_q, dr, s_kv, topk) in ((5, 128, 64, 3, 64), (7, 64, 0, 300, 2048), (300, 128, 64, 1000, 128)):
                ok &= prefill_case(seed, s_q, h_q, 512, dr, s_kv, topk, impl)
                n += 1
    print(f"{n} adversarial cases, impl={impl} (decode: sparse twice, dense once on pages of 16k tokens of bf16 or "
          f"per-token FP8 rows; prefill once): "
          f"{'all OK' if ok else 'FAILURES'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
