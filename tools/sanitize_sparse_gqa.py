"""Adversarial indices and block tables through the sparse ``gq.gqa_decode`` on the GPU, for ``compute-sanitizer``.

    compute-sanitizer --tool memcheck python -m tools.sanitize_sparse_gqa

must report 0 errors and exit 0. Caches are allocated exactly (no slack pages), block tables hold
out-of-range and negative page ids, and
indices hold -1, huge, negative, duplicate, just-past-the-end and beyond-the-block-table positions, shared
and per group, with and without ``topk_length`` (also negative / larger than topk), s_q 1..3, several split
counts. Every result is also checked against the float64 reference; any mismatch or memcheck error fails.
"""

from __future__ import annotations

import argparse
import sys

import torch

import gqla_triton as gq
from tools._common import reference

gqa_decode_reference = reference("gqa_decode_reference")


def adversarial(seed: int, *, B=3, s_q=2, g=2, G=16, d_h=64, d_r=32, d_v=64, page=16, topk=64, per_group=False,
                with_len=True, splits=0, causal=True, dtype=torch.bfloat16, dev="cuda"):
    gen = torch.Generator().manual_seed(seed)
    pages_per = 4
    num_pages = B * pages_per - 1  # one page fewer than the table names: the last entry is out of range
    q = torch.randn(B, s_q, g * G, d_h + d_r, generator=gen).to(dev, dtype)
    k = torch.randn(num_pages, page, g, d_h, generator=gen).to(dev, dtype)
    v = torch.randn(num_pages, page, g, d_v, generator=gen).to(dev, dtype)
    kr = torch.randn(num_pages, page, d_r, generator=gen).to(dev, dtype) if d_r else None
    bt = torch.randperm(B * pages_per, generator=gen).reshape(B, pages_per)  # contains id == num_pages
    bt[0, 1] = -5  # negative page id
    bt[-1, 0] = 2**31 - 1  # huge page id
    bt = bt.to(torch.int32).to(dev)
    max_len = pages_per * page
    lens = torch.randint(0, max_len + 40, (B,), generator=gen)  # some longer than the block table covers
    lens[0] = max_len + 100
    lens = lens.to(torch.int32).to(dev)
    shape = (B, s_q, g, topk) if per_group else (B, s_q, topk)
    idx = torch.randint(-3, max_len + 200, shape, generator=gen)
    bad = torch.tensor([-1, -(2**31), 2**31 - 1, 2**30, -2, max_len, max_len + 16 * page, 10**9])
    idx = torch.where(torch.rand(shape, generator=gen) < 0.4, bad[torch.randint(0, len(bad), shape, generator=gen)],
                      idx)
    idx = torch.where(torch.rand(shape, generator=gen) < 0.2, idx[..., :1].expand(shape), idx)  # duplicates
    idx = idx.to(torch.int32).to(dev)
    tl_ = torch.tensor([topk + 7, -3, topk // 2][:B] + [5] * max(0, B - 3), dtype=torch.int32, device=dev) \
        if with_len else None
    args = (q, k, v, bt, lens, kr)
    out, lse = gq.gqa_decode(*args, causal=causal, indices=idx, topk_length=tl_, num_splits=splits)
    if dev == "cuda":
        torch.cuda.synchronize()
    ref_o, ref_l = gqa_decode_reference(*args, causal=causal, indices=idx, topk_length=tl_)
    err = (out.double().cpu() - ref_o).abs().max().item()
    fin = torch.isfinite(ref_l)
    lse_ok = torch.equal(torch.isfinite(lse.cpu()), fin) and \
        (lse.double().cpu()[fin] - ref_l[fin]).abs().max().item() < 5e-2 if fin.any() else True
    return err, lse_ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.sanitize_sparse_gqa", description=__doc__.splitlines()[0])
    ap.parse_args(argv)
    bad = 0
    n = 0
    for seed in range(6):
        for s_q in (1, 3):
            for per_group in (False, True):
                for splits in (0, 3):
                    err, lse_ok = adversarial(seed, s_q=s_q, per_group=per_group, splits=splits,
                                              with_len=seed % 2 == 0, causal=seed % 3 != 1,
                                              G=(16, 4, 32)[seed % 3], d_r=(32, 0)[seed % 2])
                    n += 1
                    if not (err < 5e-2 and lse_ok):
                        bad += 1
                        print(f"MISMATCH seed={seed} s_q={s_q} per_group={per_group} splits={splits}: "
                              f"max|out-ref|={err:.3e} lse_ok={lse_ok}")
    print(f"sanitize_sparse_gqa: {n} runs, {bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
